"""opacus-spectral: differential privacy for Opacus users — post-noise denoisers, privacy invariants checked on your
own set-up, and an ε that is an upper bound.

``PrivacyEngine().make_private(..., post_hooks=["rmt"])`` runs the listed denoisers on the noisy DP-SGD gradient every
logical step (post-processing: no privacy cost). The top level holds what a user needs first; the rest lives in its
subpackage: :mod:`~opacus_spectral.denoisers` (``RMTDenoiser``, ``LowPassDenoiser``, ``EMADenoiser``, ``Selector``),
:mod:`~opacus_spectral.step` (the pipeline and its records), :mod:`~opacus_spectral.accounting` (calibration, ε, the
privacy record), :mod:`~opacus_spectral.plugins` (the registry), :mod:`~opacus_spectral.doctor`,
:mod:`~opacus_spectral.audit`, :mod:`~opacus_spectral.errors` (every exception and warning) and
:mod:`~opacus_spectral.hf` (``DPTrainer``, the ``[hf]`` extra). Guides: ``docs/``.
"""

from .accounting import epsilon_from_history, load_privacy_record, noise_multiplier_for, save_privacy_record
from .denoisers import Denoiser, observer
from .engine import PrivacyEngine
from .hookspecs import hookimpl
from .losses import causal_lm_loss
from .plugins import available_denoisers
from .step import NoisyGradient, ParameterRole, install_post_hooks, noise_std, set_trainable

__all__ = [
    "Denoiser",
    "NoisyGradient",
    "ParameterRole",
    "PrivacyEngine",
    "available_denoisers",
    "causal_lm_loss",
    "epsilon_from_history",
    "hookimpl",
    "install_post_hooks",
    "load_privacy_record",
    "noise_multiplier_for",
    "noise_std",
    "observer",
    "save_privacy_record",
    "set_trainable",
]
__version__ = "0.2.0"
