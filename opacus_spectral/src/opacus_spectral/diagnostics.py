"""Deprecated alias of :mod:`opacus_spectral.spectrum_report` (spectral entropy, cosine report, spectrum plot).

"Diagnostics" are the pipeline's per-step records (:class:`~opacus_spectral.StepDiagnostics`); import these
functions from ``opacus_spectral.spectrum_report``.
"""

from __future__ import annotations

import warnings

from .spectrum_report import cosine_report, plot_spectrum, spectral_entropy

__all__ = ["cosine_report", "plot_spectrum", "spectral_entropy"]

warnings.warn(
    "opacus_spectral.diagnostics is deprecated: import cosine_report, plot_spectrum and spectral_entropy from "
    "opacus_spectral.spectrum_report",
    DeprecationWarning,
    stacklevel=2,
)
