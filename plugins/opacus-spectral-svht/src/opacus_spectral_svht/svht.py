"""SVHT: keep singular values above λ*(β)·√n·s (Gavish & Donoho 2014, "The optimal hard threshold for
singular values is 4/√3", eq. (11) for known noise level).

For an m×n matrix with β = min(m,n)/max(m,n), n = max(m,n) and noise std s per entry:

    λ*(β) = sqrt(2(β+1) + 8β / ((β+1) + sqrt(β² + 14β + 1)))        (λ*(1) = 4/√3)

Singular values ≤ λ*(β)·√n·s are set to zero, the others are kept unchanged (the repository's
``docs/math.md`` §1.6).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from opacus_spectral.denoisers import Selector

from opacus_spectral import Denoiser, NoisyGradient

ROLES = ("weight", "lora_A", "lora_B")


def threshold_coefficient(beta: float) -> float:
    """λ*(β) of Gavish–Donoho eq. (11), for aspect ratio 0 < β ≤ 1."""
    if not 0 < beta <= 1:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    return math.sqrt(2 * (beta + 1) + 8 * beta / ((beta + 1) + math.sqrt(beta**2 + 14 * beta + 1)))


def svht(matrices: torch.Tensor, sigma: float) -> torch.Tensor:
    """Hard-threshold a batch of same-shape matrices (..., m, n) in float32/float64."""
    m, n = matrices.shape[-2:]
    tau = threshold_coefficient(min(m, n) / max(m, n)) * math.sqrt(max(m, n)) * sigma
    u, s, vh = torch.linalg.svd(matrices, full_matrices=False)
    s = torch.where(s > tau, s, torch.zeros_like(s))
    return (u * s.unsqueeze(-2)) @ vh


class SVHTDenoiser(Denoiser):
    """``"svht"``: optimal hard threshold of each ≥2-D gradient (conv kernels as (out, in·k·k)), batched by shape.

    Args:
        roles: roles to act on (default: weight, lora_A, lora_B; a plain string is one role): its :attr:`selector`,
            which the pipeline applies (it is handed only those records).
        compute_dtype: torch.float32 (default) or torch.float64.
    """

    name = "svht"
    needs_isotropic_noise = True  # known σ per entry (eq. 11): the engine warns if an undeclared callable hides it

    def __init__(self, roles: str | Sequence[str] = ROLES, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.selector = Selector.build(roles=roles, default_roles=ROLES)
        self.compute_dtype = compute_dtype

    @property
    def roles(self) -> frozenset[str]:
        return self.selector.roles  # type: ignore[return-value]

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(grads)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, g in enumerate(grads):
            t = g.tensor
            if t.dim() >= 2 and t.numel() > 0 and g.sigma > 0:  # the pipeline hands it only the roles it selects
                groups[(t.shape[0], t[0].numel(), t.dtype, t.device, g.sigma)].append(i)
        for (m, n, dtype, _, sigma), idx in groups.items():
            batch = torch.stack([grads[i].tensor.reshape(m, n) for i in idx]).to(self.compute_dtype)
            den = svht(batch, sigma).to(dtype)
            for j, i in enumerate(idx):
                out[i] = den[j].reshape(grads[i].tensor.shape)
        self.stats = {"matrices": sum(len(v) for v in groups.values())}
        return out
