"""ε that is an upper bound, or an error: the guards every ε this library reports goes through (``docs/engine.md``,
"Accounting").

* :func:`bounded_epsilon` evaluates an Opacus accountant on a history without hanging or raising a raw error where
  the noise is so small that the accountant's numerics give out: where PRV's discretization would need more than
  :data:`PRV_MAX_GRID` points (tiny σ, or ε in the thousands) the RDP bound at the same δ is returned (an upper bound
  too, looser); where even RDP overflows (σ → 0) ε is ∞. A negative numerical ε means (0, δ)-DP and is returned as 0.
* ``gdp`` is Opacus' central-limit approximation (Gaussian DP), not an upper bound: refused for every calibration
  (:func:`refuse_gdp`), and labelled :class:`ApproximateEpsilonWarning` wherever it is reported.
* Upstream warnings that do not apply to the ε evaluated here are not shown (:func:`without_inapplicable_warnings`,
  scoped to the evaluation, never a global filter): PRV sizes its grid with an RDP bound, whose "Optimal order is the
  largest alpha" leaves PRV's ε unchanged; gdp's "experimental" caveat is :class:`ApproximateEpsilonWarning`.
* :class:`ChargeLog` tells the doctor how many steps the engine's accountant hook charged in a DP step (1 under
  Poisson sampling; 0 or 1 for the un-amplified bound of shuffled sampling,
  :mod:`~opacus_spectral.accounting.sampling`).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..denoisers.advice import external_stacklevel
from ..errors import ApproximateEpsilonWarning

__all__ = [
    "GDP_WHY",
    "PRV_MAX_GRID",
    "ApproximateEpsilonWarning",
    "ChargeLog",
    "EngineCount",
    "bounded_epsilon",
    "charge_log",
    "check_delta",
    "check_gdp_history",
    "refuse_gdp",
    "warn_approximate",
    "without_inapplicable_warnings",
]

#: PRV discretizes the privacy-loss distribution on a grid of 2·L/mesh points (Gopi et al. 2021, Opacus'
#: ``PRVAccountant``); past 2^24 points (~10 s, >1 GB) its ε is far above any meaningful budget
PRV_MAX_GRID = 2**24
GDP_WHY = (
    "accountant='gdp' is an approximation, not an upper bound (Opacus' central-limit estimate, Gaussian DP): it can "
    "report ε several times too small (σ = 0.491 calibrated for ε = 2 at q = 0.01 over 40 steps spends ε = 5.67 "
    "by PRV, 7.14 by RDP)"
)
LOG_ATTR = "_opacus_spectral_charge_log"
Entry = tuple[float, float, int]
#: per accountant, the upstream warnings that do not apply to the ε this module evaluates with it (their message starts)
INAPPLICABLE = {"prv": ("Optimal order is the",), "gdp": ("GDP accounting is experimental",)}


@contextlib.contextmanager
def without_inapplicable_warnings(mechanism: str) -> Iterator[None]:
    """Silence, for the ``with`` block only, the upstream warnings of :data:`INAPPLICABLE` for ``mechanism``."""
    with warnings.catch_warnings():
        for message in INAPPLICABLE.get(mechanism, ()):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def refuse_gdp(accountant: str, what: str) -> None:
    """``ValueError`` when ``what`` (a calibration to a target ε) would use the gdp accountant."""
    if accountant == "gdp":
        raise ValueError(
            f"{what} cannot use the gdp accountant: {GDP_WHY}, so a σ calibrated to it does not keep the target. "
            "Use accountant='prv' (the default, tight) or 'rdp'."
        )


def warn_approximate(where: str) -> None:
    """:class:`ApproximateEpsilonWarning`, pointing at the user's line."""
    warnings.warn(
        f"{where}: {GDP_WHY}. This ε is an approximation; use accountant='prv' or 'rdp' for a guarantee.",
        ApproximateEpsilonWarning,
        stacklevel=external_stacklevel(),
    )


def check_gdp_history(history: Sequence[Sequence[float]]) -> None:
    """Opacus' gdp accountant reads only the last entry of its history: refuse one with several (σ, q)."""
    if len({(float(s), float(q)) for s, q, _ in history}) > 1:
        raise ValueError(
            "the gdp accountant reads only the last (noise_multiplier, sample_rate) of a history, so a history "
            "with several would under-count ε: use accountant='prv' or 'rdp'"
        )


def bounded_epsilon(history: Sequence[Entry], delta: float, mechanism: str, evaluate: Callable[[], Any]) -> float:
    """``evaluate()`` (the accountant ``mechanism``'s ε at ``delta`` on ``history``: entries with 0 < σ < ∞), guarded
    as the module docstring says; never below 0, never a finite value under the accountant's own bound."""
    if mechanism == "prv":
        with without_inapplicable_warnings("prv"):
            points = prv_grid_points(history, delta)
        if points is None:
            return math.inf
        if points > PRV_MAX_GRID:
            return rdp_epsilon(history, delta)  # the ε reported is RDP's: its warnings apply
    try:
        with np.errstate(divide="ignore"), without_inapplicable_warnings(mechanism):  # PRV at q = 1: log(0) on purpose
            eps = float(evaluate())
    except (ZeroDivisionError, OverflowError, FloatingPointError):  # σ → 0: the accountant's own arithmetic fails
        return math.inf
    return 0.0 if eps < 0 else eps


def rdp_epsilon(history: Sequence[Entry], delta: float) -> float:
    """A fresh RDP accountant's ε (∞ where its arithmetic overflows: σ → 0)."""
    from opacus.accountants import RDPAccountant  # noqa: PLC0415 - heavy import

    acc = RDPAccountant()
    acc.history = list(history)
    try:
        eps = float(acc.get_epsilon(delta))
    except (ZeroDivisionError, OverflowError, FloatingPointError):
        return math.inf
    return 0.0 if eps < 0 else eps


def prv_grid_points(history: Sequence[Entry], delta: float, eps_error: float = 0.01) -> float | None:
    """The number of grid points Opacus' PRV accountant would discretize ``history`` on at ``delta`` (its defaults:
    ``eps_error`` 0.01, δ error δ/1000); ``None`` when the RDP bound that sizes the grid overflows (σ → 0)."""
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size  # noqa: PLC0415

    delta_error = delta / 1000
    try:
        half_width = compute_safe_domain_size(
            [PoissonSubsampledGaussianPRV(q, s) for s, q, _ in history],
            [n for _, _, n in history],
            eps_error=eps_error,
            delta_error=delta_error,
        )
    except (ZeroDivisionError, OverflowError, FloatingPointError):
        return None
    if not math.isfinite(half_width):
        return None
    steps = sum(n for _, _, n in history)
    mesh = eps_error / math.sqrt(steps * math.log(12 / delta_error) / 2)
    return 2 * half_width / mesh


@dataclass
class ChargeLog:
    """What the engine's accountant hooks charged: ``calls`` (DP steps they saw) and ``last`` (the steps the latest
    call added to the history). Kept on the accountant for the doctor (:func:`charge_log`)."""

    calls: int = 0
    last: int = 1

    def record(self, charged: int) -> None:
        self.calls += 1
        self.last = int(charged)


def charge_log(accountant: Any) -> ChargeLog:
    """The accountant's :class:`ChargeLog` (created empty on first use)."""
    log = getattr(accountant, LOG_ATTR, None)
    if not isinstance(log, ChargeLog):
        log = ChargeLog()
        setattr(accountant, LOG_ATTR, log)
    return log


def expected_charge(calls_before: int, log: ChargeLog) -> int:
    """Steps the accountant should have added in one DP step: what the engine's hook said it charged, or 1 (Opacus'
    own hook) when no engine hook ran."""
    return log.last if log.calls > calls_before else 1


def check_delta(delta: Any, dataset_size: int | None, name: str = "delta") -> None:
    """``ValueError`` unless 0 < δ < 1 and, when the dataset size N is known, δ < 1/N: a mechanism that publishes
    one random record in the clear is (0, 1/N)-DP, so a δ ≥ 1/N promises nothing (and an accountant's numerical ε can
    even come out negative)."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError(f"{name} must be a number in (0, 1), got {delta!r}")
    if dataset_size and delta >= 1 / dataset_size:
        raise ValueError(
            f"{name}={delta:g} is not below 1/N = {1 / dataset_size:.3g} for the N = {dataset_size} records the data "
            "is sampled from: publishing one random record in the clear is (0, 1/N)-DP, so this delta promises "
            f"nothing. Use delta well below 1/N; the usual choice is delta <= 1/(10 N), e.g. {0.1 / dataset_size:.1g}."
        )


@dataclass
class EngineCount:
    """A ``PrivacyEngine``'s own count, across its ``make_private`` calls and restored by ``load_checkpoint``: the
    noisy DP steps its optimizers took (``dp_steps``) and the steps its accountant hooks added to the history
    (``charged``: one per DP step under Poisson sampling, one per pass under shuffled sampling)."""

    dp_steps: int = 0
    charged: int = 0
    sampling: str | None = None  #: ``"poisson"`` or ``"shuffle"``: how the last make_private's steps are charged

    def count(self, charged: int) -> None:
        self.dp_steps += 1
        self.charged += int(charged)
