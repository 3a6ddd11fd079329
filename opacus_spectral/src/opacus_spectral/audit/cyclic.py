"""Gradient canaries on a BandMF run (``docs/audit.md``, "BandMF runs"): the claim and the score under cyclic
participation and correlated noise.

A canary of group g takes part at the steps t ≡ g (mod b) only — at most ⌈T/b⌉ times, b apart: the participation the
BandMF analysis bounds (arXiv 2306.08153, Thm 1 and 4–5), here at the within-group rate 1. A b-banded M with unit
columns has disjoint column supports at such steps, so the canary's sensitivity is ‖M·x_g‖ ≤ √⌈T/b⌉ whatever the
data: its claim is exactly μ-GDP, from the :class:`~opacus_spectral.mechanisms.strategy.Accounting` the engine computes
for the strategy.
The score whitens the release y (its noise is σ·M⁻¹z): M·y = M·x_g·[included] + M·(data) + σz.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..mechanisms.bandmf_math import normalized, strategy_matrix

__all__ = ["cyclic_claimed_mu", "whitened_scores"]


def whitened_scores(values: torch.Tensor, groups: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """Per canary, σ² × the log-likelihood ratio of "included" given its released values (``values``, T × m, in
    units of its signal) under strategy M (``coefficients``, normalized to κ = 1): ⟨M x_g, M y⟩ − ½‖M x_g‖², x_g
    the 0/1 steps of the canary's group g. With b = 1 (M = I) it is the sum minus T/2 (the same ranking)."""
    steps, m = values.shape
    bands = len(coefficients)
    strategy = strategy_matrix(normalized(coefficients), steps)
    pattern = torch.zeros(bands, steps, dtype=torch.float64)
    for g in range(bands):
        pattern[g, g::bands] = 1.0
    signal = pattern @ strategy.T  # (b, T): M x_g per group
    per_group = signal @ (strategy @ values.to(torch.float64))  # (b, m)
    return per_group[groups, torch.arange(m)] - 0.5 * (signal**2).sum(1)[groups]


def cyclic_claimed_mu(strategy: Any, noise_multipliers: Sequence[float]) -> float:
    """μ of the μ-GDP claim for a canary in every step of its group over the observed steps: the ``strategy``'s
    (a :class:`~opacus_spectral.mechanisms.strategy.BandedToeplitz` or the run's realization) Accounting at the
    within-group rate 1 (loader rate 1/b) — DP-SGD with (σ′, 1, ⌈T/b⌉), μ = √(Σ σ′⁻²) over the
    steps it charges; ``inf`` after a charged step without noise. One σ for the whole run (as the engine enforces):
    with σ changing, a canary's whitened sensitivity would mix the σ of neighbouring steps."""
    if len(set(noise_multipliers)) > 1 and strategy.bands > 1:
        raise ValueError(f"a BandMF canary claim needs one noise multiplier for the run, got {set(noise_multipliers)}")
    inverse_squares = []
    for t, sigma in enumerate(noise_multipliers):
        acc = strategy.accounting(sigma, 1.0 / strategy.bands)
        if not math.isclose(acc.sample_rate, 1.0, rel_tol=1e-12):
            raise ValueError(f"the canaries' rate within a group must be 1, the accounting says {acc.sample_rate}")
        if acc.charge(t):
            if acc.noise_multiplier <= 0:
                return math.inf
            inverse_squares.append(acc.noise_multiplier**-2)
    return math.sqrt(sum(inverse_squares))
