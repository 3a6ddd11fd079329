"""Gavish–Donoho optimal hard singular-value thresholding (SVHT) for opacus-spectral."""

from .svht import SVHTDenoiser, svht, threshold_coefficient

__all__ = ["SVHTDenoiser", "svht", "threshold_coefficient"]
