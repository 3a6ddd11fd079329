"""The ε of a run without Poisson sampling: the un-amplified bound (``docs/engine.md``, "Sampling and ε").

Opacus' accountants analyse Poisson sampling. ``make_private(..., poisson_sampling=False)`` trains on the loader's own
fixed-size (often shuffled) batches, which that analysis does not cover (shuffling can be far weaker: Chua et al.,
ICML 2024), yet Opacus reports the Poisson ε. Here such a run is charged a bound that holds for what ran, claiming no
amplification by sampling at all:

* the loader's sampler must yield each record at most once per pass (:func:`sampler_kind`: ``SequentialSampler``,
  ``RandomSampler`` without replacement, ``WeightedRandomSampler`` without replacement, batched by a plain
  ``BatchSampler``); one that can repeat a record within a pass, or one this module does not know, is refused;
* under zero-out adjacency (a record replaced by one contributing a zero gradient: the adjacency of non-amplified
  DP-FTRL, Kairouz et al. 2021) a record then takes part in at most one batch per pass, so the steps that touch one
  pass compose to one Gaussian mechanism of noise multiplier σ: the accountant records ``(σ, 1.0, 1)`` per pass;
* a DP step whose batches come from k passes (gradient accumulation across a pass boundary) has sensitivity k·C and is
  recorded as ``(σ/k, 1.0, 1)`` — together with the per-pass charges this is an upper bound for any placement of the
  record (:class:`PassTracker`).

Passes are observed on the index sampler itself (its class is swapped for a subclass whose ``__iter__`` reports each
index; pickled copies are plain), so any loader built over it — the user's own, BatchMemoryManager's — reports. With
worker processes (``num_workers > 0``) a loader draws batches ahead of their use, so a step right after a new pass
began is charged as touching the previous pass too (conservative).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

from ..denoisers.advice import external_stacklevel
from ..doctor.batches import _OBSERVED
from ..errors import IgnoredSamplerWarning, ShuffledSamplingWarning
from .bounds import charge_log

__all__ = [
    "IgnoredSamplerWarning",
    "PassTracker",
    "ShuffledSamplingWarning",
    "counted_hook",
    "refuse_unbounded",
    "sampler_kind",
    "shuffled_hook",
    "warn_ignored_sampler",
]

TRACKER_ATTR = "_opacus_spectral_pass_tracker"
_TRACKED: dict[type, type] = {}
UNAMPLIFIED = (
    "poisson_sampling=False: Opacus' accountants analyse Poisson sampling, which this loader does not do, and "
    "shuffling is not covered by that analysis (Chua et al., ICML 2024). epsilon is charged the UN-amplified bound "
    "instead: each record is in at most one batch per pass over the data, so every pass the steps touch costs one "
    "Gaussian mechanism of noise multiplier sigma (accountant history (sigma, 1.0, 1) per pass; no amplification by "
    "sampling or shuffling is claimed). Use poisson_sampling=True (the default) for the Poisson epsilon"
)


def _plain_type(obj: Any) -> type:
    """The class of ``obj`` before this module or the doctor (:mod:`~opacus_spectral.doctor.batches`) swapped it for an
    observing subclass."""
    swapped = set(_TRACKED.values()) | set(_OBSERVED.values())
    cls = type(obj)
    while cls in swapped:
        cls = cls.__bases__[0]
    return cls


def _index_kind(sampler: Any) -> str:
    cls = _plain_type(sampler)
    if cls is SequentialSampler:
        return "once"
    if cls is RandomSampler:
        once = not sampler.replacement and sampler.num_samples <= len(sampler.data_source)
        return "once" if once else "repeats"
    if cls is WeightedRandomSampler:
        return "repeats" if sampler.replacement else "once"
    return "unknown"


def sampler_kind(data_loader: Any) -> str:
    """``"poisson"`` (Opacus' uniform Poisson batch sampler), ``"once"`` (each record at most once per pass),
    ``"repeats"`` (a record can come twice in a pass) or ``"unknown"`` (a sampler this module cannot analyse)."""
    batches = getattr(data_loader, "batch_sampler", None)
    if isinstance(batches, (UniformWithReplacementSampler, DistributedUniformWithReplacementSampler)):
        return "poisson"
    if batches is None or _plain_type(batches) is not BatchSampler:
        return "unknown"
    return _index_kind(batches.sampler)


def refuse_unbounded(kind: str, data_loader: Any) -> None:
    """``ValueError`` for a ``poisson_sampling=False`` loader whose sampler admits no bound here."""
    if kind in ("poisson", "once"):
        return
    batches = getattr(data_loader, "batch_sampler", None)
    inner = getattr(batches, "sampler", None)
    name = _plain_type(inner).__name__ if inner is not None else _plain_type(batches).__name__
    why = (
        "can yield the same record several times in one pass"
        if kind == "repeats"
        else "is not one whose passes this engine can analyse"
    )
    raise ValueError(
        f"make_private(poisson_sampling=False) with a {name} that {why}: epsilon has no bound that can be computed "
        "for it (the un-amplified bound needs each record at most once per pass). Use poisson_sampling=True (uniform "
        "Poisson sampling, Opacus' analysis), or a DataLoader with shuffle=True/False, a RandomSampler without "
        "replacement, or a BatchSampler over one."
    )


def warn_ignored_sampler(kind: str, data_loader: Any) -> None:
    """``poisson_sampling=True`` over a sampler that is not a plain pass over the dataset: Opacus draws uniform
    Poisson batches from the whole dataset instead, silently (Opacus #813)."""
    if kind in ("poisson", "once"):
        return
    batches = getattr(data_loader, "batch_sampler", None)
    inner = getattr(batches, "sampler", batches)
    warnings.warn(
        f"the data loader's {_plain_type(inner).__name__} is ignored: with poisson_sampling=True Opacus replaces it "
        "by uniform Poisson sampling over the whole dataset (each record with probability 1/len(loader) per step; "
        "Opacus #813). epsilon is right for that uniform sampling, not for the sampler you chose; weights, subsets "
        "and orders are not applied.",
        IgnoredSamplerWarning,
        stacklevel=external_stacklevel(),
    )


def _tracked_class(cls: type) -> type:
    """A subclass of the index sampler's class whose ``__iter__`` reports each index's pass to its tracker."""
    sub = _TRACKED.get(cls)
    if sub is not None:
        return sub

    def __iter__(self: Any) -> Iterator[Any]:
        tracker = self.__dict__.get(TRACKER_ATTR)
        pass_id = tracker.begin() if tracker is not None else 0
        for index in super(sub, self).__iter__():
            if tracker is not None:
                tracker.drew(pass_id)
            yield index

    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # a copy is the plain, untracked sampler
        return _plain, (cls, {k: v for k, v in self.__dict__.items() if k != TRACKER_ATTR})

    sub = type(cls.__name__, (cls,), {"__iter__": __iter__, "__reduce_ex__": __reduce_ex__})
    _TRACKED[cls] = sub
    return sub


def _plain(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


class PassTracker:
    """The passes over one index sampler, and what each DP step is charged (module docstring).

    Args:
        sampler: the loader's index sampler (its class is swapped; a previous tracker on it is replaced).
        prefetching: the loader draws batches ahead of their use (worker processes).
    """

    def __init__(self, sampler: Any, *, prefetching: bool) -> None:
        self.prefetching = prefetching
        self.passes = 0  #: passes begun over the sampler
        self.steps = 0  #: DP steps charged through :meth:`charge`
        self._fresh: set[int] = set()  # passes drawn from since the previous DP step
        self._current = 0  # the pass of the latest draw
        self._at_last_step = 0  # the pass current at the previous DP step
        self._charged = 0  # the latest pass already charged
        sampler.__class__ = _tracked_class(_plain_type(sampler))
        sampler.__dict__[TRACKER_ATTR] = self

    def begin(self) -> int:
        self.passes += 1
        return self.passes

    def drew(self, pass_id: int) -> None:
        self._fresh.add(pass_id)
        self._current = pass_id

    def touched(self) -> list[int]:
        """The passes the DP step now being taken may have drawn its batches from."""
        fresh, self._fresh = self._fresh, set()
        touched = set(fresh)
        if self.prefetching and fresh and 0 < self._at_last_step < min(fresh):
            touched.add(self._at_last_step)  # batches drawn before the previous step may be used only now
        if not touched and self._current:
            touched = {self._current}  # every batch of this step was drawn before the previous one
        self._at_last_step = self._current
        return sorted(touched)

    def charge(self, noise_multiplier: float) -> float | None:
        """The noise multiplier of the Gaussian mechanism this DP step adds to the history (q = 1), or None."""
        touched = self.touched()
        self.steps += 1
        if not touched:
            raise RuntimeError(
                "make_private(poisson_sampling=False): this DP step trained on no batch drawn from the data loader "
                "make_private returned (nor a loader over its sampler), so its epsilon has no bound here. Iterate "
                "that loader (BatchMemoryManager around it is fine)."
            )
        if len(touched) > 1:  # one record can be in this step once per pass: sensitivity k·C
            self._charged = max(self._charged, touched[-1])
            return noise_multiplier / len(touched)
        if touched[0] > self._charged:
            self._charged = touched[0]
            return noise_multiplier
        return None


def shuffled_hook(accountant: Any, tracker: PassTracker, count: Callable[[int], None]) -> Callable[[Any], None]:
    """The accountant's step hook for a ``poisson_sampling=False`` run (replaces Opacus' Poisson one): charges what
    :meth:`PassTracker.charge` says, and reports it to ``count`` and to the doctor
    (:func:`~opacus_spectral.accounting.bounds.charge_log`)."""

    def hook(optim: Any) -> None:
        sigma = tracker.charge(float(optim.noise_multiplier))
        if sigma is not None:
            accountant.step(noise_multiplier=sigma, sample_rate=1.0)
        charged = 0 if sigma is None else 1
        count(charged)
        charge_log(accountant).record(charged)

    return hook


def counted_hook(accountant: Any, poisson_hook: Callable[[Any], None], count: Callable[[int], None]) -> Callable:
    """Opacus' Poisson step hook, unchanged, plus the engine's own count of the steps it charged."""

    def hook(optim: Any) -> None:
        poisson_hook(optim)
        count(1)
        charge_log(accountant).record(1)

    return hook
