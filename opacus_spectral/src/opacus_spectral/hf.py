"""``DPTrainer``: differentially private fine-tuning with the Hugging Face ``Trainer`` (``pip install
opacus-spectral[hf]``), user guide in ``docs/trainer.md``.

What it changes in ``transformers.Trainer`` (5.x), and where:

* ``get_train_dataloader``: Poisson sampling exactly as Opacus does it (``DPDataLoader.from_data_loader`` on a
  loader of logical batches of ``per_device_train_batch_size × gradient_accumulation_steps`` examples), each
  logical batch split into ``gradient_accumulation_steps`` physical batches (:class:`PhysicalBatches`), so the
  Trainer's accumulation loop sees exactly that many micro-batches per optimizer step;
* ``create_optimizer``: the Trainer's optimizer goes through ``opacus_spectral.PrivacyEngine.make_private``
  (``wrap_model=False``: the model stays the user's ``PeftModel``), σ from Opacus' ``get_noise_multiplier`` for
  the run's ``max_steps`` and the same accountant; a resumed run's accountant and denoiser state are restored;
* ``training_step``: the per-example loss of each micro-batch, then BatchMemoryManager's virtual step (clip and
  accumulate, no noise) for all but the last micro-batch; the Trainer's own ``optimizer.step()`` on the last one
  adds the noise once per logical batch;
* ``log``: ε and δ join every log record (so ``report_to`` sends them); the training loss, gradient norm and token
  count are computed on the private data without noise and are dropped unless ``release_nonprivate_stats=True``;
* ``_save_checkpoint`` / ``_load_from_checkpoint``: the DP state travels in ``opacus_spectral_dp.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, has_length

from .checkpoint import load_checkpoint_file
from .denoiser import denoiser_name
from .doctor import DoctorSetting, accounted_steps
from .engine import PrivacyEngine
from .grad_sample import set_trainable
from .physical_batches import EmptyAwareCollate, PhysicalBatches, batch_size
from .registry import DenoiserSpec

DP_STATE_FILE = "opacus_spectral_dp.pt"
#: log keys computed from the private data without noise
NONPRIVATE_LOG_KEYS = ("loss", "train_loss", "grad_norm", "num_input_tokens_seen")
_MODES = ("hooks", "functorch", "ghost")
_COMPARED = ("mechanism", "noise_multiplier", "sample_rate", "max_grad_norm", "target_delta", "target_epsilon",
             "grad_sample_mode", "denoisers")  # fmt: skip


class _DPControl(TrainerCallback):
    """Stops training at the privacy budget and checks that the accountant counted every optimizer step."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        counted = accounted_steps(t.privacy_engine.accountant)
        if counted != state.global_step:
            raise RuntimeError(
                f"the accountant counted {counted} DP steps but the Trainer took {state.global_step} optimizer steps: "
                "some update was not privatized as accounted (was the optimizer stepped outside DPTrainer?)"
            )
        if t.budget_steps is not None and counted >= t.budget_steps:
            warnings.warn(
                f"stopping at step {counted}: one more step would exceed target_epsilon={t.target_epsilon} "
                f"(epsilon now {t.get_epsilon():.4g})", RuntimeWarning, stacklevel=2,
            )  # fmt: skip
            control.should_training_stop = True


class DPTrainer(Trainer):
    """``transformers.Trainer`` with DP-SGD (Opacus, Poisson sampling) and optional post-noise denoisers.

    Takes every ``Trainer`` argument, plus (keyword-only):

    Args:
        target_epsilon: the budget; σ is calibrated so that ``max_steps`` (or the epochs) end within it, and
            training stops early if a given ``noise_multiplier`` would exceed it.
        target_delta: δ of the guarantee (required; also the δ at which ε is logged).
        noise_multiplier: σ; ``None`` calibrates it from ``target_epsilon``.
        max_grad_norm: per-example clipping bound (``TrainingArguments.max_grad_norm`` is not used).
        post_hooks: denoisers run on the noisy gradient each logical step (``make_private(post_hooks=...)``).
        grad_sample_mode: ``"hooks"`` (default), ``"functorch"`` or ``"ghost"``.
        accountant: ``"prv"`` (default), ``"rdp"`` or ``"gdp"``; all assume the Poisson sampling used here.
        secure_mode: Opacus' cryptographically secure RNG (torchcsprng) for sampling and noise.
        criterion: the per-example loss under ghost clipping (default ``nn.CrossEntropyLoss()`` on ``logits``).
        doctor: ``"raise"`` (default), ``"warn"`` or ``False`` — see :mod:`~opacus_spectral.doctor`.
        alternation: attach peft_lalora's alternation callback when the model carries a LALoRA adapter and none
            is attached yet.
        release_nonprivate_stats: also log the training loss and token counts (not differentially private).
        make_private_kwargs: further ``make_private`` arguments (``on_denoiser_error``, ``on_nonfinite_grad``, ...).
    """

    def __init__(
        self,
        *args: Any,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        noise_multiplier: float | None = None,
        max_grad_norm: float = 1.0,
        post_hooks: Sequence[DenoiserSpec] | None = None,
        grad_sample_mode: str = "hooks",
        accountant: str = "prv",
        secure_mode: bool = False,
        criterion: nn.Module | None = None,
        doctor: DoctorSetting = "raise",
        alternation: bool = True,
        release_nonprivate_stats: bool = False,
        make_private_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.target_epsilon, self.target_delta = target_epsilon, target_delta
        self.noise_multiplier, self.max_grad_norm = noise_multiplier, float(max_grad_norm)
        self.post_hooks_spec, self.grad_sample_mode = post_hooks, grad_sample_mode
        self.criterion, self.doctor_setting, self.alternation = criterion, doctor, alternation
        self.release_nonprivate_stats = release_nonprivate_stats
        self.make_private_kwargs = dict(make_private_kwargs or {})
        self._check_supported()
        self.privacy_engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
        self.sample_rate: float | None = None
        self.budget_steps: int | None = None  #: DP steps (total) within target_epsilon; None: the whole run fits
        self.controller: Any = None  #: the AlternationController DPTrainer attached, if any
        self._logical_loader: DataLoader | None = None
        self._dp: DPOptimizer | None = None
        self._hooks: Any = None
        self._dp_criterion: Any = None
        self._resume_state: dict[str, Any] | None = None
        self._clear_pending = False
        self._trained = False
        self._eps_cache: tuple[int, float] = (-1, 0.0)
        self.add_callback(_DPControl(self))

    # -- what cannot work ---------------------------------------------------------------------------------
    def _check_supported(self) -> None:
        a = self.args
        if self.grad_sample_mode not in _MODES:
            raise ValueError(f"grad_sample_mode must be one of {_MODES}, got {self.grad_sample_mode!r}")
        if self.target_delta is None or not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta in (0, 1) is required (the δ of the guarantee), got {self.target_delta}")
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ValueError("give target_epsilon (σ is calibrated from it) or noise_multiplier")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon}")
        taken = set(self.make_private_kwargs) & {"module", "optimizer", "data_loader", "noise_multiplier", "wrap_model",
                                                 "max_grad_norm", "poisson_sampling", "grad_sample_mode", "criterion",
                                                 "post_hooks", "doctor"}  # fmt: skip
        if taken:
            raise ValueError(f"make_private_kwargs may not set {sorted(taken)}: DPTrainer sets them")
        refusals = [
            (a.fp16, "fp16 mixed precision: its GradScaler scales the loss (Opacus would clip scaled per-example "
             "gradients) and skips steps with inf/NaN after the accountant counted them. Use bf16 or float32."),
            (a.torch_compile or type(self.model).__name__ == "OptimizedModule",
             "torch.compile: Opacus' per-sample hooks do not run inside a compiled graph. Train uncompiled."),
            (a.n_gpu > 1, f"{a.n_gpu} GPUs in one process (nn.DataParallel): Opacus' hooks see only one replica. "
             "Make one GPU visible (CUDA_VISIBLE_DEVICES)."),
            (a.world_size > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled,
             "multi-process training (DDP / DeepSpeed / FSDP) is not supported by DPTrainer yet; run on one device, "
             "or use opacus_spectral.PrivacyEngine in your own DDP loop."),
            (a.train_sampling_strategy != "random", f"train_sampling_strategy={a.train_sampling_strategy!r}: DP-SGD "
             "needs Poisson sampling, which decides the batches itself. Leave it at 'random'."),
            (a.dataloader_drop_last, "dataloader_drop_last: Poisson batches have no fixed size to drop."),
            (a.auto_find_batch_size, "auto_find_batch_size: changing the batch size changes the sampling rate the "
             "accountant assumed."),
            (bool(getattr(a, "activation_checkpointing", False)), "activation checkpointing: the recomputed forward "
             "pass fires Opacus' activation hooks twice. Train without it."),
            (a.include_num_input_tokens_seen not in ("no", False) and not self.release_nonprivate_stats,
             "include_num_input_tokens_seen: the token count of the sampled batches is not private; pass "
             "release_nonprivate_stats=True to log it anyway."),
        ]
        for bad, why in refusals:
            if bad:
                raise ValueError(f"DPTrainer cannot train with {why}")

    # -- data ---------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Poisson logical batches (Opacus' ``DPDataLoader``), each as ``gradient_accumulation_steps`` micro-batches."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collate = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        if isinstance(dataset, IterableDataset) or not has_length(dataset):
            raise ValueError("DPTrainer needs a dataset with a length: Poisson sampling draws from all of it")
        k = self.args.gradient_accumulation_steps
        logical = DataLoader(dataset, batch_size=self._train_batch_size * k, collate_fn=collate)
        poisson = DPDataLoader.from_data_loader(logical, generator=self.privacy_engine.secure_rng, distributed=False)
        self._logical_loader, self.sample_rate = logical, poisson.sample_rate
        return DataLoader(
            dataset,
            batch_sampler=PhysicalBatches(poisson.batch_sampler, k),
            collate_fn=EmptyAwareCollate(collate, dataset),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )

    # -- privacy ------------------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, made private by ``PrivacyEngine.make_private`` (Poisson sampling)."""
        if self._dp is not None:
            return self.optimizer
        if self._logical_loader is None:
            raise RuntimeError("get_train_dataloader() must run before create_optimizer()")
        optimizer = super().create_optimizer(model)
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("pass a plain torch optimizer (optimizers=...): DPTrainer makes it private itself")
        sigma = self.noise_multiplier
        if sigma is None:
            sigma = get_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta, sample_rate=self.sample_rate,
                steps=self.state.max_steps, accountant=self.privacy_engine.accountant.mechanism(),
            )  # fmt: skip
        extra: dict[str, Any] = {"criterion": self.criterion or nn.CrossEntropyLoss()} if self._ghost else {}
        out = self.privacy_engine.make_private(
            module=self.model, optimizer=optimizer, data_loader=self._logical_loader, noise_multiplier=sigma,
            max_grad_norm=self.max_grad_norm, poisson_sampling=True, grad_sample_mode=self.grad_sample_mode,
            wrap_model=False, post_hooks=self.post_hooks_spec, doctor=self.doctor_setting,
            **extra, **self.make_private_kwargs,
        )  # fmt: skip
        self._hooks, self._dp = out[0], out[1]
        self._dp_criterion = out[2] if self._ghost else None
        if out[-1].sample_rate != self.sample_rate:  # the loader we train on and the accountant must agree
            raise RuntimeError(f"sample rates differ: loader {self.sample_rate}, accountant {out[-1].sample_rate}")
        self.noise_multiplier = self._dp.noise_multiplier
        if self._resume_state is not None:
            self._restore(self._resume_state)
        self.budget_steps = self._budget_steps()
        self.optimizer = self._dp
        return self._dp

    @property
    def _ghost(self) -> bool:
        return self.grad_sample_mode == "ghost"

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default ``target_delta``), from Opacus' accountant."""
        steps = accounted_steps(self.privacy_engine.accountant)
        if steps == 0:
            return 0.0
        if delta is not None and delta != self.target_delta:
            return float(self.privacy_engine.get_epsilon(delta))
        if self._eps_cache[0] != steps:
            self._eps_cache = (steps, float(self.privacy_engine.get_epsilon(self.target_delta)))
        return self._eps_cache[1]

    def _epsilon_after(self, more: int) -> float:
        acc = create_accountant(self.privacy_engine.accountant.mechanism())
        acc.history = list(self.privacy_engine.accountant.history)
        if more > 0:
            acc.history.append((self.noise_multiplier, self.sample_rate, more))
        return float(acc.get_epsilon(self.target_delta)) if acc.history else 0.0

    def _budget_steps(self) -> int | None:
        """The largest total number of DP steps within ``target_epsilon`` (None: all of max_steps fits)."""
        if self.target_epsilon is None:
            return None
        done = accounted_steps(self.privacy_engine.accountant)
        remaining = max(self.state.max_steps - done, 0)
        if self._epsilon_after(remaining) <= self.target_epsilon:
            return None
        if self._epsilon_after(1) > self.target_epsilon:
            raise ValueError(
                f"the privacy budget is spent: one more step would exceed target_epsilon={self.target_epsilon} "
                f"(epsilon now {self._epsilon_after(0):.4g})"
            )
        lo, hi = 1, remaining  # eps(lo) <= target < eps(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._epsilon_after(mid) <= self.target_epsilon else (lo, mid)
        return done + lo

    # -- one micro-batch ----------------------------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Per-example loss and backward; a virtual (clip-and-accumulate) step unless this micro-batch ends the
        logical batch, whose noise the Trainer's ``optimizer.step()`` adds."""
        dp = self._dp
        if dp is None:
            raise RuntimeError("DPTrainer.training_step runs inside train()")
        if self._clear_pending:
            self._clear_per_sample_state()
        last = bool(self.accelerator.sync_gradients)
        self._clear_pending = last
        model.train()
        if batch_size(inputs) == 0:  # an empty Poisson (part-)batch contributes nothing but its noise
            if last:
                self._empty_contribution()
            return torch.zeros((), device=self.args.device)
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self._dp_loss(model, inputs)
        loss.backward()
        if not last:  # BatchMemoryManager's virtual step: clip and accumulate, no noise, no update
            dp.signal_skip_step(do_skip=True)
            dp.step()
            dp.zero_grad(set_to_none=True)
        return loss.detach() / self.args.gradient_accumulation_steps  # the Trainer sums the micro-batches' losses

    def _dp_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        labels = inputs.get("labels")
        if not self._ghost:
            if labels is not None and labels.dim() > 1 and not labels.is_floating_point():
                raise ValueError(
                    "token-level labels: the model averages its loss over the tokens of the whole batch, so each "
                    "example's gradient depends on the other examples' lengths and clipping no longer bounds one "
                    "example's influence. Use grad_sample_mode='ghost' (per-example mean of token losses)."
                )
            return self.compute_loss(model, inputs)
        if labels is None:
            raise ValueError("grad_sample_mode='ghost' needs 'labels' in the batch (the loss is computed per example)")
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
        if logits.dim() == 2:
            return self._dp_criterion(logits, labels)
        if logits.dim() == 3 and labels.dim() == 2:
            return self._dp_criterion(logits.flatten(0, 1), labels.flatten(), shape=tuple(labels.shape))
        raise ValueError(f"ghost clipping: cannot pair logits {tuple(logits.shape)} with labels {tuple(labels.shape)}")

    def _empty_contribution(self) -> None:
        """Zero-example per-sample state, so that Opacus adds the noise of an empty logical batch (as it does)."""
        for p in self._dp.params:
            if self._ghost:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                p._norm_sample = p.new_zeros((0,))
            elif getattr(p, "grad_sample", None) is None:
                p.grad_sample = p.new_zeros((0, *p.shape))

    def _clear_per_sample_state(self) -> None:
        """After a logical step: Opacus' zero_grad, and the stale per-sample state of params frozen since."""
        self._dp.zero_grad(set_to_none=True)
        frozen = [p for g in self._dp.original_optimizer.param_groups for p in g["params"] if not p.requires_grad]
        set_trainable(frozen, False)

    # The Trainer's own clipping would release the norm of the clean gradient: DP clips per example instead.
    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log plus ``epsilon`` and ``delta``; non-private statistics dropped (see the class)."""
        if not self.release_nonprivate_stats:
            for key in NONPRIVATE_LOG_KEYS:
                logs.pop(key, None)
        if self._dp is not None:
            logs["epsilon"], logs["delta"] = self.get_epsilon(), float(self.target_delta)
        super().log(logs, start_time)

    # -- the run ------------------------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; once per DPTrainer (resume with a new one). Opacus' hooks are removed afterwards."""
        if self._trained:
            raise RuntimeError("a DPTrainer trains once; create a new one (resume_from_checkpoint=... to continue)")
        self._trained = True
        self._attach_alternation()
        try:
            return super().train(*args, **kwargs)
        finally:
            self._release()

    def _attach_alternation(self) -> None:
        lalora = sys.modules.get("peft_lalora")
        if not self.alternation or lalora is None:
            return
        if any(isinstance(cb, lalora.LALoraTrainerCallback) for cb in self.callback_handler.callbacks):
            return
        configs = getattr(self.model, "peft_config", None)
        if isinstance(configs, dict) and any(isinstance(c, lalora.LALoraConfig) for c in configs.values()):
            self.controller = lalora.AlternationController(self.model, self)

    def _release(self) -> None:
        if self._dp is not None:
            self._clear_per_sample_state()
        if self.privacy_engine.doctor is not None:
            self.privacy_engine.doctor.remove()
        if self._hooks is not None:
            self._hooks.cleanup()

    # -- checkpoints --------------------------------------------------------------------------------------
    def _dp_config(self) -> dict[str, Any]:
        handle = self.privacy_engine.post_hooks
        return {
            "mechanism": self.privacy_engine.accountant.mechanism(),
            "noise_multiplier": float(self.noise_multiplier),
            "sample_rate": float(self.sample_rate),
            "max_grad_norm": self.max_grad_norm,
            "target_delta": float(self.target_delta),
            "target_epsilon": None if self.target_epsilon is None else float(self.target_epsilon),
            "grad_sample_mode": self.grad_sample_mode,
            "denoisers": None if handle is None else [denoiser_name(d) for d in handle.denoisers],
        }

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self._dp is not None and self.args.should_save:
            out = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(out, exist_ok=True)
            handle = self.privacy_engine.post_hooks
            state = {
                "format": 1,
                "config": self._dp_config(),
                "accountant": dict(self.privacy_engine.accountant.state_dict()),
                "post_hooks": None if handle is None else handle.state_dict(),
                "global_step": int(self.state.global_step),
            }
            torch.save(state, os.path.join(out, DP_STATE_FILE))
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        path = os.path.join(resume_from_checkpoint, DP_STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{resume_from_checkpoint} holds no DP state ({DP_STATE_FILE}): it was not written by DPTrainer, so "
                "the privacy cost of the steps behind it is unknown. Start from the base model instead."
            )
        self._resume_state = load_checkpoint_file(path)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _restore(self, state: dict[str, Any]) -> None:
        """Restore the accountant and denoiser state of a checkpoint, refusing one of another DP set-up."""
        saved, now = state["config"], self._dp_config()
        differ = [f"{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}" for k in _COMPARED if saved.get(k) != now[k]]
        if differ:
            raise ValueError(
                "cannot resume: the checkpoint was trained with another DP set-up (" + "; ".join(differ) + "). Resume "
                "with the same DPTrainer arguments, TrainingArguments and dataset."
            )
        if int(state["global_step"]) != self.state.global_step:
            raise ValueError(f"DP state of step {state['global_step']}, Trainer state of step {self.state.global_step}")
        self.privacy_engine.accountant.load_state_dict(state["accountant"])
        if accounted_steps(self.privacy_engine.accountant) != self.state.global_step:
            raise ValueError("the checkpoint's accountant does not count one DP step per optimizer step")
        if state["post_hooks"] is not None:
            self.privacy_engine.post_hooks.load_state_dict(state["post_hooks"])
