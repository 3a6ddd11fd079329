"""Hugging Face Trainer integration (the ``[hf]`` extra): :class:`DPTrainer` and its settings,
:class:`DPTrainingArguments` (the ``<x>_trainer.py`` + ``<x>_config.py`` pattern of TRL)."""

from .dp_config import DPTrainingArguments
from .dp_trainer import DPTrainer

__all__ = ["DPTrainer", "DPTrainingArguments"]
