"""The DP state of a ``DPTrainer`` checkpoint (``opacus_spectral_dp.pt``) and the checks a resume must pass.

A checkpoint directory holds the weights, the Trainer's ``trainer_state.json`` (``global_step``), ``optimizer.pt``
(Adam-type optimizers count each parameter's steps) and ``scheduler.pt`` (the scheduler's ``last_epoch``), and
DPTrainer's ``opacus_spectral_dp.pt``: the DP set-up, the accountant's history, the denoisers' state, the step,
a digest of the trained parameters, the privacy record the run composed with
(:mod:`~opacus_spectral.accounting.record`; the history starts with it) and, under a noise mechanism other than
``"gaussian"``, ``noise_mechanism``: its name and settings, the partition seed and the step (the engine's
``MechanismRun.state_dict``), never its noise buffers. It holds no random generator's state: the noise and the
Poisson sample come from generators that are never saved (``docs/trainer.md``, "Noise and reproducibility").

On resume the accountant's history must be the configured noise multiplier and sample rate for exactly the
steps ``global_step`` DP steps charge (⌈global_step / b⌉ under BandMF with b bands), the Trainer's and the DP
state's step must agree, no counter beside them may have counted more steps, and the loaded parameters must be the
ones the DP state was saved with. These are consistency checks:
they refuse edited or mixed checkpoints, not one forged consistently in every file (that needs a key; keep
checkpoints where only you write).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accounting.checkpoint import load_checkpoint_file, optimizer_step_count, verify_accountant_history
from ..accounting.record import STATE_KEY, resumed_prefix, run_history

__all__ = [
    "DP_STATE_FILE",
    "MECHANISM_KEY",
    "ResumeEvidence",
    "check_parameters",
    "check_resume",
    "dp_state",
    "parameters_digest",
    "read_checkpoint",
    "resumed_noise_seed",
]

DP_STATE_FILE = "opacus_spectral_dp.pt"
FORMAT = 4  #: 4: the noise mechanism in "config" and "noise_mechanism"; 3: the bound is "per_sample_max_grad_norm"
#: the key of the noise mechanism's state (the key "mechanism" of the config names the accountant)
MECHANISM_KEY = "noise_mechanism"
#: the DP set-up a resumed run must share with its checkpoint
COMPARED = (
    "mechanism",
    "noise_multiplier",
    "sample_rate",
    "per_sample_max_grad_norm",
    "target_delta",
    "target_epsilon",
    "grad_sample_mode",
    "denoisers",
    "noise_mechanism",
)
_TRAINER_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")


def parameters_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over the names, dtypes, shapes and values of the optimizer's parameters, in name order."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    h = hashlib.sha256()
    for name, p in sorted((n, p) for n, p in model.named_parameters() if id(p) in ids):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dp_state(
    config: dict[str, Any],
    accountant: Any,
    post_hooks: Any,
    global_step: int,
    digest: str,
    record: Any = None,
    mechanism: dict[str, Any] | None = None,
) -> dict:
    """What ``opacus_spectral_dp.pt`` holds (numbers, strings, tensors of denoiser state; no generator state);
    ``record``: the privacy record the run composed with (:func:`~opacus_spectral.accounting.record.resume_state`);
    ``mechanism``: the noise mechanism's ``MechanismRun.state_dict()`` (no noise buffer; no key for gaussian)."""
    return {
        **({} if mechanism is None else {MECHANISM_KEY: mechanism}),
        "format": FORMAT,
        "config": config,
        "accountant": dict(accountant.state_dict()),
        "post_hooks": None if post_hooks is None else post_hooks.state_dict(),
        "global_step": int(global_step),
        "parameters_digest": digest,
        STATE_KEY: record,
    }


@dataclass
class ResumeEvidence:
    """A checkpoint's DP state and the step counters the Trainer saved beside it."""

    directory: str
    dp: dict[str, Any]
    trainer_step: int  #: ``trainer_state.json`` global_step
    optimizer_steps: int  #: the largest per-parameter step count in ``optimizer.pt`` (0: the optimizer keeps none)
    scheduler_step: int | None  #: ``scheduler.pt`` last_epoch (None: not kept)


def read_checkpoint(directory: str) -> ResumeEvidence:
    """Read the DP state and the Trainer's counters; a checkpoint missing any of them is refused."""
    path = os.path.join(directory, DP_STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{directory} holds no DP state ({DP_STATE_FILE}): it was not written by DPTrainer, so the privacy cost "
            "of the steps behind it is unknown. Start from the base model instead."
        )
    missing = [f for f in _TRAINER_FILES if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise ValueError(
            f"cannot resume from {directory}: it lacks {missing}, whose step counters must corroborate the DP state "
            "(was it saved with save_only_model=True?). Resume from a checkpoint saved with the full Trainer state."
        )
    dp = load_checkpoint_file(path, map_location="cpu")
    if dp.get("format") != FORMAT:
        raise ValueError(f"{path} has DP state format {dp.get('format')!r}; this version reads format {FORMAT}")
    with open(os.path.join(directory, "trainer_state.json")) as f:
        trainer_step = int(json.load(f)["global_step"])
    optimizer = load_checkpoint_file(os.path.join(directory, "optimizer.pt"), map_location="cpu")
    scheduler = load_checkpoint_file(os.path.join(directory, "scheduler.pt"), map_location="cpu")
    last = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
    return ResumeEvidence(
        directory, dp, trainer_step, optimizer_step_count(optimizer), None if last is None else int(last)
    )


def check_resume(
    evidence: ResumeEvidence, config: dict[str, Any], *, global_step: int, every: int = 1, scale: float = 1.0
) -> None:
    """Refuse (``ValueError`` naming the mismatch) DP state that disagrees with ``config`` or the step counters;
    ``every``: the noise mechanism charges one accountant step every ``every`` DP steps, at σ × ``scale``."""
    saved = evidence.dp["config"]
    differ = [f"{k}: checkpoint {saved.get(k)!r}, now {config[k]!r}" for k in COMPARED if saved.get(k) != config[k]]
    if differ:
        raise ValueError(
            "cannot resume: the checkpoint was trained with another DP set-up (" + "; ".join(differ) + "). Resume "
            "with the same DPTrainer arguments, TrainingArguments and dataset."
        )
    where = f"{evidence.directory}/{DP_STATE_FILE}"
    steps = {
        "the DP state": int(evidence.dp["global_step"]),
        "trainer_state.json": evidence.trainer_step,
        "the Trainer": int(global_step),
    }
    if len(set(steps.values())) > 1:
        raise ValueError(f"cannot resume: the checkpoint's step counts disagree ({_listed(steps)})")
    step = steps["the DP state"]
    verify_accountant_history(
        _own_history(evidence.dp, where),
        noise_multiplier=config["noise_multiplier"] * scale,
        sample_rate=config["sample_rate"],
        steps=-(-step // every),
        where=where,
    )
    counters = {
        "optimizer.pt (a parameter's step count)": evidence.optimizer_steps,
        "scheduler.pt (last_epoch)": evidence.scheduler_step,
    }
    ahead = {k: v for k, v in counters.items() if v is not None and v > step}
    if ahead:
        raise ValueError(
            f"cannot resume: {_listed(ahead)} counted more steps than the accountant's {step}: the weights were "
            "trained for steps whose privacy cost the DP state does not account. Resume from an unedited checkpoint."
        )


def _own_history(dp: dict[str, Any], where: str) -> Any:
    """The accountant history of the checkpoint's run: after the privacy record it was composed with."""
    history = dp["accountant"].get("history", [])
    prefix = resumed_prefix(dp.get(STATE_KEY))
    if not prefix:
        return history
    try:
        return run_history(history, prefix)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}: refusing a history that would misreport epsilon") from err


def check_parameters(evidence: ResumeEvidence, digest: str) -> None:
    """The parameters loaded from the checkpoint must be those its DP state was saved with."""
    if evidence.dp.get("parameters_digest") != digest:
        raise ValueError(
            f"cannot resume: the trained parameters loaded from {evidence.directory} are not the ones its DP state "
            "was saved with (weights from another step or run?). Resume from an unedited checkpoint."
        )


def resumed_noise_seed(noise_seed: int, step: int) -> int:
    """The ``noise_seed`` of a run resumed at ``step``: a resumed run with the original seed would restart its noise
    stream, repeating the first steps' noise (which the difference of two checkpoints then cancels)."""
    digest = hashlib.blake2b(f"{noise_seed}/resumed-at/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _listed(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in values.items())
