"""What the doctor knows about the batches a DP step trained on (``docs/engine.md``, "The doctor").

:class:`BatchObserver` watches the batch sampler of the data loader ``make_private`` returned: each logical batch it
yields is queued by its number of records, on the CPU (a length, no device sync). At every DP step the doctor pairs
the step with the next queued batch and compares it with the rows of the step's per-sample gradients
(:func:`per_sample_rows`, a shape read, summed over BatchMemoryManager's physical batches). Two silent failures show:

* no queued batch: the step trained on batches the DP loader never yielded (the user's own loader), so the
  accountant's Poisson sample rate is not the real participation;
* rows != records (of one batch, or of the consecutive batches of a step that accumulated several backward
  passes): Opacus took another dimension for the batch (a sequence-first model under the default
  ``batch_first=True``) and clipped per time step, not per record.

Queued batches are dropped when a new pass over the sampler begins, and skipped ones (drawn but never trained, e.g.
a resumed Trainer skipping batches) are dropped when a later one matches the step; so prefetching loaders, epochs
and resumes stay silent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

OBSERVER_ATTR = "_opacus_spectral_batch_observer"
_OBSERVED: dict[type, type] = {}


def _plain(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _observed_class(cls: type) -> type:
    """A subclass of the sampler's class whose ``__iter__`` reports each batch's length to the observer.

    Swapping an instance's class (rather than wrapping it) keeps its identity — loaders and samplers built around it
    (BatchMemoryManager, length sorting, the Trainer's physical batches) see the reports — and ``isinstance``."""
    sub = _OBSERVED.get(cls)
    if sub is not None:
        return sub

    def __iter__(self: Any) -> Iterator[Any]:
        observer = self.__dict__.get(OBSERVER_ATTR)
        if observer is not None:
            observer.new_pass()
        for batch in super(sub, self).__iter__():
            if observer is not None:
                observer.drawn(len(batch))
            yield batch

    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # a copy is the plain, unobserved sampler
        return _plain, (cls, {k: v for k, v in self.__dict__.items() if k != OBSERVER_ATTR})

    sub = type(cls.__name__, (cls,), {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__})
    _OBSERVED[cls] = sub
    return sub


def per_sample_rows(params: list[torch.Tensor]) -> int | None:
    """Rows of the per-sample gradients (hooks / functorch) or norms (ghost) of the current physical batch; ``None``
    when no parameter holds any. A shape read: no device sync."""
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if isinstance(gs, torch.Tensor):
            return int(gs.shape[0])
        if isinstance(gs, list) and gs:
            return sum(int(g.shape[0]) for g in gs)
    for p in params:
        ns = getattr(p, "_norm_sample", None)
        if isinstance(ns, torch.Tensor):
            return int(ns.shape[0])
    return None


def _matching_run(queued: deque[int], rows: int, window: int = 64) -> int | None:
    """How many queued batches to consume for a step with ``rows`` per-sample rows: through the first run of
    consecutive batches whose records add up to ``rows`` (one batch, or the k batches of Opacus' gradient
    accumulation over k backward passes); ``None`` if no run among the first ``window`` batches does."""
    items = list(queued)[:window]
    for start in range(len(items)):
        total = 0
        for end in range(start, len(items)):
            total += items[end]
            if total == rows:
                return end + 1
            if total > rows:
                break
    return None


class BatchObserver:
    """Queues the record counts of the batches one sampler yields and pairs DP steps with them.

    Args:
        source: the DP data loader (its ``batch_sampler`` is watched) or a batch sampler itself.
    """

    def __init__(self, source: Any) -> None:
        sampler = getattr(source, "batch_sampler", source)
        if sampler is None or not hasattr(type(sampler), "__iter__"):
            raise ValueError(
                f"cannot watch the batches of {type(source).__name__}: it has no batch sampler (a DataLoader with "
                "batch_size=None, or an iterable dataset). Pass the DataLoader make_private returned."
            )
        self.sampler = sampler
        self.sample_rate: float | None = getattr(source, "sample_rate", getattr(sampler, "sample_rate", None))
        self.queued: deque[int] = deque()
        self.drawn_batches = 0  #: logical batches the sampler yielded since the observer was attached
        self.steps = 0  #: DP steps paired so far
        self._original = type(sampler)
        previous = sampler.__dict__.get(OBSERVER_ATTR) if hasattr(sampler, "__dict__") else None
        if previous is not None:
            self._original = previous._original
        try:
            sampler.__class__ = _observed_class(self._original)
            sampler.__dict__[OBSERVER_ATTR] = self
        except (TypeError, AttributeError) as err:
            raise ValueError(
                f"cannot watch the batches of {type(sampler).__name__} (its class cannot be extended: {err}); "
                "pass doctor=False to make_private, or use a batch sampler defined in Python"
            ) from err

    def detach(self) -> None:
        """Stop observing; the sampler is its plain class again."""
        if self.sampler.__dict__.get(OBSERVER_ATTR) is self:
            del self.sampler.__dict__[OBSERVER_ATTR]
            self.sampler.__class__ = self._original

    # called from the sampler's __iter__
    def new_pass(self) -> None:
        self.queued.clear()  # batches of an abandoned pass were never trained on

    def drawn(self, records: int) -> None:
        self.queued.append(records)
        self.drawn_batches += 1

    def on_dp_step(self, rows: int | None) -> list[tuple[str, str]]:
        """Pair one DP step (``rows``: its per-sample rows, summed over physical batches) with its batch; returns
        the findings as ``(check, message)`` pairs."""
        self.steps += 1
        if not self.queued:
            return [("sampling", self._not_drawn())]
        if rows is None:
            self.queued.popleft()
            return []
        run = _matching_run(self.queued, rows)
        if run is not None:  # batches queued before the run were drawn and skipped, never trained
            for _ in range(run):
                self.queued.popleft()
            return []
        return [("batch_dim", self._rows_differ(rows, self.queued.popleft()))]

    def _not_drawn(self) -> str:
        rate = "" if self.sample_rate is None else f" q = {self.sample_rate:.4g}"
        return (
            f"DP step {self.steps} trained on a batch the DP data loader did not yield ({self.drawn_batches} "
            f"batch(es) drawn from it so far): the accountant charges each step at the Poisson sample rate{rate} of "
            "the loader make_private returned, so epsilon is wrong for batches from any other loader (e.g. your "
            "original DataLoader, whose fixed batches give a different participation). Fix: iterate the data loader "
            "make_private returned (BatchMemoryManager around it for smaller physical batches); a loop that builds "
            "its own loader over the DP loader's batch sampler passes that sampler to engine.doctor.watch_batches()."
        )

    def _rows_differ(self, rows: int, records: int) -> str:
        return (
            f"the per-sample gradients of DP step {self.steps} do not have one row per record of the batch the DP "
            f"data loader yielded for it ({_ratio(rows, records)}): Opacus clipped 'samples' that are not the batch's "
            "records, so one record's influence on the update is no longer bounded by max_grad_norm. Cause: the "
            "model takes its input sequence-first ([T, B, ...]) while make_private assumed batch_first=True, or the "
            "batch was reshaped or repeated before the forward. Fix: make_private(..., batch_first=False) for a "
            "sequence-first model, or feed the batch as the loader yields it."
        )


def _ratio(rows: int, records: int) -> str:
    """How the rows relate to the records, without either count (the sampled batch size is private)."""
    if records and rows % records == 0:
        return f"{rows // records} rows per record"
    return "more rows than records" if rows > records else "fewer rows than records"
