"""peft-lalora's opacus-spectral plugin, loaded through the entry point ``[project.entry-points.opacus_spectral]
peft_lalora = "peft_lalora.dp.plugin"`` (never imported by ``import peft_lalora``): the LoRA roles denoisers read
(:mod:`~peft_lalora.dp.roles`) and the alternation controller of a ``DPTrainer`` (:mod:`~peft_lalora.dp.trainer`)."""

from .roles import opacus_spectral_parameter_roles
from .trainer import opacus_spectral_alternation_controller

__all__ = ["opacus_spectral_alternation_controller", "opacus_spectral_parameter_roles"]
