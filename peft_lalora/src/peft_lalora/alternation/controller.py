"""The alternation controller: applies an :class:`~peft_lalora.alternation.schedule.AlternationSchedule` to the LoRA
factors, optimizer step by optimizer step (``docs/math.md`` §3.2; the schedules are tabled in
:mod:`~peft_lalora.alternation.schedule`).

The controller counts *real* optimizer steps: ``register_step_post_hook`` of a torch optimizer; for an Opacus
``DPOptimizer``, its ``AFTER_STEP`` event (``opacus_spectral.step.attachment``: the post-hook of
``dp_optimizer.original_optimizer``, which BatchMemoryManager's virtual steps never reach; ``docs/upstream.md``
§1.3); or ``on_optimizer_step`` of an HF ``Trainer``. After each counted step it applies the next phase with
:func:`~peft_lalora.alternation.factors.apply_phase`: the frozen factor gets ``requires_grad=False`` and ``grad=None``
(so AdamW moments and weight decay leave it untouched); under Opacus ``opacus_spectral.set_trainable`` also drops its
per-sample state (``docs/upstream.md`` §1.4): for a ``DPOptimizer``, and for a Trainer that offers its own
``set_trainable`` (``opacus_spectral``'s ``DPTrainer``, which attaches a controller itself through the
``opacus_spectral_alternation_controller`` hook: ``peft_lalora.dp.trainer``).

Rounds: :meth:`AlternationController.start_round` takes Flower's 1-based ``server_round``; the schedule round
``t`` of the table (:attr:`AlternationController.round`, and the state's ``"round"``) is ``server_round - 1``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .factors import LoraFactor, SetTrainable, apply_phase, find_lora_factors, set_requires_grad
from .schedule import ALTERNATION_MODES, AlternationMode, AlternationSchedule, Factor, Phase, phase_at

__all__ = ["AlternationController", "LALoraTrainerCallback", "Phase", "phase_at"]

_STATE_KEYS = ("mode", "first_factor", "step", "round", "round_started", "total_steps")

#: the controller attached to each optimizer (the inner one of a DPOptimizer) or Trainer: one at most
_ATTACHED: weakref.WeakKeyDictionary[Any, AlternationController] = weakref.WeakKeyDictionary()


def _is_dp_optimizer(optimizer: object) -> bool:
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:  # opacus not installed: cannot be a DPOptimizer
        return False
    return isinstance(optimizer, DPOptimizer)


def _is_trainer(obj: object) -> bool:
    return hasattr(obj, "add_callback") and hasattr(obj, "create_optimizer") and hasattr(obj, "callback_handler")


def _dp_set_trainable() -> SetTrainable:
    try:
        from opacus_spectral import set_trainable
    except ImportError as exc:
        raise ImportError(
            "AlternationController on an Opacus DPOptimizer needs opacus-spectral (alternation-safe per-sample "
            "state handling). Install it from a clone: pip install -c constraints.txt './peft_lalora[dp]' "
            "./opacus_spectral (README, Install)."
        ) from exc
    return set_trainable


class AlternationController:
    """Applies the alternation schedule of a LALoRA adapter to the LoRA factors, step by step.

    Create it *after* the optimizer (and after ``make_private`` under DP): the optimizer and Opacus must
    see both factors trainable; the controller then freezes the factor that is not in the initial phase.

    Args:
        peft_model: the PeftModel (or any module containing LoRA layers, e.g. Opacus's GradSampleModule).
        optimizer: a torch optimizer, an Opacus ``DPOptimizer``, an HF ``Trainer`` (a callback is added), or
            ``None`` (call :meth:`advance` yourself after every optimizer step).
        schedule: the :class:`~peft_lalora.alternation.schedule.AlternationSchedule` to apply, e.g.
        ``LALoraConfig.schedule``.
            Without it (and without ``mode``/``first_factor``): the active adapter's ``LALoraConfig`` schedule.
        mode: instead of ``schedule``: the alternation mode; default: the adapter's ``LALoraConfig.alternation``
            (required for a plain ``LoraConfig`` adapter).
        first_factor: instead of ``schedule``: default the adapter's ``LALoraConfig.first_factor`` (``"B"`` for a
            plain LoRA adapter).
        adapter_name: which adapter; default: the active adapter(s).

    Raises:
        ValueError: unknown mode/factor, no LoRA factors, factors missing from the optimizer, an Opacus
            per-layer clipping optimizer or a DPOptimizer of ``opacus.PrivacyEngine`` with a mode that freezes
            factors, or an optimizer (Trainer) that already has a controller (``remove()`` that one first).
        RuntimeError: at the first step, a torch optimizer that steps inside a DPOptimizer (the controller was
            created before ``make_private``) with a mode that freezes factors.
        TypeError: ``schedule`` together with ``mode``/``first_factor``, or not an ``AlternationSchedule``.
        ImportError: a DPOptimizer without opacus-spectral installed.
    """

    def __init__(
        self,
        peft_model: nn.Module,
        optimizer: Any = None,
        *,
        schedule: AlternationSchedule | None = None,
        mode: AlternationMode | None = None,
        first_factor: Factor | None = None,
        adapter_name: str | Sequence[str] | None = None,
    ) -> None:
        if schedule is None:
            schedule = self._resolve_schedule(peft_model, mode, first_factor, adapter_name)
        elif mode is not None or first_factor is not None:
            raise TypeError("pass schedule= or mode=/first_factor=, not both")
        elif not isinstance(schedule, AlternationSchedule):
            raise TypeError(f"schedule must be a peft_lalora.AlternationSchedule, got {type(schedule).__name__}")
        self.schedule: AlternationSchedule = schedule
        self.factors: list[LoraFactor] = find_lora_factors(peft_model, adapter_name)
        if not self.factors:
            raise ValueError("No LoRA factors found: the model has no peft.tuners.lora.LoraLayer for this adapter.")
        self.step = 0  #: optimizer steps taken in the current round
        self.round = 0  #: current schedule round, 0-based (``server_round - 1``)
        self.round_started = False  #: whether start_round() was called at least once
        self.total_steps = 0  #: optimizer steps counted since construction (across rounds)
        self._handle: Any = None
        self._guard: Any = None  #: a torch optimizer's step pre-hook refusing a step inside a DPOptimizer
        self._callback: LALoraTrainerCallback | None = None
        self._owner: weakref.ref[Any] | None = None  #: the optimizer / Trainer this controller is attached to
        self._set_trainable: SetTrainable = set_requires_grad
        self._attach(optimizer, peft_model)

    @property
    def mode(self) -> AlternationMode:
        return self.schedule.mode

    @property
    def first_factor(self) -> Factor:
        return self.schedule.first_factor

    # ----------------------------------------------------------------------------------------- setup
    @staticmethod
    def _resolve_schedule(
        model: nn.Module,
        mode: AlternationMode | None,
        first_factor: Factor | None,
        adapter_name: str | Sequence[str] | None,
    ) -> AlternationSchedule:
        """The fallback without ``schedule=``: ``mode``/``first_factor``, completed from the active adapters'
        ``LALoraConfig`` found in ``model.modules()``."""
        from ..tuners.lalora.config import LALoraConfig

        configs: list[Any] = []
        for m in model.modules():
            peft_config = getattr(m, "peft_config", None)
            if isinstance(peft_config, dict) and peft_config:
                names = [adapter_name] if isinstance(adapter_name, str) else adapter_name
                if names is None:
                    active = getattr(m, "active_adapters", None) or list(peft_config)
                    names = [active] if isinstance(active, str) else list(active)
                configs = [peft_config[n] for n in names if n in peft_config]
                break
        schedules = {(c.alternation, c.first_factor) for c in configs if isinstance(c, LALoraConfig)}
        if len(schedules) > 1 and (mode is None or first_factor is None):
            raise ValueError(f"Active adapters disagree on the schedule {sorted(schedules)}; pass mode/first_factor.")
        if schedules:
            cfg_mode, cfg_first = schedules.pop()
            return AlternationSchedule(mode or cfg_mode, first_factor or cfg_first)
        if mode is None:
            raise ValueError(
                "The adapter is not a LALoraConfig adapter; pass mode= one of "
                + ", ".join(map(repr, ALTERNATION_MODES))
            )
        return AlternationSchedule(mode, first_factor or "B")

    def _attach(self, optimizer: Any, model: nn.Module) -> None:
        if optimizer is None:
            self._apply_phase()
            return
        if _is_trainer(optimizer):
            # The Trainer builds its optimizer in train(), from the params trainable *then*: keep both factors
            # trainable now and apply the phase at on_train_begin. A Trainer that keeps per-sample state
            # (opacus_spectral's DPTrainer) says how to freeze: its set_trainable.
            trainer_freeze = getattr(optimizer, "set_trainable", None)
            if callable(trainer_freeze):
                self._set_trainable = trainer_freeze
            self._claim(optimizer, "Trainer")
            self._callback = LALoraTrainerCallback(self)
            optimizer.add_callback(self._callback)
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch optimizer, an Opacus DPOptimizer, an HF Trainer or None, "
                f"got {type(optimizer)!r}."
            )
        self.check_optimizer(optimizer)
        if _is_dp_optimizer(optimizer):
            self._attach_dp(optimizer, model)
        else:
            self._claim(optimizer, "optimizer")
            self._handle = optimizer.register_step_post_hook(self._on_optimizer_step)
            if self.schedule.freezes:
                self._guard = optimizer.register_step_pre_hook(self._refuse_dp_step)
        self._apply_phase()

    def _attach_dp(self, dp_optimizer: Any, model: nn.Module) -> None:
        """Subscribe to the DPOptimizer's ``AFTER_STEP`` event (``opacus_spectral.step.attachment``)."""
        self._set_trainable = _dp_set_trainable()
        from opacus_spectral.step.attachment import AFTER_STEP, CONTROLLER, attachment, refuse_toggling
        from opacus_spectral.step.grad_sample import refuse_upstream_toggling

        if self.schedule.freezes:
            refuse_toggling(dp_optimizer, f"alternation={self.mode!r}", "alternation='none'")
            refuse_upstream_toggling(model, f"alternation={self.mode!r}", "alternation='none'")
        inner = dp_optimizer.original_optimizer  # virtual (BatchMemoryManager) steps never call its step()
        self._check_trainable_at_wrap_time(inner)
        self._claim(inner, "optimizer")
        self._handle = attachment(dp_optimizer).subscribe(AFTER_STEP, self._on_dp_step, order=CONTROLLER)

    def _claim(self, owner: Any, what: str) -> None:
        """Register as ``owner``'s controller; refuse a second one (both would count steps, and whichever
        applied its phase last would silently decide which factor trains)."""
        other = _ATTACHED.get(owner)
        if other is not None:
            raise ValueError(
                f"this {what} already has an AlternationController ({other!r}); two would both count its steps and "
                "the last one would silently decide the phase: call .remove() on the first one before creating another"
            )
        _ATTACHED[owner] = self
        self._owner = weakref.ref(owner)

    def _check_trainable_at_wrap_time(self, inner: torch.optim.Optimizer) -> None:
        """Under DP, every factor the schedule will train must still be trainable now: Opacus only hooks
        parameters trainable at ``make_private`` time, so a factor frozen before it can never get a
        per-sample gradient later."""
        frozen = [f.name for f in self.factors if f.factor in self.schedule.trained and not f.param.requires_grad]
        if frozen:
            other = _ATTACHED.get(inner)
            hint = f" (the optimizer already has {other!r}: call .remove() on it first)" if other is not None else ""
            raise ValueError(
                f"{len(frozen)} LoRA factor(s) the {self.mode!r} schedule trains are frozen (e.g. {frozen[0]!r}). Both "
                "factors must be trainable when make_private is called; create the AlternationController after "
                "make_private and do not freeze factors yourself." + hint
            )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ``ValueError`` if a LoRA factor is not in ``optimizer`` (it would never train)."""
        in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [f.name for f in self.factors if id(f.param) not in in_opt]
        if missing:
            raise ValueError(
                f"{len(missing)} LoRA factor(s) are not in the optimizer (e.g. {missing[0]!r}); build the optimizer "
                "while both factors are trainable (before creating the controller), e.g. with "
                "peft_lalora.lalora_param_groups(model, lr)."
            )

    # ----------------------------------------------------------------------------------------- schedule
    @property
    def phase(self) -> Phase:
        """Factor(s) trained by the next optimizer step: ``"A"``, ``"B"`` or ``"AB"``."""
        return self.schedule.phase(self.step, self.round)

    @property
    def server_round(self) -> int:
        """The current round in Flower's 1-based numbering (``round + 1``)."""
        return self.round + 1

    def start_round(self, *, server_round: int | None = None) -> None:
        """Begin a federated round: reset the local step counter and apply the round's first phase.

        Args:
            server_round: Flower's 1-based round number (the ``server_round`` of ``Client.fit``; pass it when the
                controller is rebuilt every round, as in Flower clients); schedule round ``server_round - 1``.
                Default: the previous round + 1 — except for a first call before any step, which starts server
                round 1 (so calling it at the top of every round, or only between rounds, gives the same schedule).
        """
        if server_round is None:
            server_round = self.server_round + 1 if (self.round_started or self.step > 0) else 1
        if isinstance(server_round, bool) or int(server_round) != server_round or server_round < 1:
            raise ValueError(f"server_round is Flower's 1-based round number (>= 1), got {server_round!r}.")
        self.round = int(server_round) - 1
        self.round_started = True
        self.step = 0
        self._apply_phase()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` optimizer steps and apply the resulting phase (called by the hooks)."""
        self.step += n
        self.total_steps += n
        self._apply_phase()

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.advance(1)

    def _refuse_dp_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before a step of the torch optimizer it was given: refuse one that Opacus took (a factor holds its clipped
        sum), i.e. the optimizer was made private after this controller froze a factor, or is a DPOptimizer's inner."""
        if any(getattr(f.param, "summed_grad", None) is not None for f in self.factors):
            raise RuntimeError(
                "AlternationController was created before make_private, on the torch optimizer (or given the "
                "optimizer inside a DPOptimizer): Opacus hooked only the LoRA factors trainable at make_private, so "
                "the factor this schedule trains next would get no per-sample gradient. Fix: call .remove() on this "
                "controller (both factors trainable again), call make_private, then create the controller with the "
                "DPOptimizer it returned: AlternationController(model, dp_optimizer)."
            )

    def _on_dp_step(self, step: Any) -> None:
        self.advance(1)  # every inner step, as a torch post-hook counts them

    def _apply_phase(self) -> None:
        apply_phase(self.factors, self.phase, self._set_trainable)

    def remove(self, *, unfreeze: bool = True) -> None:
        """Detach from the optimizer (a new controller may then be attached to it); with ``unfreeze`` make both
        factors trainable again."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and _ATTACHED.get(owner) is self:
            del _ATTACHED[owner]
        self._owner = None
        for handle in (self._handle, self._guard):
            if handle is not None:
                handle.remove()
        self._handle = self._guard = None
        if self._callback is not None:
            self._callback.controller = None
            self._callback = None
        if unfreeze:
            apply_phase(self.factors, "AB", self._set_trainable)

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (plain Python values): mode, first_factor, step, round, round_started,
        total_steps, and the derived phase."""
        return {
            "mode": self.mode,
            "first_factor": self.first_factor,
            "step": self.step,
            "round": self.round,
            "round_started": self.round_started,
            "total_steps": self.total_steps,
            "phase": self.phase,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and apply its phase.

        Raises:
            ValueError: missing keys, or a checkpoint of another schedule (mode / first_factor).
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"AlternationController state is missing {missing}.")
        if (state["mode"], state["first_factor"]) != (self.mode, self.first_factor):
            raise ValueError(
                f"Checkpoint schedule (mode={state['mode']!r}, first_factor={state['first_factor']!r}) differs "
                f"from this controller's (mode={self.mode!r}, first_factor={self.first_factor!r})."
            )
        self.step = int(state["step"])
        self.round = int(state["round"])
        self.round_started = bool(state["round_started"])
        self.total_steps = int(state["total_steps"])
        if "phase" in state and state["phase"] != self.phase:
            raise ValueError(f"Inconsistent checkpoint: phase {state['phase']!r} but the counters give {self.phase!r}.")
        self._apply_phase()

    def __repr__(self) -> str:
        return (
            f"AlternationController(mode={self.mode!r}, first_factor={self.first_factor!r}, round={self.round}, "
            f"step={self.step}, phase={self.phase!r}, factors={len(self.factors)})"
        )


class LALoraTrainerCallback(TrainerCallback):
    """HF ``Trainer`` callback driving an :class:`AlternationController` (added by passing the Trainer as
    the controller's ``optimizer``). Counts ``on_optimizer_step`` events (one per real, post-accumulation
    step). On resume from a checkpoint at ``global_step > 0`` with a fresh controller, it fast-forwards the
    controller by ``global_step`` steps (single round); restore ``controller.state_dict()`` yourself for
    multi-round runs."""

    def __init__(self, controller: AlternationController) -> None:
        self.controller: AlternationController | None = controller

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        c = self.controller
        if c is None:
            return
        optimizer = kwargs.get("optimizer")
        if isinstance(optimizer, torch.optim.Optimizer):
            c.check_optimizer(optimizer)
        if c.total_steps == 0 and getattr(state, "global_step", 0) > 0:
            c.step = c.total_steps = int(state.global_step)
        c._apply_phase()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.controller is not None:
            self.controller.advance(1)
