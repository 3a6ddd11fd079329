"""The standard DP-SGD image models for Fashion-MNIST.

* :func:`tanh_cnn` — the tanh CNN of Papernot et al. 2021 ("Tempered sigmoid activations for deep learning with
  differential privacy", arXiv 2007.14191) for 28 × 28 inputs: conv 16 × 8 × 8 stride 2 → tanh → max-pool 2
  (stride 1) → conv 32 × 4 × 4 stride 2 → tanh → max-pool 2 (stride 1) → linear 512 → 32 → tanh → linear 10;
  26,010 parameters.
* :func:`mlp` — one hidden layer, 784 → 256 (tanh) → 10; 203,530 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "build", "mlp", "tanh_cnn"]


def tanh_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, 10),
    )


def mlp(hidden: int = 256) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.Tanh(), nn.Linear(hidden, 10))


MODELS = {"cnn": tanh_cnn, "mlp": mlp}


def build(name: str, seed: int) -> nn.Module:
    """A freshly initialized model ``name`` (``"cnn"`` / ``"mlp"``) from ``seed``, without touching the global RNG."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name]()
