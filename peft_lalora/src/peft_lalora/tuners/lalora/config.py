"""``LALoraConfig``: a ``LoraConfig`` plus the alternation schedule of LA-LoRA and its baselines.

LA-LoRA ("Rethinking LoRA for Privacy-Preserving Federated Learning in Large Models", arXiv 2602.19926)
updates the LoRA factors of ``ΔW = s·B·A`` alternately: one optimizer step trains B with A frozen, the next
trains A with B frozen, and so on. Each step then perturbs only one factor, which removes the second-order
noise term ``s·N_B·N_A`` of DP-LoRA from ``ΔW`` (``docs/math.md`` §3.1). The baselines of the paper are the
other modes (§3.2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from peft import LoraConfig

from ...alternation.schedule import (
    ALTERNATION_MODES,
    FACTORS,
    AlternationMode,
    AlternationSchedule,
    Factor,
    validate_schedule,
)

__all__ = [
    "ALTERNATION_MODES",
    "FACTORS",
    "AlternationMode",
    "AlternationSchedule",
    "Factor",
    "LALoraConfig",
    "LALoraPeftType",
    "validate_schedule",
]


class LALoraPeftType(str, enum.Enum):
    """PEFT type of this tuner. A ``(str, Enum)``: PEFT looks it up as the plain string ``"LALORA"`` and
    transformers reads ``peft_config.peft_type.value`` (``docs/upstream.md`` §2.2)."""

    LALORA = "LALORA"


@dataclass
class LALoraConfig(LoraConfig):
    """LoRA configuration with an alternation schedule for the factors A and B.

    Everything of :class:`peft.LoraConfig` applies (``r``, ``lora_alpha``, ``target_modules``,
    ``modules_to_save``, ``fan_in_fan_out``, ...). The two new fields only decide *which factor trains on
    which optimizer step*; they are applied by :class:`peft_lalora.AlternationController`, and the forward
    pass is exactly LoRA's ``h = W x + s·B A x``.

    Args:
        alternation: ``"step"`` (LA-LoRA, default), ``"round"`` (RoLoRA), ``"freeze_a"`` (FFA-LoRA) or
            ``"none"`` (DP-LoRA: both factors every step).
        first_factor: the factor trained first in ``"step"`` and ``"round"`` mode. ``"B"`` (the paper; with
            PEFT's default init B = 0, so an A-first step only sees a zero gradient plus DP noise) or
            ``"A"`` (the public reference code). ``"A"`` is refused with ``"freeze_a"``; it has no effect with
            ``"none"``.

    Raises:
        ValueError: unknown ``alternation`` / ``first_factor``, ``first_factor="A"`` with ``"freeze_a"``, or
            DoRA (``use_dora=True``, whose magnitude vector is neither A nor B) with any alternating mode.
    """

    alternation: AlternationMode = field(
        default="step",
        metadata={
            "help": "Which LoRA factor trains when: " + "; ".join(f"'{k}' = {v}" for k, v in ALTERNATION_MODES.items())
        },
    )
    first_factor: Factor = field(
        default="B",
        metadata={"help": "Factor trained first in 'step'/'round' mode: 'B' (paper) or 'A' (reference code)."},
    )
    privacy_record: Any = field(
        default=None,
        metadata={
            "help": "The DP privacy record of the adapter's training (opacus_spectral; written by save_pretrained, "
            "read back by from_pretrained, composed with by the next DP run). Set by the library, not by hand."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # LoraConfig.__post_init__ sets PeftType.LORA; PEFT's mappings resolve our own type.
        self.peft_type = LALoraPeftType.LALORA
        validate_schedule(self.alternation, self.first_factor)
        if self.use_dora and self.alternation != "none":
            raise ValueError(
                f"LALoraConfig(alternation={self.alternation!r}) does not support use_dora=True: DoRA's magnitude "
                "vector belongs to neither factor of the schedule. Use alternation='none' or use_dora=False."
            )

    @property
    def schedule(self) -> AlternationSchedule:
        """The adapter's alternation schedule, as :class:`~peft_lalora.AlternationController` takes it."""
        return AlternationSchedule(self.alternation, self.first_factor)
