"""opacus-spectral: post-noise gradient denoisers for Opacus.

``PrivacyEngine().make_private(..., post_hooks=["rmt"])`` runs the listed denoisers (a pipeline) on the noisy
DP-SGD gradient every logical step. Post-processing of the privatized gradient costs no privacy budget; the
accountant is untouched. Mathematics: ``docs/math.md``; Opacus facts relied on: ``docs/upstream.md``.
The Hugging Face Trainer with DP-SGD is ``opacus_spectral.hf.DPTrainer`` (the ``[hf]`` extra, ``docs/trainer.md``).
"""

from .advice import DenoiserAdviceWarning
from .calibration import noise_std
from .denoiser import Denoiser, DenoiserProtocol, GradientEstimator
from .doctor import Doctor, DoctorError, DoctorWarning
from .ema import EMADenoiser
from .engine import PrivacyEngine
from .grad_sample import set_trainable
from .hookspecs import hookimpl
from .installation import PostHookHandle, install_post_hooks
from .losses import causal_lm_loss
from .lowpass import LowPassDenoiser
from .noise_multiplier import epsilon_from_history, noise_multiplier_for
from .noise_source import ReproducibleNoiseWarning
from .observer import observer
from .pipeline import (
    DenoiserError,
    NonFiniteGradientError,
    PipelineDiagnostics,
    PostNoisePipeline,
    StepDiagnostics,
)
from .privacy_record import (
    ComposedPrivacyWarning,
    PrivacyRecord,
    PrivacyRun,
    load_privacy_record,
    privacy_record_of,
    read_privacy_record,
    save_privacy_record,
)
from .records import NoisyGradient, ParameterRole
from .registry import (
    DenoiserInfo,
    DenoiserSpec,
    LoadError,
    available_denoisers,
    get_registry,
    load_errors,
    reload_registry,
)
from .rmt import RMTDenoiser
from .selection import Selector

__all__ = [
    "ComposedPrivacyWarning",
    "Denoiser",
    "DenoiserAdviceWarning",
    "DenoiserError",
    "DenoiserInfo",
    "DenoiserProtocol",
    "Doctor",
    "DoctorError",
    "DoctorWarning",
    "EMADenoiser",
    "DenoiserSpec",
    "GradientEstimator",
    "LoadError",
    "LowPassDenoiser",
    "NoisyGradient",
    "NonFiniteGradientError",
    "ParameterRole",
    "PipelineDiagnostics",
    "PostHookHandle",
    "PostNoisePipeline",
    "PrivacyEngine",
    "PrivacyRecord",
    "PrivacyRun",
    "RMTDenoiser",
    "ReproducibleNoiseWarning",
    "Selector",
    "StepDiagnostics",
    "available_denoisers",
    "causal_lm_loss",
    "epsilon_from_history",
    "get_registry",
    "hookimpl",
    "install_post_hooks",
    "load_errors",
    "load_privacy_record",
    "noise_multiplier_for",
    "noise_std",
    "observer",
    "privacy_record_of",
    "read_privacy_record",
    "reload_registry",
    "save_privacy_record",
    "set_trainable",
]
__version__ = "0.1.0"
