"""The doctor: cheap checks for the silent ways a DP training run goes wrong.

Opacus trains on without a word in several broken set-ups (``docs/engine.md``, "The doctor"): the model's
parameters are no longer the ones the optimizer holds (Opacus issue #820: the model moved or materialized after
``get_peft_model`` / ``make_private``), a parameter made trainable after ``make_private`` has no per-sample hooks
(Opacus #687 / #729; under ghost clipping it is then updated without being clipped), an optimizer step adds no
noise or is not counted by the accountant, or the first DP step moves nothing. Each check names the cause and
the fix; ``mode="warn"`` warns once per finding (:class:`DoctorWarning`), ``mode="raise"`` raises
:class:`DoctorError`.

When the checks run, and what they cost:

* at installation: parameters on the ``meta`` device; trainable parameters the optimizer does not hold;
* on every training-mode forward of the model (a forward pre-hook, one pass over the parameter list): the
  model's trainable parameters are the optimizer's, and every trainable parameter has Opacus' per-sample hooks;
* on every inner optimizer step (an int compare): it followed Opacus' noisy step (the attachment's
  ``InnerStep.noised``), and the accountant counted that step exactly once (read on both sides of Opacus'
  ``step_hook``);
* on every DP step, when the doctor watches the DP data loader (:meth:`Doctor.watch_batches`; CPU integers, no
  sync): the step trained on a batch that loader yielded, and its per-sample gradients have one row per record
  of that batch (:mod:`~opacus_spectral.doctor.batches`);
* on every DP step: no parameter moved between the first training forward after the previous DP step and this one
  (:mod:`~opacus_spectral.doctor.fingerprint`: fused norms on the device, read without waiting);
* on every DP step without a denoiser pipeline (``post_hooks=None``): the noisy gradient is finite, checked before
  the optimizer updates (one fused norm and one host sync per logical step; a pipeline checks it itself);
* on the first DP step only: every trainable parameter has per-sample state and a noisy gradient, and moved
  (one copy of the trainable parameters, freed after the step).

The doctor subscribes to the optimizer's :mod:`~opacus_spectral.step.attachment` (order
:data:`~opacus_spectral.step.attachment.DOCTOR`: before the pipeline, so it sees the noisy gradient as Opacus made it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from opacus.grad_sample import GradSampleHooksFastGradientClipping, GradSampleModuleExpandedWeights
from opacus.optimizers import DPOptimizer
from torch import nn

from ..accounting.bounds import charge_log, expected_charge
from ..denoisers.advice import external_stacklevel
from ..errors import DoctorError, DoctorWarning
from ..step.attachment import (
    AFTER_ACCOUNTANT,
    AFTER_STEP,
    BEFORE_ACCOUNTANT,
    BEFORE_INNER_STEP,
    DOCTOR,
    PHYSICAL_BATCH,
    InnerStep,
    attachment,
)
from ..step.copies import InertOnCopy
from ..step.installation import HANDLE_ATTR
from ..step.parameters import unwrap
from ..step.validation import stacked_norms
from .batches import BatchObserver, per_sample_rows
from .fingerprint import ParameterFingerprint

DoctorMode = Literal["warn", "raise"]
#: what ``make_private(doctor=...)`` accepts: ``True``/``"warn"``, ``"raise"``, or ``False``/``None`` (off)
DoctorSetting = bool | DoctorMode | None
DOCTOR_ATTR = "_opacus_spectral_doctor"
ORDER = "device -> get_peft_model -> optimizer -> make_private"


@dataclass(frozen=True)
class Finding:
    """One problem the doctor found: which check, the message (cause and fix), the parameters involved."""

    check: str
    message: str
    params: tuple[str, ...] = ()


def resolve_mode(setting: DoctorSetting) -> DoctorMode | None:
    """``True``/``"warn"`` → ``"warn"``, ``"raise"`` → ``"raise"``, ``False``/``None`` → ``None`` (off)."""
    if setting is True or setting == "warn":
        return "warn"
    if setting == "raise":
        return "raise"
    if setting is False or setting is None:
        return None
    raise ValueError(f"doctor must be True, False, None, 'warn' or 'raise', got {setting!r}")


def accounted_steps(accountant: Any) -> int:
    """Steps an Opacus accountant has counted: its history holds ``(noise_multiplier, sample_rate, steps)``
    entries, consecutive equal ones merged (``len(accountant)`` counts entries, not steps)."""
    return sum(int(entry[2]) for entry in accountant.history)


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


class Doctor:
    """Checks one private model + ``DPOptimizer`` pair (see the module docstring). ``remove()`` detaches it.

    Args:
        dp_optimizer: the optimizer ``make_private`` returned.
        module: the model ``make_private`` returned (GradSampleModule, hooks object or the model itself).
        accountant: the engine's accountant (``None``: the accounting check is off).
        mode: ``"warn"`` or ``"raise"``.
        data_loader: the data loader ``make_private`` returned, whose batches the DP steps must train on
            (``None``: the sampling and batch-dimension checks wait for :meth:`watch_batches`).
    """

    def __init__(
        self,
        dp_optimizer: DPOptimizer,
        module: Any,
        *,
        accountant: Any = None,
        mode: DoctorMode = "warn",
        data_loader: Any = None,
    ) -> None:
        self.optimizer = dp_optimizer
        self.mode: DoctorMode = mode
        self.accountant = accountant
        self.findings: list[Finding] = []
        self._reported: set[tuple[str, tuple[str, ...]]] = set()
        self._model: nn.Module = unwrap(module)
        self._ghost = isinstance(module, GradSampleHooksFastGradientClipping)
        # Opacus sets per-sample hooks and state up for the parameters trainable at make_private time
        self._covered = {id(p) for p in self._model.parameters() if p.requires_grad}
        self._names = {id(p): n for n, p in self._model.named_parameters(remove_duplicate=False)}
        self._first_step_pending = True
        self._removed = False
        self._before: tuple[int, int] | None = None  # steps counted and engine hook calls before this step_hook
        self._counted: tuple[int, int] | None = None  # steps the accountant counted in that step_hook, and expected
        self._snapshot: dict[str, tuple[nn.Parameter, torch.Tensor]] | None = None
        self.dp_steps = 0  #: DP steps (noise added) seen since installation
        self._rows: int | None = 0  # per-sample rows of the physical batches since the last DP step
        self._batches: BatchObserver | None = None
        self._fingerprint = ParameterFingerprint(self._optimizer_params())
        inner = dp_optimizer.original_optimizer
        old = getattr(inner, DOCTOR_ATTR, None)
        if old is not None:
            old.remove()
        att = attachment(dp_optimizer)
        self._handles: list[Any] = [
            att.subscribe(PHYSICAL_BATCH, self._count_rows, order=DOCTOR),
            att.subscribe(BEFORE_ACCOUNTANT, self._before_accountant, order=DOCTOR),
            att.subscribe(AFTER_ACCOUNTANT, self._after_accountant, order=DOCTOR),
            att.subscribe(BEFORE_INNER_STEP, self._pre_step, order=DOCTOR),
            att.subscribe(AFTER_STEP, self._post_step, order=DOCTOR),
            _forward_target(module, self._model).register_forward_pre_hook(InertOnCopy(self._on_forward)),
        ]
        setattr(inner, DOCTOR_ATTR, self)
        try:
            self._check_installation()
        except DoctorError:
            self.remove()
            raise
        if data_loader is not None:
            try:
                self.watch_batches(data_loader)
            except ValueError as err:  # documented fallback: the two batch checks are off, the others stay
                warnings.warn(f"opacus_spectral doctor: batch checks off: {err}", DoctorWarning, stacklevel=3)

    # -- public -------------------------------------------------------------------------------------------
    @property
    def first_step_checked(self) -> bool:
        """Whether the first-DP-step checks (per-sample state, parameters moved) have run."""
        return not self._first_step_pending

    def watch_batches(self, source: Any) -> None:
        """Pair every DP step with a batch of ``source`` from now on: the DP data loader (its batch sampler), or a
        batch sampler a training loop draws its logical batches from (e.g. one it built over the DP loader's
        sampler). Replaces the previous one. ``ValueError`` if ``source`` has no batch sampler to observe."""
        observer = BatchObserver(source)
        if self._batches is not None and self._batches.sampler is not observer.sampler:
            self._batches.detach()
        self._batches = observer

    def remove(self) -> None:
        """Detach every hook; findings stay readable."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._snapshot = None
        self._removed = True
        if self._batches is not None:
            self._batches.detach()
        inner = self.optimizer.original_optimizer
        if getattr(inner, DOCTOR_ATTR, None) is self:
            delattr(inner, DOCTOR_ATTR)

    # -- reporting ----------------------------------------------------------------------------------------
    def _report(self, check: str, message: str, params: list[str] | None = None) -> None:
        key = (check, tuple(params or ()))
        if key in self._reported:
            return
        self._reported.add(key)
        finding = Finding(check, message, key[1])
        self.findings.append(finding)
        text = f"opacus_spectral doctor [{check}]: {message}"
        if self.mode == "raise":
            raise DoctorError(text)
        warnings.warn(text, DoctorWarning, stacklevel=external_stacklevel())

    def _optimizer_params(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.original_optimizer.param_groups for p in group["params"]]

    def _name(self, p: torch.Tensor, fallback: str) -> str:
        return self._names.get(id(p), fallback)

    # -- checks -------------------------------------------------------------------------------------------
    def _check_installation(self) -> None:
        meta = [n for n, p in self._model.named_parameters() if p.device.type == "meta"]
        if meta:
            self._report(
                "meta_device",
                f"{len(meta)} parameter(s) are on the meta device (e.g. {_shown(meta)}): they will be materialized "
                "as NEW tensors at the first forward, after the optimizer and Opacus captured these ones, and the "
                "model then trains nothing while epsilon still grows (the #820 failure). Fix: materialize the model "
                f"on its device first (model.to(device) / from_pretrained without lazy loading); order: {ORDER}.",
                meta,
            )
        self._check_parameters()

    def _check_parameters(self) -> None:
        """The model's trainable parameters are the optimizer's, and each has Opacus' per-sample hooks."""
        opt_params = self._optimizer_params()
        held = {id(p) for p in opt_params}
        model_ids = {id(p) for p in self._model.parameters()}
        trainable = [(n, p) for n, p in self._model.named_parameters() if p.requires_grad]
        missing = [n for n, p in trainable if id(p) not in held]
        stale = [
            self._name(p, f"optimizer param {i}")
            for i, p in enumerate(opt_params)
            if p.requires_grad and id(p) not in model_ids
        ]
        if stale:
            self._report(
                "optimizer_params",
                f"the optimizer updates {len(stale)} parameter(s) the model no longer uses (e.g. {_shown(stale)}), "
                f"and the model's trainable parameters {_shown(missing)} are not in the optimizer: the model's "
                "parameters were replaced after the optimizer / make_private captured them (model.to(device) after "
                "get_peft_model or make_private that re-creates parameters, lazy/meta materialization, "
                "load_state_dict(assign=True) — Opacus issue #820). The model would never learn while epsilon "
                f"grows. Fix: order {ORDER}, and do not move or reload the model afterwards.",
                stale,
            )
        elif missing:
            self._report(
                "optimizer_params",
                f"{len(missing)} trainable parameter(s) of the model are not in the optimizer (e.g. "
                f"{_shown(missing)}): they get per-sample gradients but are never updated. Cause: the optimizer "
                "was built before get_peft_model added the adapters, or from a subset of the parameters. Fix: "
                f"build the optimizer from the final model's trainable parameters (order {ORDER}), or freeze "
                "what should not train (requires_grad=False).",
                missing,
            )
        uncovered = [n for n, p in trainable if id(p) in held and id(p) not in self._covered]
        if uncovered:
            consequence = (
                "ghost clipping leaves them out of the per-example norms, so their update is NOT clipped and the "
                "privacy guarantee is void"
                if self._ghost
                else "Opacus computes no per-sample gradient for them"
            )
            self._report(
                "hook_coverage",
                f"{len(uncovered)} parameter(s) became trainable after make_private (e.g. {_shown(uncovered)}): "
                f"Opacus set its per-sample hooks up only for the parameters trainable then, so {consequence} "
                "(Opacus #687/#729). Fix: make every parameter you will train trainable before make_private, and "
                "switch them off and on between steps with opacus_spectral.set_trainable.",
                uncovered,
            )

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self._check_parameters()
        if not self._fingerprint.has_baseline:  # the first forward after a DP step (weights loaded before it count)
            self._fingerprint.take()

    def _count_rows(self, opt: DPOptimizer) -> None:
        """Before Opacus' ``pre_step``: add the physical batch's per-sample rows (a shape read)."""
        rows = per_sample_rows(opt.params)
        self._rows = None if rows is None or self._rows is None else self._rows + rows

    def _before_accountant(self, opt: DPOptimizer) -> None:
        acc = self.accountant
        self._before = None if acc is None else (accounted_steps(acc), charge_log(acc).calls)

    def _after_accountant(self, opt: DPOptimizer) -> None:
        """A DP step (noise added, the accountant's hook ran): the checks made once per DP step."""
        before, self._before = self._before, None
        if before is None:
            self._counted = None
        else:  # what the accountant added, and what the engine's hook says it charged (1 unless shuffled sampling)
            added = accounted_steps(self.accountant) - before[0]
            self._counted = (added, expected_charge(before[1], charge_log(self.accountant)))
        self.dp_steps += 1
        rows, self._rows = self._rows, 0
        findings = self._batches.on_dp_step(rows) if self._batches is not None else []
        self._fingerprint.compare(self.dp_steps)
        for check, message in findings:
            self._report(check, message)
        self._report_moved()

    def _report_moved(self) -> None:
        for step, moved in self._fingerprint.ready():
            names = [self._name(self._fingerprint.params[i], f"optimizer param {i}") for i in moved]
            self._report(
                "param_change",
                f"{len(names)} parameter(s) changed before DP step {step} without a noisy, accounted step (e.g. "
                f"{_shown(names)}): something other than the DPOptimizer updated them after the forward pass — a "
                "second optimizer or a manual edit stepping on the clean, un-noised gradient. That update is not "
                "private and epsilon does not cover it. Fix: update the parameters only through the DPOptimizer "
                "make_private returned; a data-independent edit (loading weights, a projection) belongs between "
                "optimizer.step() and the next forward pass.",
                names,
            )

    def _check_finite(self) -> None:
        """NaN/Inf in the noisy gradient when no pipeline checks it (``post_hooks=None``): before the update."""
        if getattr(self.optimizer.original_optimizer, HANDLE_ATTR, None) is not None:
            return  # the pipeline applies on_nonfinite_grad itself
        params = [p for p in self.optimizer.params if p.grad is not None]
        if not params:
            return
        finite = torch.isfinite(stacked_norms([p.grad for p in params], 2.0))  # the fastest fused norm; NaN/Inf stay
        if bool(finite.all()):  # one host sync
            return
        bad = [p for p, ok in zip(params, finite.tolist(), strict=True) if not ok]
        names = [self._name(p, "?") for p in bad if not bool(torch.isfinite(p.grad).all())]  # not an overflow
        if not names:
            return
        raising = self.mode == "raise"
        if raising:
            for p in self.optimizer.params:  # nobody may step on it later
                p.grad = None
        self._report(
            "nonfinite",
            f"the noisy gradient of DP step {self.dp_steps} holds NaN/Inf in {len(names)} parameter(s) (e.g. "
            f"{_shown(names)}): one record with a non-finite input or loss makes the whole clipped sum non-finite, "
            + (
                "and the step was aborted before the update (the weights are unchanged). "
                if raising
                else "and this update makes those weights NaN. "
            )
            + "Fix: clean the data, or let a pipeline handle it: make_private(post_hooks=[], "
            "on_nonfinite_grad='skip_step'); in DPTrainer post_hooks=[] and "
            "make_private_kwargs={'on_nonfinite_grad': 'skip_step'}.",
            names,
        )

    def _pre_step(self, step: InnerStep) -> None:
        noised, counted = step.noised, self._counted
        self._counted = None
        if not noised:
            self._report(
                "accounting",
                "the optimizer stepped without a noisy, accounted DP step: epsilon does not include this update. "
                "Causes: the inner optimizer was stepped directly, Opacus' step_hook (the accountant) was replaced, "
                "or the DPOptimizer holds no trainable parameter with per-sample gradients — then Opacus steps "
                "WITHOUT noise (e.g. the optimizer was built before get_peft_model). Fix: step through the "
                f"DPOptimizer make_private returned; order {ORDER}.",
            )
        elif counted is not None and counted[0] != counted[1]:
            added, expected = counted
            charged = "" if expected == 1 else f" (the engine's accounting charged {expected})"
            self._report(
                "accounting",
                f"the accountant counted {added} steps for one noisy step{charged}: epsilon is "
                f"{'under' if added < expected else 'over'}-reported. Cause: the accountant's step_hook was removed "
                "from the chain, or a second accountant hook was added. Fix: call make_private once per optimizer and "
                "chain to the previous step_hook if you set your own.",
            )
        dp_step = noised
        if dp_step:
            self._check_finite()
        if not (dp_step and self._first_step_pending):
            return
        params = [p for p in self.optimizer.params]
        no_state = [
            self._name(p, "?")
            for p in params
            if p.grad is None
            or getattr(p, "summed_grad", None) is None
            or (getattr(p, "_norm_sample", None) if self._ghost else getattr(p, "grad_sample", None)) is None
        ]
        if no_state:
            self._report(
                "per_sample_grad",
                f"{len(no_state)} trainable parameter(s) reached the first DP step without a per-sample gradient or "
                f"noisy gradient (e.g. {_shown(no_state)}): they are not privatized as the accountant assumes. Fix: "
                "make them trainable before make_private, and run forward/backward through the model make_private "
                "wrapped.",
                no_state,
            )
        self._snapshot = {n: (p, p.detach().clone()) for n, p in self._model.named_parameters() if p.requires_grad}

    def _post_step(self, step: InnerStep) -> None:
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return
        inner = step.optimizer.original_optimizer
        lr = {id(p): group.get("lr", 1.0) for group in inner.param_groups for p in group["params"]}
        checked, unchanged = 0, []
        for name, (p, before) in snapshot.items():
            if p.grad is None or lr.get(id(p), 0.0) == 0 or not bool(p.grad.detach().abs().gt(0).any()):
                continue  # no update expected (skipped step, lr 0 e.g. warm-up, zero or zero-size gradient)
            checked += 1
            if torch.equal(p.detach(), before):
                unchanged.append(name)
        if checked == 0:
            return  # nothing could move this step: look again at the next one
        self._first_step_pending = False
        if unchanged:
            self._report(
                "unchanged",
                f"{len(unchanged)} trainable parameter(s) had a non-zero noisy gradient but did not change in the "
                f"first DP step (e.g. {_shown(unchanged)}). Causes: the learning rate is too small for the "
                "parameter's dtype (bf16/fp16 weights round small updates away), the optimizer skips them, or a "
                "hook restores them. Fix: train adapters in float32, raise the learning rate, check the optimizer.",
                unchanged,
            )


def _forward_target(module: Any, model: nn.Module) -> nn.Module:
    """Where the forward check hooks in: the user's model, or under ``grad_sample_mode="ew"`` Opacus' wrapper, whose
    forward runs the model with its parameters swapped for ExpandedWeights that refuse attribute reads."""
    return module if isinstance(module, GradSampleModuleExpandedWeights) else model


def install_doctor(
    dp_optimizer: DPOptimizer,
    module: Any,
    *,
    accountant: Any = None,
    mode: DoctorSetting = True,
    data_loader: Any = None,
) -> Doctor | None:
    """Attach a :class:`Doctor` (``None`` when ``mode`` is off). Install it right after ``make_private``, with the
    data loader it returned."""
    resolved = resolve_mode(mode)
    if resolved is None:
        return None
    return Doctor(dp_optimizer, module, accountant=accountant, mode=resolved, data_loader=data_loader)
