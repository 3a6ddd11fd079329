"""Random-matrix-theory spectral denoising (paper A: Dadsetan & Rudzicz, arXiv 2510.01137; ``docs/math.md`` §1).

* :mod:`~opacus_spectral.denoisers.rmt.settings` — :class:`RMTSettings`, validated once, with the library's defaults;
  :data:`PAPER_SETTING`;
* :mod:`~opacus_spectral.denoisers.rmt.stages` — :func:`rmt_denoise` on a batch of matrices, in stages (gate, spikes and
  shrinkage, reconstruction, norm correction) that return :class:`DenoiseResult` (τ, gates, spike counts, screen work);
* :mod:`~opacus_spectral.denoisers.rmt.denoiser` — :class:`RMTDenoiser`, the registered ``"rmt"`` / ``"rmt_paper"``
  denoisers.

The scalar formulas (bulk edge, inflation inversion, shrinkers, gate thresholds) are in
:mod:`opacus_spectral.denoisers.rmt.spectral`, the certified screens in :mod:`opacus_spectral.denoisers.rmt.screen`.
"""

from ...step.selection import ParamFilter, resolve_param_filter
from .denoiser import DEFAULT_ROLES, MIN_CHUNK_BYTES, RMTDenoiser, matrix_view
from .settings import (
    NORM_CORRECTIONS,
    PAPER_SETTING,
    PAPER_SETTINGS,
    Method,
    NormCorrection,
    RMTSettings,
    Screen,
    resolve_dtype,
    resolve_norm_correction,
    resolve_residual,
)
from .spectral import Gate, bulk_edge, gate_threshold, shrink_singular_values
from .stages import EIGH_MAX, DenoiseResult, rmt_denoise
from .tracy_widom import tracy_widom_quantile

__all__ = [
    "DEFAULT_ROLES",
    "EIGH_MAX",
    "MIN_CHUNK_BYTES",
    "NORM_CORRECTIONS",
    "PAPER_SETTING",
    "PAPER_SETTINGS",
    "DenoiseResult",
    "Gate",
    "Method",
    "NormCorrection",
    "ParamFilter",
    "RMTDenoiser",
    "RMTSettings",
    "Screen",
    "bulk_edge",
    "gate_threshold",
    "matrix_view",
    "resolve_dtype",
    "resolve_norm_correction",
    "resolve_param_filter",
    "resolve_residual",
    "rmt_denoise",
    "shrink_singular_values",
    "tracy_widom_quantile",
]
