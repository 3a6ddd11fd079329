"""The noise multiplier for a privacy budget — the one calibration every caller uses — and its inverse, the ε a
history of steps spends.

``noise_multiplier_for(target_epsilon=..., target_delta=..., sample_rate=..., steps=...)`` is the smallest
noise multiplier σ whose ``steps`` Poisson-sampled steps of rate q spend at most (ε, δ) under ``accountant``: the
search of Opacus' ``get_noise_multiplier`` (σ doubled from 20 until ε fits, then bisected until ε is within
``epsilon_tolerance`` below the target — the same σ for every target it can reach from σ ≥ 0.2 by doubling to at most
655,360), bounded so that it always ends: σ is searched in [:data:`SIGMA_MIN`, :data:`MAX_SIGMA`] (the doubling stops
at :data:`MAX_SIGMA`), a target outside that range, a tolerance ≤ 0 and an ε that jumps across the target (an
accountant's numerical edge) are ``ValueError`` naming the range. A σ above :data:`SIGMA_LARGE` is returned with a
:class:`~opacus_spectral.errors.LargeNoiseWarning`: the noise then swamps any batch of fewer than σ records.
Only upper bounds are calibrated to: ``accountant="gdp"`` (an approximation) is refused
(:mod:`~opacus_spectral.accounting.bounds`). DPTrainer, ``PrivacyEngine.make_private_with_epsilon``, the federated
client and the harness call it.

The search is a pure function of its arguments and costs seconds (each bisection step is a full accountant
evaluation; the RDP accountant's fractional orders dominate), so its result is kept per argument tuple: a federated
simulation's server and clients calibrate the same partitions, and a grid the same cells, once.

``epsilon_from_history(history, delta, accountant)`` is ε at δ of a fresh Opacus accountant given ``history``
(``[(noise_multiplier, sample_rate, steps), ...]``, the accountants' own format): the same call on the same history
as ``accountant.get_epsilon(delta)``, so the same float, kept per (history, δ, accountant) for the same reason — a grid
ends many runs on identical histories, and a budget search asks the same ε more than once. Its edges are exact or
upper bounds (:func:`~opacus_spectral.accounting.bounds.bounded_epsilon`): σ = ∞ spends nothing, σ = 0 and σ → 0 spend
∞, σ too small for PRV's grid gets the RDP bound, a negative numerical ε is 0.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence

from ..denoisers.advice import external_stacklevel
from ..errors import LargeNoiseWarning
from .bounds import bounded_epsilon, check_gdp_history, refuse_gdp, warn_approximate

__all__ = ["MAX_SIGMA", "SIGMA_LARGE", "SIGMA_MIN", "epsilon_from_history", "noise_multiplier_for"]

#: the smallest σ the calibration returns: below it even one full-batch step spends ε > 90 (δ = 1e-5), and a target
#: needing less noise is outside the calibration's range (pass ``noise_multiplier=`` directly)
SIGMA_MIN = 0.1
#: the largest σ the calibration tries (Opacus' bound): a target needing more is too small for the run
MAX_SIGMA = 1e6
#: above this σ a calibration warns: the noise std σ·C/B per coordinate of the averaged clipped gradient (C the
#: clipping bound, B the expected batch size) exceeds C, the largest norm of the whole signal, unless B > σ
SIGMA_LARGE = 100.0


def noise_multiplier_for(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """σ such that ``steps`` steps at sample rate q give ε ≤ ``target_epsilon`` at δ = ``target_delta``.

    Warns :class:`~opacus_spectral.errors.LargeNoiseWarning` when σ > :data:`SIGMA_LARGE`.

    Raises:
        ValueError: ε not a positive finite number, δ outside (0, 1), q outside (0, 1], steps < 1, a tolerance that
            is not a finite number > 0, accountant ``"gdp"`` (an approximation) or another unknown one, or a target
            outside the calibration's range (needing σ < :data:`SIGMA_MIN` or > :data:`MAX_SIGMA`).
    """
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(
            f"target_epsilon must be a positive finite number, got {target_epsilon!r} (a run without privacy takes "
            "noise_multiplier=0 instead of a budget)"
        )
    if not 0 < target_delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    tolerance = epsilon_tolerance
    if isinstance(tolerance, bool) or not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance)):
        tolerance = math.nan
    if not tolerance > 0:
        raise ValueError(
            f"epsilon_tolerance must be a finite number > 0, got {epsilon_tolerance!r}: the search stops once ε is "
            "within it below the target, which a tolerance <= 0 never allows (e.g. 0.01)"
        )
    refuse_gdp(accountant, "target_epsilon (a calibration of the noise multiplier)")
    _check_accountant(accountant)
    args = (float(target_epsilon), float(target_delta), float(sample_rate), int(steps), accountant)
    sigma = _search(*args, float(tolerance))
    if sigma > SIGMA_LARGE:
        warnings.warn(
            f"noise_multiplier_for: σ = {sigma:.4g} for target_epsilon = {target_epsilon} (steps = {steps}, "
            f"q = {sample_rate:.4g}, δ = {target_delta:g}) is above {SIGMA_LARGE:g}. Each step's noise has std σ·C/B "
            "per coordinate of the averaged clipped gradient (C the clipping bound, B the expected batch size), whose "
            f"whole norm is at most C: unless a batch holds well over {sigma:,.0f} records the noise swamps the "
            "signal and the model learns next to nothing. Raise target_epsilon, or train fewer steps on larger "
            "batches.",
            LargeNoiseWarning,
            stacklevel=external_stacklevel(),
        )
    return sigma


def _check_accountant(accountant: str) -> None:
    if accountant not in ("prv", "rdp", "gdp"):
        raise ValueError(f"accountant must be 'prv', 'rdp' or 'gdp', got {accountant!r}")


@functools.lru_cache(maxsize=1024)
def _search(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str, tolerance: float
) -> float:
    """Opacus' doubling-then-bisection for σ, within [SIGMA_MIN, MAX_SIGMA] (validated arguments; one search per
    distinct argument tuple)."""

    def eps(sigma: float) -> float:
        return _epsilon(((sigma, sample_rate, steps),), target_delta, accountant)

    def out_of_range(sigma: float, spent: float, why: str) -> ValueError:
        return ValueError(
            f"target_epsilon={target_epsilon} is outside the calibration's range: noise multipliers are searched in "
            f"[{SIGMA_MIN}, {MAX_SIGMA:g}], and σ = {sigma:.4g} spends ε = {spent:.4g} over {steps} steps at "
            f"q = {sample_rate:.4g}, δ = {target_delta:g} ({accountant}): {why}. Pass noise_multiplier= directly."
        )

    low, high, eps_high = 0.0, 10.0, math.inf
    previous, eps_previous = high, eps_high  # the doubling's σ before ``high``, and its ε
    while eps_high > target_epsilon:
        if high >= MAX_SIGMA:
            raise out_of_range(high, eps_high, _unreached(previous, eps_previous, eps_high))
        previous, eps_previous = high, eps_high
        high = min(2 * high, MAX_SIGMA)
        eps_high = eps(high)
    while target_epsilon - eps_high > tolerance:
        mid = (low + high) / 2
        if mid < SIGMA_MIN:  # only while low == 0: check the floor once instead of going below it
            low, spent = SIGMA_MIN, eps(SIGMA_MIN)
            if spent < target_epsilon:
                if target_epsilon - spent <= tolerance:
                    return SIGMA_MIN
                raise out_of_range(SIGMA_MIN, spent, "even the least noise searched spends less than the target")
            continue
        if not low < mid < high or high - low <= high * 1e-12:
            raise out_of_range(high, eps_high, f"ε jumps across the target between σ = {low:.6g} and σ = {high:.6g}")
        spent = eps(mid)
        if spent < target_epsilon:
            high, eps_high = mid, spent
        else:
            low = mid
    return high


def _unreached(sigma: float, spent: float, spent_at_max: float) -> str:
    """Why even :data:`MAX_SIGMA` misses the target, given ε at the previous σ of the doubling."""
    if spent_at_max > 0.9 * spent:  # the Gaussian mechanism's ε ∝ 1/σ at such noise: from σ/1.53 it falls by 35 %
        return (
            f"ε barely falls as σ grows (σ = {sigma:.4g} spends ε = {spent:.4g}): this is the smallest ε the "
            "accountant reports for this run (its floor: PRV's numerical error bound, RDP's largest order), not a "
            "budget more noise would meet"
        )
    return "the budget is too small for this many steps"


def epsilon_from_history(history: Iterable[Sequence[float]], delta: float, accountant: str = "prv") -> float:
    """ε at ``delta`` spent by ``history`` under Opacus' ``accountant`` (``"prv"``, ``"rdp"``, or ``"gdp"`` — an
    approximation, which warns :class:`~opacus_spectral.accounting.bounds.ApproximateEpsilonWarning`).

    An empty history spends nothing (0.0), and so does a step with infinite noise; a step without noise (noise
    multiplier 0 at a positive rate) has no finite guarantee (∞), nor one with noise too small for the accountant's
    arithmetic (σ → 0). Where PRV's discretization would be too large (tiny σ), the RDP bound is returned; a negative
    numerical ε — (0, δ)-DP — is 0.0.

    Raises:
        ValueError: δ outside (0, 1), an unknown accountant, an entry that is not
            (σ ≥ 0, 0 < q ≤ 1, whole steps ≥ 1), or a gdp history with several (σ, q) (it reads only the last).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    _check_accountant(accountant)
    hist = tuple((float(s), float(q), float(n)) for s, q, n in history)
    for s, q, n in hist:  # steps must be a whole number: truncating 2.5 to 2 would under-count ε
        if not (s >= 0 and 0 < q <= 1 and n >= 1 and n.is_integer()):
            raise ValueError(
                f"history entries are (noise_multiplier >= 0, 0 < sample_rate <= 1, whole steps >= 1), got {(s, q, n)}"
            )
    hist = tuple((s, q, int(n)) for s, q, n in hist if s != math.inf)  # infinite noise releases nothing
    if not hist:
        return 0.0
    if any(s == 0 for s, _, _ in hist):
        return math.inf
    if accountant == "gdp":
        check_gdp_history(hist)
        warn_approximate("epsilon_from_history(..., 'gdp')")
    return _epsilon(hist, float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """A fresh Opacus accountant's ε on ``history``, guarded (validated arguments; one evaluation per tuple)."""
    from opacus.accountants import create_accountant  # noqa: PLC0415 - heavy import

    def evaluate() -> float:
        acc = create_accountant(mechanism=accountant)
        acc.history = list(history)
        return float(acc.get_epsilon(delta))

    return bounded_epsilon(history, delta, accountant, evaluate)
