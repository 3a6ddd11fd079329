"""Moving adapter tensors in and out of a model: what a client sends and what the server installs."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["adapter_state", "load_adapter_state", "trainable_parameters"]


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: param}`` of the parameters trainable *now* (call before any factor is frozen)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def adapter_state(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached clones of ``params`` — safe to hand to a server that may keep or modify them."""
    return {n: p.detach().clone() for n, p in params.items()}


def load_adapter_state(params: Mapping[str, nn.Parameter], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``params`` in place (no autograd). Keys and shapes must match exactly."""
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise KeyError(f"adapter state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for n, p in params.items():
            src = state[n]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"shape mismatch for {n!r}: {tuple(src.shape)} != {tuple(p.shape)}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))
