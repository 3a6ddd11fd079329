"""Random-matrix-theory formulas for noisy gradient matrices — pure, elementwise tensor math.

The method of paper A (Dadsetan & Rudzicz, arXiv 2510.01137); formulas and sources in ``docs/math.md`` §1.
Noise model (§1.1): one noisy gradient ``G~ = G + s·Z`` of shape ``(m, n)``, ``Z`` i.i.d. N(0, 1), ``s`` the
per-entry noise std. The maps here act elementwise on singular values (any batch shape, ``s`` broadcast):

* bulk edge ``s(√m + √n)`` (largest singular value of ``s·Z``), BBP threshold ``s(mn)^{1/4}`` (§1.2);
* the closed-form inversion of the singular-value inflation ``λ~ = sqrt((λ + s²n/λ)(λ + s²m/λ))``
  (:func:`invert_inflation`, larger root of ``t² + (s²(m+n) − λ~²)t + s⁴mn = 0``, ``t = λ²``; §1.3);
* Shabalin & Nobel (2013) optimal shrinkage (:func:`optimal_shrinkage`, §1.4);
* gate thresholds (§1.7): ``"kappa"`` (``λ~₁ > κ·s(√m+√n)``, paper A) and ``"tracy_widom"`` (finite-size gate at
  a false-alarm rate from the Tracy–Widom law of the largest eigenvalue of a white Wishart matrix,
  Johnstone 2001; optional Ma 2012 second-order centering; :mod:`opacus_spectral.denoisers.rmt.tracy_widom`).

Denoising a batch of matrices with them (gate, spikes, reconstruction, norm correction) is
:func:`opacus_spectral.denoisers.rmt.rmt_denoise`; its settings are :class:`opacus_spectral.denoisers.rmt.RMTSettings`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .tracy_widom import TW1_LOG10_ALPHA, TW1_QUANTILES, tracy_widom_quantile, tracy_widom_threshold

__all__ = [
    "TW1_LOG10_ALPHA",
    "TW1_QUANTILES",
    "bbp_threshold",
    "bulk_edge",
    "gate_threshold",
    "invert_inflation",
    "optimal_shrinkage",
    "shrink_singular_values",
    "tracy_widom_quantile",
    "tracy_widom_threshold",
]

Gate = Literal["kappa", "tracy_widom"]

# --------------------------------------------------------------------------------------------------
# Scalar RMT maps (elementwise on tensors; m, n are Python numbers)


def bulk_edge(sigma: Tensor | float, m: int, n: int) -> Tensor | float:
    """Asymptotic largest singular value of ``s·Z`` (m × n): ``s(√m + √n)``."""
    return sigma * (math.sqrt(m) + math.sqrt(n))


def bbp_threshold(sigma: Tensor | float, m: int, n: int) -> Tensor | float:
    """BBP phase transition: a signal singular value is detectable iff ``λ > s(mn)^{1/4}``."""
    return sigma * (m * n) ** 0.25


def invert_inflation(observed: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """Invert ``λ~ = sqrt((λ + s²n/λ)(λ + s²m/λ))`` in closed form (``docs/math.md`` §1.3).

    ``t = λ²`` is the larger root of ``t² + (s²(m+n) − λ~²)t + s⁴mn = 0``::

        t = [λ~² − s²(m+n) + sqrt((λ~² − s²(m+n))² − 4s⁴mn)] / 2,

    real iff ``λ~ ≥ s(√m+√n)``. Returns ``λ̂ = sqrt(t)``, and 0 inside the bulk (``λ~ < s(√m+√n)``).
    The discriminant is evaluated in the factored form ``(λ~² − s²(√m+√n)²)(λ~² − s²(√m−√n)²)``.
    ``sigma`` must be positive and broadcast against ``observed``.
    """
    x2 = (observed / sigma).square()  # normalized units, s = 1
    edge2 = (math.sqrt(m) + math.sqrt(n)) ** 2
    low2 = (math.sqrt(m) - math.sqrt(n)) ** 2
    disc = ((x2 - edge2) * (x2 - low2)).clamp_min(0.0)
    t = 0.5 * (x2 - (m + n) + disc.sqrt())
    inside = x2 < edge2
    return torch.where(inside, torch.zeros_like(t), t.clamp_min(0.0).sqrt() * sigma)


def optimal_shrinkage(lam: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """Shabalin & Nobel (2013) Frobenius-optimal shrinkage of a recovered signal value ``λ̂`` (``docs/math.md`` §1.4)::

        η = λ̂ · sqrt((λ̂⁴ − mns⁴)/(λ̂⁴ + mλ̂²s²)) · sqrt((λ̂⁴ − mns⁴)/(λ̂⁴ + nλ̂²s²)),

    ``η = 0`` if ``λ̂⁴ ≤ mns⁴`` (below the BBP threshold). Evaluated as
    ``s·(L² − mn)/sqrt(L(L+m)(L+n))`` with ``L = λ̂²/s²`` (the same expression, simplified).
    """
    big_l = (lam / sigma).square()
    num = big_l.square() - m * n
    den = (big_l * (big_l + m) * (big_l + n)).clamp_min(torch.finfo(big_l.dtype).tiny).sqrt()
    eta = sigma * num / den
    return torch.where(num > 0, eta, torch.zeros_like(eta))


def shrink_singular_values(observed: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """η(λ~): inversion then optimal shrinkage; 0 for components inside the bulk."""
    return optimal_shrinkage(invert_inflation(observed, sigma, m, n), sigma, m, n)


def gate_threshold(
    sigma: Tensor,
    m: int,
    n: int,
    gate: Gate = "kappa",
    kappa: float = 1.02,
    false_alarm: float = 1e-3,
    tw_centering: Literal["johnstone", "ma"] = "johnstone",
) -> Tensor:
    """τ: a matrix is denoised only if ``λ~₁ > τ`` (``"kappa"``: ``τ = κ·s(√m+√n)``; ``docs/math.md`` §1.7)."""
    if gate == "kappa":
        return kappa * bulk_edge(sigma, m, n)  # type: ignore[return-value]
    if gate == "tracy_widom":
        return tracy_widom_threshold(sigma, m, n, false_alarm, tw_centering)  # type: ignore[return-value]
    raise ValueError(f"gate must be 'kappa' or 'tracy_widom', got {gate!r}")
