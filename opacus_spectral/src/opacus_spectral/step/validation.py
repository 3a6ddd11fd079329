"""Checking what a denoiser hands back, before the engine reads a single value of it.

:func:`output_problem` inspects metadata only (type, layout, shape, dtype, device, storage size), so a hostile
output — a sparse tensor, a tensor subclass, a tensor whose storage was freed with
``untyped_storage().resize_(0)`` — is refused before any kernel touches it (reading freed storage crashes the
interpreter). :func:`output_bounds` gives the norm bound of each tensor (``max_output_ratio``):

    ‖out_i‖ ≤ ratio · r_i,   r_i = max(‖g̃_i‖, s·√numel_i)

with ``g̃_i`` the step's noisy gradient of tensor ``i`` before any denoiser (counted as 0 where it is non-finite)
and ``s`` the step's noise std, so ``s·√numel_i`` is the expected norm of the noise in tensor ``i``. Only
without noise (``s = 0``) can ``r_i`` be 0; such a tensor is bounded by ``ratio`` × the step's total noisy
gradient norm instead, and not at all when that is 0 too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "TensorSpec",
    "noise_norms",
    "output_bounds",
    "output_problem",
    "stacked_norms",
    "storage_fits",
    "tensor_norms",
]


def tensor_norms(tensors: Sequence[torch.Tensor], order: float) -> list[torch.Tensor]:
    """Float32 norms of ``tensors`` from one fused ``torch._foreach_norm`` (the fused-norm helper of the pipeline's
    checks and the doctor's): 0-d tensors, each on its input's device; an empty tensor's is 0; NaN/Inf propagate."""
    return list(torch._foreach_norm([t if t.numel() else t.new_zeros(1) for t in tensors], order, dtype=torch.float32))


def stacked_norms(tensors: Sequence[torch.Tensor], order: float) -> torch.Tensor:
    """:func:`tensor_norms` as one tensor on the first input's device (empty for no input)."""
    if not tensors:
        return torch.zeros(0)
    return torch.stack([n.to(tensors[0].device) for n in tensor_norms(tensors, order)])


class TensorSpec(NamedTuple):
    """What every output for one record must match: the step's noisy gradient's shape, dtype and device."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(t.shape, t.dtype, t.device)


def storage_fits(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every element its shape, strides and offset address."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return min(t.stride(), default=0) >= 0 and t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


def output_problem(o: Any, spec: TensorSpec) -> str | None:
    """Why ``o`` cannot be used as the gradient described by ``spec`` (``None``: it can)."""
    kind = type(o)
    if not issubclass(kind, torch.Tensor):
        return f"returned {kind.__name__} instead of a tensor"
    if kind is not torch.Tensor and kind is not nn.Parameter:
        return f"returned a tensor subclass {kind.__name__}; return a plain torch.Tensor"
    try:
        if o.layout != torch.strided or o.is_nested:
            layout = "nested" if o.is_nested else str(o.layout).removeprefix("torch.")
            return f"returned a {layout} tensor; return a dense (torch.strided) tensor"
        if o.shape != spec.shape:
            return f"changed the shape {tuple(spec.shape)} -> {tuple(o.shape)}"
        if o.dtype != spec.dtype:
            return f"changed the dtype {spec.dtype} -> {o.dtype}"
        if o.device != spec.device:
            return f"moved the gradient from {spec.device} to {o.device}"
        if not storage_fits(o):
            return (
                f"returned a tensor whose storage ({o.untyped_storage().nbytes()} bytes) is smaller than its "
                "shape needs (freed or shrunk storage)"
            )
    except Exception as exc:  # noqa: BLE001 - an output the engine cannot even inspect is a bad output
        return f"returned a tensor that cannot be inspected ({type(exc).__name__}: {exc})"
    return None


def noise_norms(numels: Sequence[int], sigma: float, device: torch.device) -> torch.Tensor:
    """``s·√numel_i`` per tensor (float32, on ``device``): the expected noise norms of a record set; ``s`` counts as
    0 when it is not a positive finite number. Constant while the record set and ``s`` are: the pipeline computes it
    once per record set, not every step (a host list copied to the device)."""
    s = float(sigma) if math.isfinite(float(sigma)) and float(sigma) > 0 else 0.0
    return torch.tensor([s * math.sqrt(n) for n in numels], dtype=torch.float32).to(device)


def output_bounds(
    norms: torch.Tensor, in_finite: torch.Tensor, noise: torch.Tensor, ratio: float | None
) -> torch.Tensor:
    """Largest admissible output norm per tensor (module docstring); infinite when ``ratio`` is ``None``.

    ``noise`` is :func:`noise_norms` of the step's tensors.
    """
    if ratio is None:
        return torch.full_like(in_finite, float("inf"), dtype=torch.float32)
    own = torch.where(in_finite, norms.float(), 0.0)
    ref = torch.maximum(own, noise)
    total = own.double().pow(2).sum().sqrt().float()
    ref = torch.where(ref > 0, ref, total)
    return torch.where(ref > 0, ref * ratio, float("inf"))
