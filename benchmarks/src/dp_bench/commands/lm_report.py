"""The report of a causal-LM grid (``dp-bench grid --model smollm2``), from its JSON only: the metrics that
``docs/results.md`` §10 fixed before its runs.

1. Test perplexity at every evaluated step; paired differences ``none − method`` (positive: the method's
   perplexity is lower).
2. Steps to reach the ``none`` arm's final test perplexity *of the same seed*: the first evaluated step that
   reaches it (never reached: the budget plus one evaluation interval, e.g. 60 for 50 steps evaluated every 10),
   and the fewer-steps fraction ``(steps_none − steps) / steps_none`` (paper A's unit).
3. ε at that step (the PRV accountant's ε after that many steps at the run's noise multiplier, charged as its
   mechanism is: DP-SGD's (σ, q, t), BandMF's (σ, b·q, ⌈t/b⌉); never reached: no value, counted), and the ε saved
   against ``none``.

Every paired interval is a 95 % t-interval over seeds with its paired t-test p, Holm-adjusted within its family
(:func:`families`): §10's denoiser arms (all their steps and metrics) form one, §12.D's noise-mechanism arms
(``bandmf:<b>``, ``cyclic:<b>``: their final-step perplexity) another; every comparison also carries the Holm p over
all of them (``p_holm_all``), shown beside. §12.D's b is the noise-mechanism arm with the best validation score of
its learning-rate runs (:func:`chosen_mechanism`). Verdicts are CI-based: **reproduced** when the
interval excludes 0 in the paper's direction (lower perplexity, fewer steps, ε saved) and does not lie wholly below
the paper's smallest gain, **contradicted** when it lies wholly against that direction or wholly below the smallest
gain, **inconclusive** otherwise. The scores stored with the runs are ``-log`` perplexity
(:func:`dp_bench.lm_task.lm_score`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis import fmt_p, holm, holm_family, mean_std, paired_ci, steps_to_reach
from ..noise_methods import accounting, bands_of
from .grid_report import BASELINE, REFERENCES, best_validation, evaluations

#: paper A's smallest reported gains: 15.6 % fewer steps, 0.17 ε saved (docs/results.md §10, "Metrics")
SMALLEST_GAIN = {"perplexity": 0.0, "fewer_steps": 0.156, "epsilon_saved": 0.17}


def _ppl(score: float) -> float:
    return math.exp(-score)


def epsilon_after(run: dict[str, Any], steps: int, delta: float = 1e-5) -> float:
    """The PRV accountant's ε of ``run`` (a grid record) after its first ``steps`` steps (0 steps: 0), charged as
    its method's mechanism is (:func:`dp_bench.noise_methods.accounting`)."""
    if steps <= 0:
        return 0.0
    from opacus_spectral import epsilon_from_history

    rate, charged = accounting(run["method"], run["sample_rate"], int(steps))
    return epsilon_from_history([(run["noise_multiplier"], rate, charged)], delta, "prv")


def verdict(ci: dict[str, Any], smallest_gain: float) -> str:
    """CI-based verdict of a paired interval oriented so that positive is the paper's direction."""
    lo, hi = ci.get("lo", math.nan), ci.get("hi", math.nan)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if hi < 0 or (smallest_gain > 0 and hi < smallest_gain):
        return "contradicted"
    if lo > 0:
        return "reproduced"
    return "inconclusive"


def _cells(result: dict[str, Any]) -> dict[tuple[str, int, float], dict[str, dict[int, dict[str, Any]]]]:
    """(optimizer, B, ε) -> method -> seed -> evaluation run (the references under every ε of their cell)."""
    by: dict[tuple[str, int, float], dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    refs = []
    for r in evaluations(result):
        if r["method"] in REFERENCES:
            refs.append(r)
            continue
        by[(r["optimizer"], r["batch"], float(r["target_epsilon"]))][r["method"]][r["seed"]] = r
    for o, b, e in list(by):
        for r in refs:
            if (r["optimizer"], r["batch"]) == (o, b):
                by[(o, b, e)][r["method"]][r["seed"]] = r
    return by


def _reach(run: dict[str, Any], target: float) -> tuple[int, bool]:
    """(steps, reached): the first evaluated step whose score reaches ``target``; never: budget + interval."""
    steps = steps_to_reach(run["test"], target)
    if steps is not None:
        return steps, True
    evaluated = [s for s, _ in run["test"]]
    interval = evaluated[-1] - evaluated[-2] if len(evaluated) > 1 else run["steps"]
    return run["steps"] + interval, False


def _method(seeds: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], compare: bool) -> dict[str, Any]:
    """One method's numbers: perplexity per step (mean ± s.d.) and, when ``compare``, the paired metrics
    against ``base`` (the ``none`` arm)."""
    any_run = next(iter(seeds.values()))
    steps = [s for s, _ in any_run["test"]]
    entry: dict[str, Any] = {
        "seeds": sorted(seeds),
        "lr": any_run["lr"],
        "perplexity": {str(s): mean_std([_ppl(r["test"][i][1]) for r in seeds.values()]) for i, s in enumerate(steps)},
        "gated_per_step": _mean_of(seeds, "gated_per_step"),
    }
    common = sorted(set(seeds) & set(base))
    if not compare or not common:
        return entry
    entry["perplexity_gain_vs_none"] = {  # none − method: positive when the method's perplexity is lower
        str(s): paired_ci([_ppl(base[k]["test"][i][1]) - _ppl(seeds[k]["test"][i][1]) for k in common])
        for i, s in enumerate(steps)
        if s > 0
    }
    mine, theirs, eps_mine, eps_theirs, never = [], [], [], [], 0
    for k in common:
        target = base[k]["test"][-1][1]
        t, reached = _reach(seeds[k], target)
        t0, _ = _reach(base[k], target)
        mine.append(t)
        theirs.append(t0)
        never += not reached
        eps_mine.append(epsilon_after(seeds[k], t) if reached else None)
        eps_theirs.append(epsilon_after(base[k], t0))
    entry["steps_to_none_final"] = {
        "per_seed": mine,
        "none_per_seed": theirs,
        "never_reached": never,
        "diff_vs_none": paired_ci([a - c for a, c in zip(mine, theirs, strict=True)]),
        # none reaching its own final score at step 0 (training made it worse) leaves the fraction undefined
        "fewer_steps_fraction": paired_ci([(c - a) / c if c > 0 else None for a, c in zip(mine, theirs, strict=True)]),
    }
    saved = [t - x for x, t in zip(eps_mine, eps_theirs, strict=True) if x is not None]
    entry["epsilon_to_none_final"] = {"per_seed": eps_mine, "none_per_seed": eps_theirs, "saved": paired_ci(saved)}
    return entry


def _mean_of(seeds: dict[int, dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in seeds.values() if r.get(key) is not None]
    return float(np.mean(values)) if values else None


def family(an: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], float]]:
    """Every paired comparison of the analysis: (cell|method, metric@step, interval, the paper's smallest gain),
    with intervals oriented so that positive is the paper's direction (perplexity: none − method)."""
    out = []
    for cell, methods in an["cells"].items():
        for m, e in methods.items():
            for s, ci in e.get("perplexity_gain_vs_none", {}).items():
                out.append((f"{cell}|{m}", f"perplexity@{s}", ci, SMALLEST_GAIN["perplexity"]))
            if "steps_to_none_final" in e:
                ci = e["steps_to_none_final"]["fewer_steps_fraction"]
                out.append((f"{cell}|{m}", "fewer_steps", ci, SMALLEST_GAIN["fewer_steps"]))
                ci = e["epsilon_to_none_final"]["saved"]
                out.append((f"{cell}|{m}", "epsilon_saved", ci, SMALLEST_GAIN["epsilon_saved"]))
    return out


def families(comparisons: list[tuple[str, str, dict[str, Any], float]]) -> dict[str, list[dict[str, Any]]]:
    """The Holm families of :func:`family`'s comparisons: ``denoisers`` (§10: every step and metric of the arms that
    are not noise mechanisms) and ``mechanisms`` (§12.D: each noise-mechanism arm's perplexity at its cell's last
    evaluated step). A noise-mechanism arm's other comparisons belong to no family but the whole one."""
    last: dict[str, int] = defaultdict(int)
    for cell, metric, _, _ in comparisons:
        if metric.startswith("perplexity@"):
            last[cell] = max(last[cell], int(metric.split("@")[1]))
    out: dict[str, list[dict[str, Any]]] = {"denoisers": [], "mechanisms": []}
    for cell, metric, ci, _ in comparisons:
        if bands_of(cell.split("|")[-1]) is None:
            out["denoisers"].append(ci)
        elif metric == f"perplexity@{last[cell]}":
            out["mechanisms"].append(ci)
    return out


def _finite(cis: list[dict[str, Any]]) -> int:
    return sum(math.isfinite(ci.get("p", math.nan)) for ci in cis)


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Per (optimizer, B, ε) and method: §10's metrics, Holm within each of :func:`families` and over all
    comparisons (``p_holm_all``), CI-based verdicts, and §12.D's b chosen on validation."""
    cells: dict[str, Any] = {}
    for (o, b, e), methods in sorted(_cells(result).items()):
        base = methods.get(BASELINE, {})
        key = f"{o}|B{b}|eps{e:g}"
        cells[key] = {m: _method(seeds, base, m not in (BASELINE, *REFERENCES)) for m, seeds in methods.items()}
    an: dict[str, Any] = {"cells": cells}
    comparisons = family(an)
    every = [ci for _, _, ci, _ in comparisons]
    for ci, adj in zip(every, holm([ci.get("p", math.nan) for ci in every]), strict=True):
        ci["p_holm_all"] = adj
    groups = families(comparisons)
    for cis in groups.values():
        holm_family(cis)
    for _, _, ci, smallest in comparisons:
        ci["verdict"] = verdict(ci, smallest)
    an["family_size"] = _finite(groups["denoisers"])
    an["family_sizes"] = {name: _finite(cis) for name, cis in groups.items()} | {"all": _finite(every)}
    an["chosen_mechanism"] = chosen_mechanism(result, an)
    return an


def chosen_mechanism(result: dict[str, Any], an: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per cell (§12.D): the noise-mechanism arm whose learning-rate runs reached the best validation score, with
    that score (``-log`` perplexity) and its interval against ``none`` at the last evaluated step."""
    out: dict[str, dict[str, Any]] = {}
    for cell, methods in an["cells"].items():
        o, b = cell.split("|")[0], cell.split("|")[1]
        best: tuple[float, str] | None = None
        for m, e in methods.items():
            val = best_validation(result, m, o, b)
            if bands_of(m) is None or val is None or not e.get("perplexity_gain_vs_none"):
                continue
            if best is None or val > best[0]:
                best = (val, m)
        if best is not None:
            gains = methods[best[1]]["perplexity_gain_vs_none"]
            step = max(gains, key=int)
            out[cell] = {"method": best[1], "val_score": best[0], "step": int(step), "gain_vs_none": gains[step]}
    return out


def _ci(ci: dict[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not ci or not math.isfinite(ci.get("mean", math.nan)):
        return "–"
    if not math.isfinite(ci["lo"]):
        return f"{scale * ci['mean']:+.{digits}f} (n={ci['n']})"
    return f"{scale * ci['mean']:+.{digits}f} [{scale * ci['lo']:+.{digits}f}, {scale * ci['hi']:+.{digits}f}]"


def lr_label(result: dict[str, Any], method: str, optimizer: str, batch: int, lr: float) -> str:
    """The lr, marked ``(edge)`` when it is the smallest or largest value its cell's tuning tried."""
    tried = [float(x) for x in result.get("lr_choice", {}).get(f"{method}|{optimizer}|B{batch}", {}).get("val", {})]
    return f"{lr:g} (edge)" if len(tried) > 1 and lr in (min(tried), max(tried)) else f"{lr:g}"


def tables(result: dict[str, Any]) -> str:
    """Markdown: perplexity per step, then steps and ε to the baseline's final perplexity, with Holm p and
    verdicts (the perplexity interval is ``none − method``: positive means the method is better)."""
    an = result.get("analysis") or analyze(result)
    sizes = an.get("family_sizes", {"denoisers": an.get("family_size", 0)})
    lines = [
        "Holm families: "
        + ", ".join(f"{name} {n} comparisons" for name, n in sizes.items())
        + " (`Holm p`: within its family; `Holm p (all)`: over every comparison below).",
        "",
    ]
    for cell, methods in an["cells"].items():
        o, b = cell.split("|")[0], int(cell.split("|")[1][1:])
        lines += [
            f"**{cell}**",
            "",
            "| method | lr | step | test perplexity (mean ± s.d.) | none − method [95 % CI] | Holm p | Holm p (all) | "
            "verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m, e in methods.items():
            oriented = e.get("perplexity_gain_vs_none", {})
            for s, (mu, sd) in e["perplexity"].items():
                ci = oriented.get(s)
                lr = lr_label(result, m, o, b, e["lr"])
                lines.append(
                    f"| {m} | {lr} | {s} | {mu:.3f} ± {sd:.3f} | {_ci(ci, digits=3)} | {fmt_p(ci)} | "
                    f"{fmt_p(ci, 'p_holm_all')} | {ci['verdict'] if ci else '–'} |"
                )
        lines += [
            "",
            "| method | steps to none's final ppl (per seed; never) | fewer steps, % [95 % CI] | Holm p | verdict | "
            "ε needed (per seed) | ε saved [95 % CI] | Holm p | verdict | gated/step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, e in methods.items():
            st, ep = e.get("steps_to_none_final"), e.get("epsilon_to_none_final")
            if st is None:
                continue
            fewer, saved = st["fewer_steps_fraction"], ep["saved"]
            need = ", ".join("> run" if x is None else f"{x:.2f}" for x in ep["per_seed"])
            gated = "–" if e["gated_per_step"] is None else f"{e['gated_per_step']:.1f}"
            lines.append(
                f"| {m} | {', '.join(f'{x:g}' for x in st['per_seed'])}; {st['never_reached']} | {_ci(fewer, 100)} | "
                f"{fmt_p(fewer)} | {fewer['verdict']} | {need} | {_ci(saved)} | {fmt_p(saved)} | {saved['verdict']} | "
                f"{gated} |"
            )
        lines.append("")
    return "\n".join(lines + _chosen_table(an))


def _chosen_table(an: dict[str, Any]) -> list[str]:
    """§12.D's cell: the noise-mechanism arm chosen on validation and its interval against ``none``."""
    chosen = an.get("chosen_mechanism") or {}
    if not chosen:
        return []
    lines = [
        "| cell | chosen on validation | best validation ppl | step | none − chosen [95 % CI] | p (raw) | Holm p | "
        "Holm p (all) | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, c in chosen.items():
        ci = c["gain_vs_none"]
        lines.append(
            f"| {cell.replace('|', ', ')} | {c['method']} | {_ppl(c['val_score']):.2f} | {c['step']} | "
            f"{_ci(ci, digits=3)} | "
            f"{fmt_p(ci, 'p')} | {fmt_p(ci)} | {fmt_p(ci, 'p_holm_all')} | {ci['verdict']} |"
        )
    return [*lines, ""]


def plot(result: dict[str, Any], path: Path) -> None:
    """Test perplexity vs step per method (mean ± sample s.d. over seeds), per (optimizer, B, ε) a panel of the whole
    run and one from the first evaluation on, scaled to the private arms."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(result)
    if not cells:
        return
    fig, axes = plt.subplots(2, len(cells), figsize=(6.5 * len(cells), 8.5), squeeze=False)
    for col, ((o, b, e), methods) in enumerate(sorted(cells.items())):
        private: list[float] = []
        xs: list[int] = []
        for m, seeds in methods.items():
            runs = list(seeds.values())
            xs = [s for s, _ in runs[0]["test"]]
            ys = np.array([[_ppl(v) for _, v in r["test"]] for r in runs if len(r["test"]) == len(xs)])
            mu = ys.mean(0)
            sd = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros_like(mu)
            private += [] if m in REFERENCES else list(mu[1:])
            for ax in axes[:, col]:
                (line,) = ax.plot(xs, mu, marker="o", ms=3, label=f"{m} (n={len(ys)})")
                ax.fill_between(xs, mu - sd, mu + sd, color=line.get_color(), alpha=0.15)
        axes[0, col].set_title(f"{o}, B = {b}, ε = {e:g}", fontsize=10)
        if private:
            axes[1, col].set_ylim(min(private) - 2, max(private) + 2)
        axes[1, col].set_xlim(left=xs[1] if len(xs) > 1 else None)
        axes[1, col].set_title("from the first evaluation on (scaled to the private arms)", fontsize=9)
        for ax in axes[:, col]:
            ax.set_xlabel("logical DP step")
            ax.set_ylabel("test perplexity")
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize=8)
    info = result.get("data", {})
    title = f"{info.get('bed', 'causal LM')}, {info.get('block_size', '?')}-token blocks (bands: s.d.)"
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
