"""Small models, loaders and recording denoisers for the engine tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import Denoiser, NoisyGradient


def mlp(d_in: int = 16, hidden: int = 128, d_out: int = 128, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def loader(
    n: int = 64, batch: int = 16, d_in: int = 16, d_out: int = 128, seed: int = 0, sampler_seed: int | None = None
) -> DataLoader:
    """A regression loader; ``sampler_seed`` gives it an explicit generator, which Opacus' Poisson sampler then uses
    (so two engines sample identically)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    sampler = None if sampler_seed is None else torch.Generator().manual_seed(sampler_seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch, generator=sampler)


class Recorder(Denoiser):
    """Keeps a copy of every record it sees (name, role, sigma, step, tensor clone)."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[dict[str, Any]]] = []
        self.raw: list[list[NoisyGradient]] = []

    def output_noise(self, grads: Sequence[NoisyGradient]) -> float:
        return 1.0  # a pass-through

    def __call__(self, grads: Sequence[NoisyGradient]) -> None:
        self.raw.append(list(grads))
        self.seen.append(
            [
                {
                    "name": g.name,
                    "role": g.role,
                    "sigma": g.sigma,
                    "step": g.step,
                    "layer": g.layer,
                    "tensor": g.tensor.detach().clone(),
                }
                for g in grads
            ]
        )


class Identity(Denoiser):
    name = "identity"

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[torch.Tensor]:
        return [g.tensor.clone() for g in grads]


class Scale(Denoiser):
    """Multiplies every gradient by ``factor`` in place (to check ordering)."""

    name = "scale"

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def __call__(self, grads: Sequence[NoisyGradient]) -> None:
        for g in grads:
            g.tensor.mul_(self.factor)


def pooled_std(records: list[dict[str, Any]]) -> float:
    flat = torch.cat([r["tensor"].flatten().double() for r in records])
    return float(flat.std())
