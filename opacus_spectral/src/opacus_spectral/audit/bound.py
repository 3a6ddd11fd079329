"""The one-run audit bound of Steinke, Nasr & Jagielski (NeurIPS 2023, arXiv 2305.08846): pure statistics.

``m`` canaries are each included in the training set independently with probability ½; the auditor guesses
membership for ``r`` of them (abstaining on the rest) and ``v`` guesses are right. Under the null hypothesis
"the training algorithm is (ε, δ)-DP", the number of correct guesses ``W`` satisfies (``docs/math.md`` §5.1–§5.2)

    P[W ≥ v] ≤ f(v) + 2·m·δ · max_{1≤i≤v} (f(v−i) − f(v)) / i,      f(u) = P[Bin(r, e^ε/(1+e^ε)) ≥ u]   (5.2)

(for δ = 0 the second term vanishes: ``W`` is stochastically dominated by ``Bin(r, e^ε/(1+e^ε))``, the count
of randomized response). The right-hand side is the *p-value* of the observation ``(r, v)`` against the claim;
the lower bound at confidence ``1 − β`` is the largest ε whose p-value stays below β.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special, stats

__all__ = ["one_run_epsilon_lower_bound", "one_run_p_value"]

#: absolute tolerance in ε of the root search for δ > 0
EPS_TOL = 1e-10


def _check_counts(num_guesses: int, num_correct: int, num_canaries: int | None) -> None:
    for name, value in (("num_guesses", num_guesses), ("num_correct", num_correct)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if not 0 <= num_correct <= num_guesses:
        raise ValueError(f"need 0 <= num_correct <= num_guesses, got {num_correct} correct of {num_guesses}")
    if num_canaries is not None and num_canaries < num_guesses:
        raise ValueError(f"num_canaries ({num_canaries}) cannot be smaller than num_guesses ({num_guesses})")


def _check_delta(delta: float, num_canaries: int | None) -> None:
    if not (isinstance(delta, (int, float)) and 0.0 <= delta <= 1.0):
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    if delta > 0 and num_canaries is None:
        raise ValueError(
            "with delta > 0 the bound depends on the number of randomized canaries m (the 2·m·δ term of "
            "docs/math.md §5.2): pass num_canaries"
        )


def one_run_p_value(
    num_guesses: int,
    num_correct: int,
    epsilon: float,
    delta: float = 0.0,
    *,
    num_canaries: int | None = None,
) -> float:
    """Upper bound on ``P[W ≥ num_correct]`` for an (ε, δ)-DP algorithm, eq. (5.2) of ``docs/math.md`` §5.2.

    Args:
        num_guesses: r, guesses made (abstentions excluded).
        num_correct: v, correct guesses.
        epsilon: ε ≥ 0 of the claim under test.
        delta: δ of the claim; ``> 0`` needs ``num_canaries``.
        num_canaries: m, canaries randomized (each included with probability ½); only the δ term uses it.

    Returns the p-value in [0, 1]: small values refute the (ε, δ) claim.
    """
    _check_counts(num_guesses, num_correct, num_canaries)
    _check_delta(delta, num_canaries)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    r, v = int(num_guesses), int(num_correct)
    if v == 0:
        return 1.0
    q = float(special.expit(epsilon))  # e^ε/(1+e^ε): the accuracy of ε-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Bin(r, q) >= v]
    if delta == 0:
        return min(tail, 1.0)
    # f(v−i) − f(v) = P[v−i <= Bin < v] = Σ_{j=v−i}^{v−1} pmf(j), for i = 1..v; i > v cannot exceed i = v
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
    alpha = float(np.max(np.cumsum(pmf) / np.arange(1, v + 1)))
    return min(tail + alpha * 2.0 * float(num_canaries) * delta, 1.0)  # type: ignore[arg-type]


def _pure_bound(r: int, v: int, beta: float) -> float:
    """δ = 0: ``P[Bin(r, q) ≥ v] = I_q(v, r−v+1)`` (regularized incomplete beta), increasing in q, so the
    largest ε with tail < β is ``logit`` of the β-quantile of ``Beta(v, r−v+1)`` — the one-sided
    Clopper–Pearson lower limit for v successes in r trials (``docs/math.md`` §5.1)."""
    if v == 0:
        return 0.0
    q_star = float(stats.beta.ppf(beta, v, r - v + 1))
    return max(0.0, float(special.logit(q_star))) if q_star > 0.5 else 0.0


def one_run_epsilon_lower_bound(
    num_guesses: int,
    num_correct: int,
    delta: float = 0.0,
    confidence: float = 0.95,
    *,
    num_canaries: int | None = None,
) -> float:
    """Lower bound on ε at confidence ``confidence`` = 1 − β from ``num_correct`` of ``num_guesses`` right.

    The largest ε such that the p-value of (r, v) against "(ε, δ)-DP" is below β (``docs/math.md`` §5.1–§5.2;
    Steinke, Nasr & Jagielski 2023). ``0.0`` when even ε = 0 is not refuted.

    * δ = 0: closed form ``logit(Beta(v, r−v+1).ppf(β))`` — the largest ε with
      ``P[Bin(r, e^ε/(1+e^ε)) ≥ v] < β``.
    * δ > 0: the root in ε of ``p(ε) = β`` for eq. (5.2), by Brent's method after bracketing (tolerance 1e-10).
      It needs ``num_canaries`` (m): the bound weakens as m grows at fixed (r, v) through the ``2mδ`` term.

    Args:
        num_guesses: r ≥ 0, guesses made (abstentions excluded).
        num_correct: v, correct guesses (0 ≤ v ≤ r).
        delta: δ of the claims tested.
        confidence: 1 − β, in (0, 1).
        num_canaries: m ≥ r, the number of canaries randomized; required when ``delta > 0``.
    """
    _check_counts(num_guesses, num_correct, num_canaries)
    _check_delta(delta, num_canaries)
    if not (isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    beta = 1.0 - float(confidence)
    r, v = int(num_guesses), int(num_correct)
    if delta == 0:
        return _pure_bound(r, v, beta)
    eps_hi = _pure_bound(r, v, beta)  # the δ term only adds to the p-value: the δ = 0 bound is an upper end
    if eps_hi == 0.0 or one_run_p_value(r, v, 0.0, delta, num_canaries=num_canaries) >= beta:
        return 0.0

    def gap(eps: float) -> float:
        return one_run_p_value(r, v, eps, delta, num_canaries=num_canaries) - beta

    if gap(eps_hi) < 0:  # numerically at the δ = 0 root already
        return eps_hi
    return float(optimize.brentq(gap, 0.0, eps_hi, xtol=EPS_TOL, rtol=4 * np.finfo(float).eps))
