"""opacus-spectral: post-noise gradient denoisers for Opacus.

``PrivacyEngine().make_private(..., post_hooks=["rmt"])`` denoises the noisy DP-SGD gradient every step.
Post-processing of the privatized gradient costs no privacy budget; the accountant is untouched.
"""

from .calibration import noise_std
from .denoiser import Denoiser, DenoiserProtocol
from .engine import PrivacyEngine
from .grad_sample import set_trainable
from .hookspecs import hookimpl
from .installation import PostHookHandle, install_post_hooks
from .lowpass import LowPassDenoiser
from .pipeline import (
    DenoiserError,
    NonFiniteGradientError,
    PipelineDiagnostics,
    PostNoisePipeline,
    StepDiagnostics,
)
from .records import NoisyGradient, ParameterRole
from .rmt import RMTDenoiser
from .registry import DenoiserInfo, LoadError, available_denoisers, get_registry, load_errors, reload_registry

__all__ = [
    "Denoiser",
    "DenoiserError",
    "DenoiserInfo",
    "DenoiserProtocol",
    "LoadError",
    "LowPassDenoiser",
    "NoisyGradient",
    "NonFiniteGradientError",
    "ParameterRole",
    "PipelineDiagnostics",
    "PostHookHandle",
    "PostNoisePipeline",
    "PrivacyEngine",
    "RMTDenoiser",
    "StepDiagnostics",
    "available_denoisers",
    "get_registry",
    "hookimpl",
    "install_post_hooks",
    "load_errors",
    "noise_std",
    "reload_registry",
    "set_trainable",
]
__version__ = "0.1.0"
