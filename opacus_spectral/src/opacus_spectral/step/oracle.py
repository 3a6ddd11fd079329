"""The oracle (benchmarks and audits only): the noise-free counterpart of a released gradient, and how close a
released gradient is to it.

Opacus keeps the clean clipped sum of a step in ``p.summed_grad``; the released ``p.grad`` is that sum plus the
noise, times :func:`~opacus_spectral.step.noise_std.clean_scale` (1/(B·k) for mean reduction, 1 for sum). So the clean
counterpart of ``p.grad`` is ``p.summed_grad · clean_scale`` (:func:`clean_gradients`), valid from Opacus' noise
until the next ``zero_grad``. Every comparison is in float64 (:func:`cosine`, :func:`norm_ratio`). Nothing here is
private: the clean gradient is what DP hides, so only experiments may look at it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from opacus.optimizers import DPOptimizer

from .noise_std import clean_scale

__all__ = ["clean_gradients", "cosine", "norm_ratio"]


def clean_gradients(
    optimizer: DPOptimizer,
    params: Sequence[torch.Tensor],
    *,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """``p.summed_grad · scale`` shaped like ``p`` for each of ``params`` (NaN where Opacus kept no sum), detached.

    ``scale``: the factor snapshotted earlier in the step (the engine reads it before AdaClip moves C); default
    :func:`~opacus_spectral.step.noise_std.clean_scale` now. ``dtype``: cast the sum before the product (float64 for
    spectra), else the product is taken in the sum's own dtype.
    """
    s = clean_scale(optimizer) if scale is None else float(scale)
    out = []
    for p in params:
        summed = getattr(p, "summed_grad", None)
        if summed is None:
            out.append(torch.full_like(p, float("nan"), dtype=dtype or p.dtype))
            continue
        summed = summed.detach().view_as(p)
        out.append((summed if dtype is None else summed.to(dtype)) * s)
    return out


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """cos(a, b) of the concatenations of ``a`` and ``b``, in float64; NaN when either is zero."""
    num = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return num / (na * nb) if na > 0 and nb > 0 else float("nan")


def norm_ratio(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """‖a‖ / ‖b‖ of the concatenations, in float64 (a released update's norm over its clean counterpart's)."""
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return na / nb if nb > 0 else float("nan")
