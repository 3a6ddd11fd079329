"""peft-lalora: LA-LoRA (LoRA with step-wise alternating factor updates) as a PEFT tuner.

Importing this package registers the PEFT type ``"LALORA"`` (idempotent), so ``get_peft_model``,
``PeftModel.from_pretrained``, ``AutoPeftModel*``, ``save_pretrained`` and ``merge_and_unload`` work with
:class:`LALoraConfig`. DP parts (``opacus_spectral``) are imported lazily, behind the ``[dp]`` extra.
"""

from .alternation.controller import AlternationController, LALoraTrainerCallback, phase_at
from .alternation.factors import LoraFactor, find_lora_factors, lalora_param_groups
from .alternation.schedule import AlternationSchedule
from .tuners.lalora.config import ALTERNATION_MODES, LALoraConfig, LALoraPeftType
from .tuners.lalora.export import export_as_lora, to_lora_config
from .tuners.lalora.model import LALoraModel
from .tuners.lalora.registration import is_registered, register

register()

__version__ = "0.1.0"

__all__ = [
    "ALTERNATION_MODES",
    "AlternationController",
    "AlternationSchedule",
    "LALoraConfig",
    "LALoraModel",
    "LALoraPeftType",
    "LALoraTrainerCallback",
    "LoraFactor",
    "export_as_lora",
    "find_lora_factors",
    "is_registered",
    "lalora_param_groups",
    "phase_at",
    "register",
    "to_lora_config",
]
