"""The DP-step machinery: the attachment to Opacus' DPOptimizer (events of one step), the post-noise
pipeline and its installation, the records denoisers receive, the noise std and its source."""

from .grad_sample import set_trainable
from .installation import PostHookHandle, install_post_hooks
from .noise_std import noise_std
from .pipeline import PipelineDiagnostics, PostNoisePipeline, StepDiagnostics
from .records import NoisyGradient, ParameterRole
from .selection import Selector

__all__ = [
    "NoisyGradient",
    "ParameterRole",
    "PipelineDiagnostics",
    "PostHookHandle",
    "PostNoisePipeline",
    "Selector",
    "StepDiagnostics",
    "install_post_hooks",
    "noise_std",
    "set_trainable",
]
