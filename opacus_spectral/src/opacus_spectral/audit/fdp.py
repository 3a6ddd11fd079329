"""The f-DP one-run audit (Mahloujifar, Melis & Chaudhuri, *Auditing f-Differential Privacy in One Run*, ICML 2025,
arXiv 2410.22235) for a Gaussian trade-off: pure statistics, ``docs/math.md`` §5.7.

The experiment is the one of :mod:`~opacus_spectral.audit.bound` (m canaries, each included with probability ½; ``k``
guesses, ``v`` of them right), but the null hypothesis is "every canary is μ-GDP" — the trade-off curve ``G_μ`` —
instead of (ε, δ)-DP. With ``ψ(x) = Φ(Φ⁻¹(x) + μ)`` (the most probability an event of probability x under one input can
have under the other) and ``p_j = P[W = j]``, every level ``1 ≤ i ≤ k`` obeys (§5.7.1)

    Σ_{j≥i} j·p_j / m  ≤  ψ( Σ_{j≥i−1} (k−j)·p_j / m ).                                              (5.7)

If ``P[W ≥ v] ≥ β``, the least total probability these constraints allow is computed by a recursion from level
``v`` down to 0 (:func:`one_run_fdp_mass`); when it exceeds 1, the hypothesis is refuted at confidence 1 − β.
The lower bound is the largest μ refuted, reported as the ε of μ-GDP at the given δ (``claims.gaussian_dp_epsilon``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .bound import _check_counts
from .claims import gaussian_dp_epsilon

__all__ = ["one_run_fdp_epsilon_lower_bound", "one_run_fdp_mass", "one_run_gdp_lower_bound"]

#: absolute tolerance in μ of the root search
MU_TOL = 1e-10


def _check(num_guesses: int, num_correct: int, num_canaries: int, confidence: float) -> None:
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise ValueError(
            f"num_canaries must be a positive int, got {num_canaries!r}: the f-DP bound depends on m, the number "
            "of randomized canaries (docs/math.md §5.7)"
        )
    _check_counts(num_guesses, num_correct, num_canaries)
    if not (isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def one_run_fdp_mass(num_guesses: int, num_correct: int, num_canaries: int, mu: float, confidence: float) -> float:
    """The least total probability that a μ-GDP algorithm with ``P[W ≥ num_correct] ≥ β`` must have
    (``docs/math.md`` §5.7.2); ``> 1`` refutes "μ-GDP" at confidence ``1 − β``.

    The recursion keeps ``r = Σ_{j≥i} j·p_j/m`` and ``h = Σ_{j≥i} (k−j)·p_j/m`` (expected correct / wrong
    guesses on the tail), starts from mass β at level v and adds at each lower level i the least mass that
    (5.7) needs: ``h ← max(h, ψ⁻¹(r))``, ``r ← r + i/(k−i)·Δh``. The total mass is ``(r + h)·m/k``.
    """
    _check(num_guesses, num_correct, num_canaries, confidence)
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be finite and >= 0, got {mu!r}")
    k, v, m = int(num_guesses), int(num_correct), int(num_canaries)
    if k == 0:
        return 0.0
    beta = 1.0 - float(confidence)
    r, h = beta * v / m, beta * (k - v) / m
    for i in range(v - 1, -1, -1):
        need = float(special.ndtr(special.ndtri(r) - mu)) if r < 1.0 else 1.0  # ψ⁻¹(r), capped at r = 1
        if need <= h:  # the constraint holds already: r and h stay, and so do all lower levels
            break
        r += i / (k - i) * (need - h)
        h = need
    return (r + h) * m / k


def one_run_gdp_lower_bound(num_guesses: int, num_correct: int, num_canaries: int, confidence: float = 0.95) -> float:
    """The largest μ such that "every canary is μ-GDP" is refuted at ``confidence`` by ``num_correct`` of
    ``num_guesses`` right among ``num_canaries``; ``0.0`` when even μ = 0 is not refuted.

    The mass of :func:`one_run_fdp_mass` decreases in μ (§5.7.2), so the bound is its root ``mass(μ) = 1``
    (Brent's method after bracketing, tolerance 1e-10).
    """
    _check(num_guesses, num_correct, num_canaries, confidence)
    k, v, m = int(num_guesses), int(num_correct), int(num_canaries)

    def excess(mu: float) -> float:
        return one_run_fdp_mass(k, v, m, mu, confidence) - 1.0

    if k == 0 or excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:  # the mass tends to β < 1 as μ grows: this ends
        hi *= 2.0
    return float(optimize.brentq(excess, hi / 2 if hi > 1 else 0.0, hi, xtol=MU_TOL))


def one_run_fdp_epsilon_lower_bound(
    num_guesses: int,
    num_correct: int,
    delta: float,
    confidence: float = 0.95,
    *,
    num_canaries: int,
) -> float:
    """The f-DP one-run lower bound as an ε at ``delta``: ``ε_δ(μ_lower)`` of μ-GDP (``docs/math.md`` eq. 5.4).

    It refutes "the canaries' trade-off curve is at least ``G_μ``", so compare it only with a claim that is
    μ-GDP (gradient canaries present in every step: ``GradientCanaries.claimed_epsilon``); ε of the same
    δ is monotone in μ, so ``ε_lower > ε_claim`` exactly when ``μ_lower > μ_claim``.

    Args:
        num_guesses: k ≥ 0, guesses made (abstentions excluded).
        num_correct: v, correct guesses (0 ≤ v ≤ k).
        delta: δ ∈ (0, 1) at which μ is turned into ε (μ-GDP has no finite ε at δ = 0).
        confidence: 1 − β, in (0, 1).
        num_canaries: m ≥ k, the number of randomized canaries.
    """
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(
            f"delta must be in (0, 1), got {delta!r}: the f-DP bound is a μ (one_run_gdp_lower_bound); a μ-GDP "
            "algorithm has no finite ε at δ = 0"
        )
    return gaussian_dp_epsilon(one_run_gdp_lower_bound(num_guesses, num_correct, num_canaries, confidence), delta)
