"""The denoisers: the contract (``base``), ``lowpass``, ``ema``, the RMT denoiser and its theory
(``rmt/``), read-only observers, advice on combinations."""

from ..step.selection import Selector
from .base import Denoiser, DenoiserProtocol, GradientEstimator
from .ema import EMADenoiser
from .lowpass import LowPassDenoiser
from .observer import observer
from .rmt import RMTDenoiser

__all__ = [
    "Denoiser",
    "DenoiserProtocol",
    "EMADenoiser",
    "GradientEstimator",
    "LowPassDenoiser",
    "RMTDenoiser",
    "Selector",
    "observer",
]
