"""The alternation controller of a LALoRA model trained by opacus-spectral's ``DPTrainer``: the
``opacus_spectral_alternation_controller`` hook (``opacus_spectral.hookspecs``), which ``DPTrainer.train()`` calls
when ``DPTrainingArguments.alternation`` is true."""

from __future__ import annotations

from typing import Any

from opacus_spectral import hookimpl

from ..alternation.controller import AlternationController, LALoraTrainerCallback
from ..alternation.factors import active_adapter_names
from ..tuners.lalora.config import LALoraConfig


@hookimpl
def opacus_spectral_alternation_controller(trainer: Any) -> AlternationController | None:
    """An :class:`AlternationController` on ``trainer`` with the active LALoRA adapter's schedule, or ``None`` when
    the model carries no LALoRA adapter or a live controller is attached already (a removed one does not count)."""
    if any(
        isinstance(cb, LALoraTrainerCallback) and cb.controller is not None for cb in trainer.callback_handler.callbacks
    ):
        return None
    model = trainer.model
    configs = getattr(model, "peft_config", None)
    if not (isinstance(configs, dict) and any(isinstance(c, LALoraConfig) for c in configs.values())):
        return None
    names = active_adapter_names(model) or list(configs)
    schedules = {configs[n].schedule for n in names if isinstance(configs.get(n), LALoraConfig)}
    if len(schedules) == 1:
        return AlternationController(model, trainer, schedule=schedules.pop())
    return AlternationController(model, trainer)  # none active, or several that disagree: the controller says which
