"""The default server-side update bound: the longest update an honest client of the run can send.

An honest client starts a round from the global state ``θ₀`` and takes ``K = local_steps`` optimizer steps
(state reset every round) on its noisy DP gradient; what it sends differs from ``θ₀`` by at most:

* **AdamW** (torch's, betas (0.9, 0.999)): each coordinate's step is ``lr·m̂_t/(√v̂_t + eps)``, and by
  Cauchy–Schwarz ``|m̂_t|/√v̂_t ≤ κ_t = (1−β₁)/(1−β₁ᵗ)·√((1−β₂ᵗ)/(1−β₂)·Σ_{j<t}(β₁²/β₂)ʲ)`` whatever the
  gradients (κ₁ = 1, κ₅ ≈ 1.011: tight — one step of any gradient moves every coordinate by ≈ ``lr``).
  Decoupled weight decay scales θ by ``ρ = 1 − lr·wd`` per step. So
  ``‖Δ‖ ≤ max_k |1 − ρᵏ|·‖θ₀‖ + Σ_t κ_t·‖lr‖`` with ``‖lr‖ = √(Σ_c lr_c²)`` over the coordinates (B at
  ``b_lr_ratio·lr``). No assumption on the data, the noise or the filter.
* **SGD** (momentum μ, coupled weight decay): the noisy gradient is ``(Σ clipped + σC·ξ)/B_exp`` with
  ``‖Σ clipped‖ ≤ n·C`` (n = the partition size) and ``‖ξ‖ ≤ √D + 10`` (ξ ~ N(0, I_D); Gaussian concentration:
  exceeded with probability below e⁻⁵⁰ per step); the run's filters (``binomial5``: a symmetric doubly
  stochastic matrix under half-sample symmetric padding; ``laplacian``: ``(I − σΔ)⁻¹``, eigenvalues in (0, 1])
  do not lengthen it. Momentum and weight decay are then unrolled over the K steps.

The float rounding of K steps (``4·K·eps`` of the dtype, relative) is added. :func:`server_update_bound` is
the largest bound over the run's partitions; it never clips an honest update and bounds any other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["adam_step_bound", "honest_update_norm", "server_update_bound"]

NOISE_TAIL = 10.0  #: ‖ξ‖ ≤ √D + NOISE_TAIL except with probability ≤ exp(−NOISE_TAIL²/2) per step


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """κ_t: the largest ``|m̂_t|/√v̂_t`` of Adam's t-th step over all gradient sequences (Cauchy–Schwarz)."""
    b1, b2 = betas
    r = b1 * b1 / b2
    geometric = sum(r**j for j in range(t))
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * geometric)


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(v.detach().double().square().sum()) for v in state.values()))


def honest_update_norm(
    cfg: Any, global_state: Mapping[str, torch.Tensor], num_examples: int, noise_multiplier: float, sample_rate: float
) -> float:
    """The largest ``‖state − global_state‖₂`` an honest client of ``cfg`` (a ``FederationConfig``) with
    ``num_examples`` examples and (σ, q) sends after one round (see the module docstring)."""
    from .aggregate import factor_of

    k = int(cfg.local_steps)
    lrs = {"A": cfg.lr, "B": cfg.lr * cfg.b_lr_ratio, "other": cfg.lr}
    numel = {g: 0 for g in lrs}
    for key, v in global_state.items():
        numel[factor_of(key)] += v.numel()
    dim = sum(numel.values())
    theta0 = _norm(global_state)
    wd = cfg.weight_decay
    if cfg.optimizer == "adamw":
        lr_norm = math.sqrt(sum(numel[g] * lrs[g] ** 2 for g in lrs))
        rhos = [1 - lr * wd for g, lr in lrs.items() if numel[g]]
        decay = max(abs(1 - rho**s) for rho in rhos for s in range(1, k + 1))
        grow = max(max(1.0, abs(rho)) ** (k - 1) for rho in rhos)
        bound = decay * theta0 + grow * lr_norm * sum(adam_step_bound(t) for t in range(1, k + 1))
    else:
        lr_max = max(lrs.values())
        expected_batch = max(1, int(num_examples * sample_rate))  # Opacus' expected_batch_size
        grad = cfg.max_grad_norm * (num_examples + noise_multiplier * (math.sqrt(dim) + NOISE_TAIL)) / expected_batch
        momentum = float(getattr(cfg, "momentum", 0.0))
        bound = buf = 0.0
        for _ in range(k):
            buf = momentum * buf + grad + wd * (theta0 + bound)
            bound += lr_max * buf
    eps = max(torch.finfo(v.dtype).eps for v in global_state.values())
    return bound + 4 * k * eps * (theta0 + bound)


def server_update_bound(
    cfg: Any, global_state: Mapping[str, torch.Tensor], sizes: Sequence[int], privacy: Mapping[int, tuple[float, float]]
) -> float | None:
    """The bound the server applies: ``cfg.max_update_norm`` when set (> 0); else, with ``auto_update_norm``,
    the largest :func:`honest_update_norm` over the partitions; else ``None`` (no bound)."""
    if cfg.max_update_norm > 0:
        return float(cfg.max_update_norm)
    if not cfg.auto_update_norm or not global_state:
        return None
    return max(honest_update_norm(cfg, global_state, n, *privacy[c]) for c, n in enumerate(sizes))
