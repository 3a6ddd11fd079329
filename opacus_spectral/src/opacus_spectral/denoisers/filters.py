"""Fixed low-pass filters for noisy gradients — pure, batched tensor math (``docs/math.md`` §2).

The filters of LA-LoRA (paper B: "Rethinking LoRA for Privacy-Preserving Federated Learning in Large
Models", arXiv 2602.19926) and of its public reference code:

* :func:`binomial5` — the 5-tap binomial kernel ``[1, 4, 6, 4, 1]/16`` with symmetric padding (paper B;
  §2.1). Frequency response ``cos⁴(ω/2)``: DC gain 1, Nyquist gain 0, white-noise variance
  factor ``Σ h² = 70/256 ≈ 0.273`` (§2.4).
* :func:`gaussian` — a normalised sampled Gaussian kernel of std ``width`` samples (radius
  ``ceil(truncate·width)``), symmetric padding (§2.2).
* :func:`laplacian_smooth` — ``(I − wΔ)⁻¹`` (``w`` = ``width``) with the circular discrete Laplacian, solved
  exactly by FFT (paper B's reference code), over one axis or two; response ``1/(1 + 4w Σ_d sin²(ω_d/2))`` (§2.3).

The kernel width is ``width`` (``docs/math.md`` writes it σ): in this package ``sigma`` names the per-entry noise
std only.

"Symmetric" padding is half-sample symmetric (the edge sample is repeated: ``… b a | a b c …``, NumPy's
``mode="symmetric"``). All functions filter along ``axis`` of a tensor of any shape (so a leading batch
dim is just another axis) and return a new tensor of the same shape and dtype; half-precision inputs are
computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BINOMIAL5",
    "apply_kernel",
    "binomial5",
    "gaussian",
    "gaussian_kernel",
    "laplacian_response",
    "laplacian_smooth",
    "symmetric_indices",
]

#: Paper B's kernel (``docs/math.md`` §2.1).
BINOMIAL5: tuple[float, ...] = (1 / 16, 4 / 16, 6 / 16, 4 / 16, 1 / 16)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def symmetric_indices(length: int, pad: int, device: torch.device | None = None) -> Tensor:
    """Indices of a half-sample symmetric extension by ``pad`` on both sides (period ``2·length``)."""
    if length < 1:
        raise ValueError("cannot pad an empty axis")
    idx = torch.arange(-pad, length + pad, device=device) % (2 * length)
    return torch.where(idx >= length, 2 * length - 1 - idx, idx)


def apply_kernel(x: Tensor, kernel: Sequence[float] | Tensor, axis: int = -1) -> Tensor:
    """Correlate ``x`` along ``axis`` with an odd-length symmetric ``kernel``, symmetric padding.

    ``y[i] = Σ_k h[k]·x_ext[i + k − r]`` with ``r = (len(h) − 1)/2``. Works for any axis length ≥ 1.
    """
    h = torch.as_tensor(kernel, dtype=torch.float64)
    if h.dim() != 1 or h.numel() % 2 == 0:
        raise ValueError(f"kernel must be 1-D with odd length, got shape {tuple(h.shape)}")
    if x.numel() == 0:
        return x.clone()
    cdt = _compute_dtype(x)
    r = (h.numel() - 1) // 2
    xt = x.to(cdt).movedim(axis, -1)
    length = xt.shape[-1]
    ext = xt.index_select(-1, symmetric_indices(length, r, x.device))
    out = torch.zeros_like(xt)
    for k, hk in enumerate(h.tolist()):  # a handful of taps: shifted, weighted sums
        out = out + hk * ext[..., k : k + length]
    return out.movedim(-1, axis).to(x.dtype)


def binomial5(x: Tensor, axis: int = -1) -> Tensor:
    """``[1, 4, 6, 4, 1]/16`` along ``axis`` with symmetric padding (paper B, arXiv 2602.19926)."""
    return apply_kernel(x, BINOMIAL5, axis)


def gaussian_kernel(width: float, truncate: float = 4.0) -> Tensor:
    """Sampled Gaussian ``exp(−k²/(2w²))`` on ``|k| ≤ ceil(truncate·w)``, ``w`` = ``width``, normalised to sum 1
    (float64)."""
    if not (math.isfinite(width) and width > 0):
        raise ValueError(f"gaussian width must be positive and finite, got {width!r}")
    radius = max(1, math.ceil(truncate * width))
    k = torch.arange(-radius, radius + 1, dtype=torch.float64)
    h = torch.exp(-0.5 * (k / width) ** 2)
    return h / h.sum()


def gaussian(x: Tensor, width: float, axis: int = -1, truncate: float = 4.0) -> Tensor:
    """Gaussian smoothing of std ``width`` (in samples) along ``axis``, symmetric padding."""
    return apply_kernel(x, gaussian_kernel(width, truncate), axis)


def laplacian_response(
    sizes: Sequence[int],
    width: float,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
) -> Tensor:
    """Frequency response of ``(I − wΔ)⁻¹`` on a periodic grid: ``1/(1 + 4w Σ_d sin²(π k_d / N_d))``.

    Shape ``sizes`` (full FFT grid, ``torch.fft.fftn`` frequency order).
    """
    total = torch.zeros((), dtype=dtype, device=device)
    for d, size in enumerate(sizes):
        k = torch.arange(size, dtype=dtype, device=device)
        term = torch.sin(math.pi * k / size).square()
        shape = [1] * len(sizes)
        shape[d] = size
        total = total + term.reshape(shape)
    return 1.0 / (1.0 + 4.0 * width * total)


def laplacian_smooth(x: Tensor, width: float = 1.0, axes: int | Sequence[int] = -1) -> Tensor:
    """Laplacian smoothing ``(I − wΔ)⁻¹ x`` (``w`` = ``width``, default 1) with circular boundaries over ``axes``
    (1 or more), by FFT.

    ``Δ`` is the sum over ``axes`` of the periodic second difference ``x[i−1] − 2x[i] + x[i+1]``, whose
    Fourier symbol is ``−4 sin²(ω/2)`` (paper B's reference code uses ``w = 1`` over both axes; ``docs/math.md`` §3.4).
    """
    if not (math.isfinite(width) and width >= 0):
        raise ValueError(f"laplacian width must be >= 0 and finite, got {width!r}")
    if x.numel() == 0:
        return x.clone()
    dims = [axes] if isinstance(axes, int) else list(axes)
    dims = [d % x.dim() for d in dims]
    if len(set(dims)) != len(dims):
        raise ValueError(f"repeated axes {axes!r}")
    cdt = _compute_dtype(x)
    xc = x.to(cdt)
    resp = laplacian_response([x.shape[d] for d in dims], width, dtype=cdt, device=x.device)
    shape = [1] * x.dim()
    for d in dims:
        shape[d] = x.shape[d]
    spec = torch.fft.fftn(xc, dim=dims) * resp.reshape(shape)
    return torch.fft.ifftn(spec, dim=dims).real.to(x.dtype)
