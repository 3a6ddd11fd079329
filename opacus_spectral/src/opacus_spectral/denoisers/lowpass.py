"""``"lowpass"``: fixed low-pass filtering of noisy gradients as a denoiser.

The filter of LA-LoRA (paper B: arXiv 2602.19926), ``docs/math.md`` §2. The filter math lives in
:mod:`opacus_spectral.denoisers.filters`. The axis comes from the parameter's role (§2.5):
LoRA A ``(r, in)`` is smoothed along its input features (dim 1), LoRA B ``(out, r)`` along its output
features (dim 0); other ≥2-D ``weight`` gradients only when ``weight_axis`` is set; 1-D gradients only
with ``vectors=True``. Same-shape tensors with the same axis are filtered in one batched call. Which records it
is handed (``params=``, the roles with an axis) is its :attr:`~LowPassDenoiser.selector`, applied by the pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..step.records import ROLE_LORA_A, ROLE_LORA_B, ROLE_WEIGHT, NoisyGradient
from ..step.selection import ParamFilter, Selector
from . import filters
from .base import Denoiser
from .rmt import matrix_view

__all__ = ["LowPassDenoiser"]

Kernel = Literal["binomial5", "gaussian", "laplacian"]


class LowPassDenoiser(Denoiser):
    """Smooth noisy gradients with a fixed kernel along a role-dependent axis (paper B; ``docs/math.md`` §2).

    Args:
        kernel: ``"binomial5"`` (``[1,4,6,4,1]/16``, symmetric padding; default, paper B),
            ``"gaussian"`` (std ``kernel_width`` samples, symmetric padding) or ``"laplacian"`` (``(I − wΔ)⁻¹``,
            ``w`` = ``kernel_width``, circular, by FFT; paper B's reference code).
        kernel_width: kernel width for ``gaussian`` (default 1.0) / ``laplacian`` (default 1.0, the reference
            code). Not the noise std — that is ``record.sigma`` and a fixed filter does not use it.
        laplacian_dims: 1 (along the role's axis) or 2 (over both matrix axes, incl. the rank axis, like
            the reference code).
        weight_axis: axis for other ≥2-D ``weight`` gradients (conv kernels are viewed as
            ``(out, in·k·k)``): ``None`` (default) leaves them untouched, 0 or 1 filters along that axis.
        vectors: also filter 1-D gradients (bias, LayerNorm) along their only axis (default off).
        role_axes: override/extend the role → axis map (``None`` axis = untouched), e.g.
            ``{"embedding": 1}`` or ``{"lora_A": None}``.
        params: optional name filter: a substring, substrings (any match) or a predicate on the qualified name.
        truncate: Gaussian kernel radius in units of ``kernel_width``.

    The filter does not depend on ``record.sigma``, except that a noiseless record (``sigma == 0``) is
    left unchanged (the opacus-spectral contract: no noise, nothing to remove). ``self.stats``:
    ``{"filtered": number of tensors filtered}``.
    """

    name = "lowpass"

    def __init__(
        self,
        *,
        kernel: Kernel = "binomial5",
        kernel_width: float | None = None,
        laplacian_dims: int = 1,
        weight_axis: int | None = None,
        vectors: bool = False,
        role_axes: Mapping[str, int | None] | None = None,
        params: ParamFilter = None,
        truncate: float = 4.0,
    ) -> None:
        super().__init__()
        if kernel not in ("binomial5", "gaussian", "laplacian"):
            raise ValueError(f"kernel must be 'binomial5', 'gaussian' or 'laplacian', got {kernel!r}")
        if kernel == "binomial5" and kernel_width is not None:
            raise ValueError("kernel_width is only used by the 'gaussian' and 'laplacian' kernels")
        width = 1.0 if kernel_width is None else float(kernel_width)
        if not (math.isfinite(width) and width > 0):
            raise ValueError(f"kernel_width must be positive and finite, got {kernel_width!r}")
        if laplacian_dims not in (1, 2):
            raise ValueError(f"laplacian_dims must be 1 or 2, got {laplacian_dims!r}")
        if laplacian_dims == 2 and kernel != "laplacian":
            raise ValueError("laplacian_dims=2 needs kernel='laplacian'")
        axes: dict[str, int | None] = {ROLE_LORA_A: 1, ROLE_LORA_B: 0, ROLE_WEIGHT: weight_axis}
        axes.update(role_axes or {})
        for role, ax in axes.items():
            if ax not in (None, 0, 1):
                raise ValueError(f"axis for role {role!r} must be None, 0 or 1, got {ax!r}")
        self.kernel: Kernel = kernel
        self.kernel_width = width
        self.laplacian_dims = laplacian_dims
        self.role_axes = axes
        self.vectors = bool(vectors)
        #: the records it is handed: ``params=`` and the roles with an axis (every role with ``vectors=True``:
        #: 1-D tensors of any role are filtered then)
        acting = frozenset(r for r, ax in axes.items() if ax is not None)
        self.selector = Selector(roles=None if self.vectors else acting, params=params)
        self.truncate = float(truncate)
        self._taps: Tensor | None = None
        if kernel == "binomial5":
            self._taps = torch.tensor(filters.BINOMIAL5, dtype=torch.float64)
        elif kernel == "gaussian":
            self._taps = filters.gaussian_kernel(self.kernel_width, self.truncate)

    @property
    def params(self) -> ParamFilter:
        return self.selector.params

    def axis_for(self, rec: NoisyGradient) -> tuple[Tensor, int] | None:
        """(tensor view, axis) to filter ``rec`` along, or ``None`` to leave it untouched."""
        t = rec.tensor
        if rec.sigma == 0 or t.numel() == 0 or not t.is_floating_point():
            return None
        if t.dim() == 1:
            return (t, 0) if self.vectors else None
        mat = matrix_view(t)
        if mat is None:
            return None
        ax = self.role_axes.get(rec.role)
        return None if ax is None else (mat, ax)

    def filter_batch(self, x: Tensor, axis: int) -> Tensor:
        """Filter a stacked batch ``x`` (B, ...) along data ``axis`` (≥ 0, not counting the batch dim)."""
        if self.kernel == "laplacian":
            dims: list[int] = [axis + 1] if self.laplacian_dims == 1 or x.dim() == 2 else [1, 2]
            return filters.laplacian_smooth(x, self.kernel_width, dims)
        assert self._taps is not None
        return filters.apply_kernel(x, self._taps, axis + 1)

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(grads)
        groups: dict[tuple[Any, ...], list[tuple[int, Tensor]]] = {}
        for i, rec in enumerate(grads):
            sel = self.axis_for(rec)
            if sel is not None:
                view, ax = sel
                groups.setdefault((tuple(view.shape), view.dtype, view.device, ax), []).append((i, view))
        for (_, _, _, ax), members in groups.items():
            smoothed = self.filter_batch(torch.stack([v for _, v in members]), ax)
            for b, (i, _) in enumerate(members):
                out[i] = smoothed[b].reshape(grads[i].tensor.shape)
        self.stats = {"filtered": sum(len(m) for m in groups.values())}
        self._filtered = {i for members in groups.values() for i, _ in members}
        return out

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        """Filtered records: ``"colored"`` (a spatial filter correlates neighbouring entries, ``docs/math.md`` §2);
        the others: unchanged (gain 1)."""
        return ["colored" if i in getattr(self, "_filtered", set()) else 1.0 for i in range(len(grads))]

    def __repr__(self) -> str:
        extra = "" if self.kernel == "binomial5" else f", kernel_width={self.kernel_width}"
        return f"LowPassDenoiser(kernel={self.kernel!r}{extra}, role_axes={self.role_axes})"
