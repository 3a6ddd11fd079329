"""DiSK (simplified Kalman filter for DP optimizers) for opacus-spectral: the ``disk`` denoiser and its two-point
gradient."""

from .disk import DiskDenoiser
from .gradient import DiskGradient

__all__ = ["DiskDenoiser", "DiskGradient"]
