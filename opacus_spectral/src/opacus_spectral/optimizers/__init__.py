"""Optimizers that know they are trained with DP noise: :class:`DPAdamBC` (``docs/engine.md``, "DP-AdamBC")."""

from .adam_bc import DPAdamBC

__all__ = ["DPAdamBC"]
