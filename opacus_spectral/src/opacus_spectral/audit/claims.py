"""The ε an audit is compared with: the privacy a correct engine claims for one canary (``docs/math.md`` §5.4).

A canary is one privacy unit of DP-SGD: present in a step with probability ``sample_rate`` (Poisson), its
clipped gradient (norm ≤ C) is added to the sum that receives N(0, (σ·C)²) noise. The claim is therefore the
ε of the subsampled Gaussian mechanism at the canary's own rate, composed over the steps it took part in,
with the σ the optimizer reports (not the σ that a faulty implementation may really have drawn):

* ``sample_rate = 1`` (the canary in every step): a Gaussian mechanism of sensitivity C and noise σ_t·C is
  exactly (1/σ_t)-GDP, and T of them compose exactly to μ-GDP with μ = sqrt(Σ_t σ_t⁻²) (Dong, Roth & Su,
  *Gaussian differential privacy*, 2022); its (ε, δ) curve (their Cor. 2.13; Balle & Wang 2018, Thm. 8) is
  evaluated by :func:`gaussian_dp_epsilon`;
* ``sample_rate < 1``: Opacus' PRV accountant (or ``"rdp"``) on the history ``[(σ, rate, steps)]`` — the
  engine's own accountant when the canaries share the data's rate.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from scipy import optimize, special, stats

__all__ = ["canary_epsilon", "gaussian_dp_delta", "gaussian_dp_epsilon"]


def gaussian_dp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: ``Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)`` (``docs/math.md`` eq. 5.4), in log space."""
    if mu <= 0:
        return 0.0
    a = special.log_ndtr(-epsilon / mu + mu / 2)
    b = epsilon + special.log_ndtr(-epsilon / mu - mu / 2)
    return float(math.exp(a) * -math.expm1(b - a)) if b < a else 0.0


def gaussian_dp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with ``δ(ε) ≤ delta`` for μ-GDP (eq. 5.4; δ(ε) is decreasing in ε). Exact up to 1e-12."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be finite and >= 0, got {mu!r}")
    if gaussian_dp_delta(mu, 0.0) <= delta:
        return 0.0
    # δ(ε) ≤ Φ(−ε/μ + μ/2): at ε = μ²/2 + μ·z_{1−δ} it is ≤ δ already
    hi = mu * mu / 2 + mu * float(stats.norm.isf(delta)) + 1e-9
    return float(optimize.brentq(lambda e: gaussian_dp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-14))


def canary_epsilon(
    noise_multipliers: Sequence[float],
    sample_rate: float,
    delta: float,
    *,
    accountant: str = "prv",
) -> float:
    """ε(δ) claimed for a canary present in each of these steps with probability ``sample_rate``.

    Args:
        noise_multipliers: σ_t of every step the canary could take part in (as the optimizer reports them).
        sample_rate: the canary's per-step inclusion probability (1.0: every step).
        delta: δ of the claim.
        accountant: for ``sample_rate < 1``: ``"prv"`` (default, Opacus' PRV accountant) or ``"rdp"``.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    sigmas = [float(s) for s in noise_multipliers]
    if not sigmas:
        return 0.0
    if any(s <= 0 for s in sigmas):
        return math.inf  # a step without noise: no finite guarantee
    if sample_rate == 1.0:
        return gaussian_dp_epsilon(math.sqrt(sum(s**-2 for s in sigmas)), delta)
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = {"prv": PRVAccountant, "rdp": RDPAccountant}.get(accountant)
    if acc is None:
        raise ValueError(f"accountant must be 'prv' or 'rdp', got {accountant!r}")
    a = acc()
    a.history = [(s, float(sample_rate), n) for s, n in Counter(sigmas).items()]
    return float(a.get_epsilon(delta))
