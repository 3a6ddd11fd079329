"""Hugging Face Trainer integration (the ``[hf]`` extra): :class:`DPTrainer` and its parts."""

from .dp_trainer import DPTrainer

__all__ = ["DPTrainer"]
