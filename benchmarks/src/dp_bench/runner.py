"""dp-bench's one experiment runner: a plan of cells, one run key, learning-rate rounds chosen from the stored runs,
one store shared by the workers (:class:`~dp_bench.store.SharedResult`), the loop that trains what is missing, and
one report protocol (upgrade → analyze → tables → plot) through which every command writes its result.

``dp-bench grid``, ``dp-bench federated`` and ``dp-bench centralized`` fill in the plan: each says which cells it
plans, which learning rates a cell runs now (:class:`Schedule`), how one run is trained, and its report. Start the
same ``--resume`` command once per core: every worker walks the plan in its order and trains the first run it can
claim (:func:`next_run`); a tuning round is chosen once all its runs are stored, as a pure function of them, so every
worker sees the same rounds (:func:`tune_round`).

Every command that writes a result JSON does it through :func:`write` (atomic: a temporary file renamed over it) and
answers ``--replot`` with :func:`replot`: the tables and the plot again from the JSON alone, after
:func:`load` has brought a stored JSON to the current format (``upgrade``: e.g. old run keys rekeyed to
:func:`run_key`'s one format).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .lr_rule import lr_edge_step
from .store import POLL_SECONDS, SharedResult, atomic_write_json

__all__ = [
    "Cell",
    "Report",
    "Schedule",
    "drive",
    "finish",
    "load",
    "next_run",
    "replot",
    "run_key",
    "tune_round",
    "write",
]


def run_key(phase: str, method: str, *, eps: float, seed: int, lr: float, cell: Sequence[str] = ()) -> str:
    """The one run-key format: ``phase|method|<cell parts>|eps<ε>|s<seed>|lr<lr>`` (``%g`` numbers)."""
    return _prefix(phase, method, eps, seed, cell) + f"{lr:g}"


def _prefix(phase: str, method: str, eps: float, seed: int, cell: Sequence[str]) -> str:
    return "|".join([phase, method, *cell, f"eps{eps:g}", f"s{seed}", "lr"])


@dataclass(frozen=True)
class Cell:
    """One planned (phase, method, ε, seed) of a command, ``cell`` its further key parts (the grid's optimizer and
    batch); its runs differ only in the learning rate."""

    phase: str
    method: str
    eps: float
    seed: int
    cell: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        """The keys of the cell's runs up to the learning rate."""
        return _prefix(self.phase, self.method, self.eps, self.seed, self.cell)

    def key(self, lr: float) -> str:
        return f"{self.prefix}{lr:g}"


class Schedule(Protocol):
    """A command's part of the schedule."""

    def lrs(self, cell: Cell, result: dict[str, Any]) -> list[float] | None:
        """The learning rates ``cell`` runs now: its open tuning round, or the chosen rate of an evaluation cell;
        ``[]`` when nothing more is to run; None while the rate it needs is still being chosen."""
        ...


def tune_round(
    runs: Mapping[str, dict[str, Any]],
    cells: Sequence[Cell],
    base: Sequence[float],
    extensions: int,
    metric: Callable[[dict[str, Any]], float],
) -> tuple[list[list[float]], float | None, dict[float, float]]:
    """``(to run, best, tried)`` of one arm's tuning ``cells`` (one per tuning seed), from the stored ``runs``
    (key → record) alone. ``tried``: the mean ``metric`` over the cells of every rate stored for all of them. First
    ``base``; once all of it is stored in every cell, the best of ``tried`` and, when it lies at an end of what was
    tried, the next value outward (a factor 2, at most ``extensions`` times: :func:`dp_bench.lr_rule.lr_edge_step`).
    ``to run``: per cell, the round's rates it has not stored; ``best`` is None while a round is open."""
    scores = [{float(k[len(c.prefix) :]): metric(r) for k, r in runs.items() if k.startswith(c.prefix)} for c in cells]
    complete = set.intersection(*(set(s) for s in scores)) if scores else set()
    tried = {lr: sum(s[lr] for s in scores) / len(scores) for lr in sorted(complete)}
    if any(lr not in complete for lr in base):
        wanted, best = list(base), None
    else:
        best, wanted = lr_edge_step(tried, list(base), extensions)
    todo = [[lr for lr in wanted if lr not in s] for s in scores]
    return todo, (None if any(todo) else best), tried


def next_run(
    runs: Mapping[str, Any],
    plan: Sequence[Cell],
    schedule: Schedule,
    result: dict[str, Any],
    claim: Callable[[str], bool],
) -> tuple[tuple[Cell, float, str] | None, bool, int]:
    """``(run, waiting, done)``: the first run of ``plan`` (in its order) that ``claim`` grants — ``(cell, lr, key)``
    or None —, whether some run is not stored yet but cannot be claimed now (another worker trains it, or its cell's
    learning rate is not chosen yet), and how many planned cells are complete. A worker that waits for another's
    tuning run moves on to the next cell instead of idling."""
    waiting, done = False, 0
    for cell in plan:
        lrs = schedule.lrs(cell, result)
        if lrs is None:
            waiting = True
            continue
        keys = {cell.key(lr): lr for lr in lrs}
        missing = [k for k in keys if k not in runs]
        if not missing:
            done += 1
            continue
        mine = next((k for k in missing if claim(k)), None)
        if mine is not None:
            return (cell, keys[mine], mine), True, done
        waiting = True
    return None, waiting, done


def drive(
    store: SharedResult,
    plan: Sequence[Cell],
    schedule: Schedule,
    train: Callable[[Cell, float], dict[str, Any]],
    *,
    desc: str,
    stop: Callable[[], bool] | None = None,
    poll: float = POLL_SECONDS,
) -> bool:
    """Train every planned run not stored yet (:func:`next_run`), storing each when it ends, then wait for the
    other workers' last runs. ``stop()``: checked before each run; True ends the loop early (the return value)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(plan), desc=desc, unit="cell")
    stopped = False
    while True:
        store.sync()
        run, waiting, done = next_run(store.runs(), plan, schedule, store.result, store.claim)
        bar.update(done - bar.n)
        if run is None:
            if not waiting:
                break
            time.sleep(poll)  # every open run is another worker's, or waits for a choice that needs them
            continue
        cell, lr, key = run
        if stop is not None and stop():
            store.release(key)
            stopped = True
            break
        store.put(key, train(cell, lr))
    bar.close()
    store.wait_until_idle()
    return stopped


@dataclass(frozen=True)
class Report:
    """A command's report: its Markdown ``tables`` of a result, and optionally its ``plot`` (a PNG), its
    ``analyze`` (stored under ``"analysis"``) and its ``upgrade`` (a stored JSON brought to the current format).
    A report module with functions of these names is a report too."""

    tables: Callable[[dict[str, Any]], str]
    plot: Callable[[dict[str, Any], Path], None] | None = None
    analyze: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _part(report: Any, name: str) -> Callable[..., Any] | None:
    return getattr(report, name, None)


def load(path: Path, report: Any) -> dict[str, Any]:
    """The result stored at ``path``, in the current format (the report's ``upgrade``, if any)."""
    result = json.loads(Path(path).read_text())
    upgrade = _part(report, "upgrade")
    return upgrade(result) if upgrade is not None else result


def finish(
    result: dict[str, Any], report: Any, png: Path | None, save: Callable[[], None], *, show: bool = True
) -> dict[str, Any]:
    """The analysis into ``result`` (when the report has one), ``save()`` (the JSON), the plot at ``png`` (when
    given and the report draws one); the tables printed unless ``show`` is False."""
    analyze = _part(report, "analyze")
    if analyze is not None:
        result["analysis"] = analyze(result)
    save()
    plot = _part(report, "plot")
    if png is not None and plot is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(result, png)
    if show:
        print(report.tables(result))
    return result


def write(result: dict[str, Any], report: Any, path: Path, png: Path | None = None, **dumps: Any) -> dict[str, Any]:
    """:func:`finish` with the JSON written atomically to ``path`` (``json.dumps`` options ``dumps``)."""

    return finish(result, report, png, lambda: atomic_write_json(path, result, **dumps))


def replot(path: Path, report: Any, png: Path | None, dumps: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``--replot``: the tables and the plot again from the JSON at ``path`` alone (:func:`load`); with an analysis,
    it is recomputed and the JSON rewritten with it (``json.dumps`` options ``dumps``)."""
    result = load(path, report)
    if _part(report, "analyze") is None:
        return finish(result, report, png, lambda: None)
    return write(result, report, path, png, **(dumps or {}))
