"""The alternation schedule: which LoRA factor trains on which optimizer step (``docs/math.md`` §3.2).

Schedules (``k`` = local step within the round, counted from 0; ``t`` = the *schedule round*, counted from 0, which
is Flower's 1-based ``server_round`` minus 1; ``F`` = first factor, ``F'`` the other one):

==============  ====================================  ====================================
mode            trainable factor(s)                   method
==============  ====================================  ====================================
``"step"``      ``F`` if ``k`` even else ``F'``        LA-LoRA (arXiv 2602.19926, Alg. 1)
``"round"``     ``F`` if ``t`` even else ``F'``        RoLoRA
``"freeze_a"``  ``B``                                  FFA-LoRA
``"none"``      ``A`` and ``B``                        DP-LoRA
==============  ====================================  ====================================

:class:`AlternationSchedule` is the validated pair (mode, first factor): ``LALoraConfig.schedule`` gives it, and
every driver (a training loop, the federated client, the Trainer) hands it to the
:class:`~peft_lalora.AlternationController`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AlternationMode = Literal["step", "round", "freeze_a", "none"]
Factor = Literal["B", "A"]
Phase = Literal["A", "B", "AB"]

#: alternation modes, and the method of the paper each one reproduces
ALTERNATION_MODES: dict[AlternationMode, str] = {
    "step": "LA-LoRA: B and A alternate every optimizer step (the counter restarts each round)",
    "round": "RoLoRA: one factor per federated round, the other one in the next round",
    "freeze_a": "FFA-LoRA: A stays at its initialisation, B trains every step",
    "none": "DP-LoRA: both factors train every step (plain LoRA)",
}
FACTORS: tuple[Factor, Factor] = ("B", "A")


def validate_schedule(alternation: object, first_factor: object) -> None:
    """Raise ``ValueError`` with the allowed values for an unknown mode/factor or a contradictory pair."""
    if not isinstance(alternation, str) or alternation not in ALTERNATION_MODES:
        allowed = ", ".join(f"{k!r} ({v.split(':')[0]})" for k, v in ALTERNATION_MODES.items())
        raise ValueError(f"Unknown alternation mode {alternation!r}; expected one of {allowed}.")
    if not isinstance(first_factor, str) or first_factor not in FACTORS:
        raise ValueError(f"first_factor must be 'B' (paper) or 'A' (reference code), got {first_factor!r}.")
    if alternation == "freeze_a" and first_factor == "A":
        raise ValueError(
            "alternation='freeze_a' (FFA-LoRA) never trains A, so first_factor='A' contradicts it; "
            "use first_factor='B'."
        )


def phase_at(mode: AlternationMode, first_factor: Factor, step: int, round_index: int) -> Phase:
    """Trainable factor(s) at local step ``step`` of schedule round ``round_index`` (0-based: ``server_round - 1``);
    a pure function of the schedule (module table)."""
    if mode == "step":
        index = step % 2
    elif mode == "round":
        index = round_index % 2
    elif mode == "freeze_a":
        return "B"
    elif mode == "none":
        return "AB"
    else:
        validate_schedule(mode, first_factor)
        raise AssertionError("unreachable")
    other = "A" if first_factor == "B" else "B"
    return first_factor if index == 0 else other  # type: ignore[return-value]


@dataclass(frozen=True)
class AlternationSchedule:
    """A validated alternation schedule (module table); ``ValueError`` for an unknown or contradictory pair.

    Args:
        mode: ``"step"`` (LA-LoRA, default), ``"round"`` (RoLoRA), ``"freeze_a"`` (FFA-LoRA) or ``"none"``.
        first_factor: the factor trained first in ``"step"`` and ``"round"`` mode (``"B"``, the paper, or ``"A"``).
    """

    mode: AlternationMode = "step"
    first_factor: Factor = "B"

    def __post_init__(self) -> None:
        validate_schedule(self.mode, self.first_factor)

    @property
    def freezes(self) -> bool:
        """Whether the schedule ever freezes a factor (every mode but ``"none"``)."""
        return self.mode != "none"

    @property
    def trained(self) -> str:
        """The factors the schedule trains at some step: ``"B"`` for ``"freeze_a"``, else ``"AB"``."""
        return "B" if self.mode == "freeze_a" else "AB"

    def phase(self, step: int, round_index: int) -> Phase:
        """Trainable factor(s) at local step ``step`` of schedule round ``round_index`` (``server_round - 1``)."""
        return phase_at(self.mode, self.first_factor, step, round_index)
