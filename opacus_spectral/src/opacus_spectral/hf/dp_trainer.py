"""``DPTrainer``: differentially private fine-tuning with the Hugging Face ``Trainer`` (the ``[hf]`` extra: README,
Install), user guide in ``docs/trainer.md``.

What it changes in ``transformers.Trainer`` (5.x), and where (what it refuses: :mod:`~opacus_spectral.hf.checks`):

* ``get_train_dataloader``: Poisson sampling exactly as Opacus does it (``DPDataLoader.from_data_loader`` on a
  loader of logical batches of ``per_device_train_batch_size × gradient_accumulation_steps`` examples, drawn with
  the engine's sampler generator: OS entropy, or ``noise_seed``; never the global RNG the Trainer seeds), each
  logical batch split into ``gradient_accumulation_steps`` physical batches (:class:`PhysicalBatches`), so the
  Trainer's accumulation loop sees exactly that many micro-batches per optimizer step; under a noise mechanism with
  its own sampler (``noise_mechanism="bandmf"``: cyclic Poisson) the logical batches are drawn by the sampler
  ``make_private`` builds and charges for (:mod:`~opacus_spectral.hf.mechanism`);
* ``create_optimizer``: the Trainer's optimizer goes through ``opacus_spectral.PrivacyEngine.make_private``
  (``wrap_model=False``: the model stays the user's ``PeftModel``), the noise multiplier from
  :func:`~opacus_spectral.accounting.calibration.noise_multiplier_for` for the run's ``max_steps`` (through the
  noise mechanism's accounting) and the same accountant (with a privacy record on the model,
  :mod:`~opacus_spectral.accounting.record`: for that history and this run together); a resumed run's accountant,
  denoiser and noise-mechanism state are restored;
* ``_save``: the privacy record beside the adapter (``privacy_record.json``);
* ``_wrap_model``: across processes (``torchrun``) the model goes into Opacus' ``DPDDP``, never torch DDP, the logical
  batch spans the ranks and each rank samples its own share of the records (:mod:`~opacus_spectral.hf.distributed`);
* ``training_step``: the per-example loss of each micro-batch (:mod:`~opacus_spectral.hf.loss`: causal LM, token or
  sequence classification; per-sample gradients clipped in float32 under bf16, :mod:`~opacus_spectral.step.precision`),
  then BatchMemoryManager's virtual step (clip and accumulate, no noise) for all but the last micro-batch; the
  Trainer's own ``optimizer.step()`` on the last one adds the noise once per logical batch;
* ``prediction_step`` / ``evaluation_loop``: a causal LM's ``eval_loss`` is the per-token mean next-token
  cross-entropy over the whole evaluation set, ``eval_perplexity`` its exponential;
* ``log``: ε and δ join every log record (so ``report_to`` sends them; ε = inf once a step had noise 0); a training
  record keeps only the keys of :mod:`~opacus_spectral.hf.logs` (loss, FLOP and token counts, timing: dropped) unless
  ``release_nonprivate_stats=True``; ``floating_point_ops`` counts nothing, so ``total_flos`` stays 0;
* ``_save_checkpoint`` / ``_load_from_checkpoint``: the DP state travels in ``opacus_spectral_dp.pt``, checked on
  resume against the Trainer's step counters and the loaded weights (:mod:`~opacus_spectral.hf.state`);
* ``_get_grad_norm``: not computed (the clean gradient's norm is not private); the Trainer's clipping of the batch
  gradient (``max_grad_norm``) is refused (:mod:`~opacus_spectral.hf.dp_config`).

The private Trainer members this relies on are listed in :data:`PRIVATE_TRAINER_API`.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..accounting.record import STATE_KEY as RECORD_STATE_KEY
from ..accounting.record import (
    composed_steps,
    noise_multiplier_after,
    privacy_record_of,
    restore_record,
    resume_state,
    save_privacy_record,
    set_run_delta,
    trainer_prior,
)
from ..denoisers.base import denoiser_name
from ..doctor.doctor import accounted_steps
from ..engine import PrivacyEngine
from ..plugins.registry import alternation_controller, create_denoisers
from ..step.grad_sample import set_trainable, without_full_backward_hook_warning
from ..step.noise_source import NoiseSource
from . import loss as trainer_loss
from .batch_check import TrainerBatchCheck, with_positions
from .budget import DPControl, budget_steps, spends_infinite_epsilon
from .checks import check_run_length, check_supported, check_train_dataset
from .distributed import (
    LockstepPoissonSampler,
    check_evaluation,
    check_ranks_agree,
    is_distributed,
    mechanism_setup,
    rank_wrapper,
    run_setup,
)
from .dp_config import DPTrainingArguments, check_dp_settings
from .logs import drop_unlisted
from .loss import example_losses, next_token_loss_sum, opacus_loss, resolve_task, task_of_batch
from .mechanism import PendingSampler, accounted, accounting_of, bind_sampler, mechanism_spec, resume_sampler
from .physical_batches import EmptyAwareCollate, PhysicalBatches, batch_size
from .precision import check_trainable_dtypes
from .progress import install_progress
from .state import (
    DP_STATE_FILE,
    MECHANISM_KEY,
    check_parameters,
    check_resume,
    dp_state,
    parameters_digest,
    read_checkpoint,
    resumed_noise_seed,
)

#: The private ``transformers.Trainer`` members DPTrainer relies on, with the parameters it expects
#: (``docs/trainer.md``, "Private Trainer methods"): "override" — redefined here, and still called by the Trainer;
#: "call" — called here; "attribute" — read here. A transformers release may change any of them: the tests check the
#: installed one.
PRIVATE_TRAINER_API: dict[str, tuple[str, tuple[str, ...]]] = {
    "_wrap_model": ("override", ("model", "training", "dataloader")),
    "_get_grad_norm": ("override", ("model", "grad_norm")),
    "_save_checkpoint": ("override", ("model", "trial")),
    "_save": ("override", ("output_dir", "state_dict")),
    "_load_from_checkpoint": ("override", ("resume_from_checkpoint", "model")),
    "_remove_unused_columns": ("call", ("dataset", "description")),
    "_get_collator_with_removed_columns": ("call", ("data_collator", "description")),
    "_prepare_inputs": ("call", ("inputs",)),
    "_get_output_dir": ("call", ("trial",)),
    "_train_batch_size": ("attribute", ()),
}


class DPTrainer(Trainer):
    """``transformers.Trainer`` with DP-SGD (Opacus, Poisson sampling) and optional post-noise denoisers.

    Takes every ``Trainer`` argument; the DP settings are ``args=``
    :class:`~opacus_spectral.hf.dp_config.DPTrainingArguments` (``target_delta``, ``target_epsilon`` or
    ``noise_multiplier``, ``per_sample_max_grad_norm``, ``post_hooks``, ``noise_seed``, ...). The denoisers of
    ``post_hooks`` are built here, so a misspelled name or keyword is refused before any training.

    Args:
        criterion: sequence classification under ghost clipping: the per-example loss (default
            ``nn.CrossEntropyLoss`` on ``logits``, with ``label_smoothing_factor``), an object like the Trainer's
            ``compute_loss_func``, hence not an argument field.
    """

    def __init__(self, model: Any = None, args: Any = None, *more: Any, criterion: nn.Module | None = None, **kwargs):
        _check_arguments(args, kwargs)
        check_dp_settings(args)  # again: arguments unpickled or edited since they were built
        self._denoisers = None if args.post_hooks is None else create_denoisers(args.post_hooks)
        self._mechanism = mechanism_spec(args.noise_mechanism)  #: make_private's noise_mechanism (None: gaussian)
        super().__init__(model, args, *more, **kwargs)
        self.args: DPTrainingArguments
        self.criterion = criterion
        self.noise_multiplier = args.noise_multiplier  #: the run's, once calibrated (create_optimizer)
        self.prior_steps = 0  #: steps of the model's privacy record this run composed with (.privacy_record)
        self.position_ids_from_mask = False  #: left-padded batches get position_ids (set by the batch check)
        self.batch_check_result: TrainerBatchCheck | None = None  #: the check's outcome and cost, once it ran
        self._check_data: tuple[Any, Any] | None = None  #: the training set and collator the check reads
        self.task = resolve_task(self.model, args.task)
        check_supported(self)
        self.privacy_engine = PrivacyEngine(
            accountant=args.accountant, secure_mode=args.secure_mode, noise_seed=args.noise_seed
        )
        self.sample_rate: float | None = None
        self.budget_steps: int | None = None  #: DP steps (total) within target_epsilon; None: the whole run fits
        self.accounted_every = 1  #: the noise mechanism charges one accountant step every this many DP steps
        self.accounted_scale = 1.0  #: ... at noise multiplier σ × this (BandMF: 1/κ)
        self.controller: Any = None  #: the alternation controller a plugin attached for this run, if any
        self._logical_loader: DataLoader | None = None
        self._dp: DPOptimizer | None = None
        self._ranks: nn.Module | None = None  #: Opacus' DPDDP around the model, across processes
        self._hooks: Any = None
        self._dp_criterion: Any = None
        self._resume: Any = None  #: the ResumeEvidence of the checkpoint being resumed
        self._evaluating = False
        self._warned_keys: set[str] = set()
        self._clear_pending = False
        self._backwards = 0  #: backward passes run (torch's full-backward-hook warning: the first one's only)
        self._trained = False
        self._eps_cache: tuple[int, float] = (-1, 0.0)
        self._eval_sums: list[float] = [0.0, 0]  #: next-token loss sum and target count of the running evaluation
        self.add_callback(DPControl(self))
        install_progress(self)  # no per-step timing in the progress bar (.trainer_progress)

    def set_trainable(self, params: Sequence[nn.Parameter], trainable: bool) -> None:
        """Freeze or unfreeze parameters between DP steps, Opacus' per-sample state included
        (:func:`~opacus_spectral.step.grad_sample.set_trainable`): what an alternation controller on this Trainer
        freezes with."""
        set_trainable(params, trainable)

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
        check_train_dataset(dataset)
        self._check_data = (dataset, collate)
        k, ranks = self.args.gradient_accumulation_steps, max(1, self.args.world_size)
        generator = self.privacy_engine.sampler_generator(distributed=ranks > 1)
        own = None if self._mechanism is None else generator  # make_private's sampler draws with the Trainer's
        logical = DataLoader(dataset, batch_size=self._train_batch_size * k * ranks, collate_fn=collate, generator=own)
        poisson = DPDataLoader.from_data_loader(logical, generator=generator, distributed=ranks > 1)
        self._logical_loader, self.sample_rate = logical, poisson.sample_rate
        self._poisson_sampler = poisson.batch_sampler  # what the doctor pairs DP steps with (create_optimizer)
        if self._mechanism is not None:  # the mechanism's sampler, once make_private built it (.mechanism)
            self._poisson_sampler = PendingSampler(len(poisson.batch_sampler))
        install_progress(self)  # a timed bar added since construction (.trainer_progress)
        if ranks > 1:  # the same data, order and set-up on every rank (checked among them); this rank's shard at
            check_ranks_agree(run_setup(self, dataset))  # rate q, an empty batch included (.trainer_distributed)
        if ranks > 1 and self._mechanism is None:  # a mechanism's sampler shards each group itself (make_private)
            self._poisson_sampler = LockstepPoissonSampler(
                total_size=len(dataset), sample_rate=self.sample_rate, generator=generator
            )
        self._physical = PhysicalBatches(self._poisson_sampler, k)
        return DataLoader(
            dataset,
            batch_sampler=self._physical,
            collate_fn=EmptyAwareCollate(collate, dataset),
            generator=generator,  # as Opacus' DPDataLoader: each epoch's iterator draws its base seed from it
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
        check_trainable_dtypes(optimizer)
        size, steps = len(self._logical_loader.dataset), self.state.max_steps
        accounting = accounting_of(self.args.noise_mechanism, self.sample_rate, steps=steps, dataset_size=size)
        self.accounted_every, self.accounted_scale = accounting.every, accounting.noise_multiplier
        noise_multiplier = self.noise_multiplier
        if noise_multiplier is None:
            check_run_length(self.state.max_steps, self.args.num_train_epochs)  # steps=0 would never return
            prior = trainer_prior(self.privacy_engine, self.model, self.args.new_privacy_unit, self._resume)
            noise_multiplier = (
                noise_multiplier_after(
                    prior,
                    target_epsilon=self.args.target_epsilon,
                    target_delta=self.args.target_delta,
                    sample_rate=accounting.sample_rate,
                    steps=accounted(self.state.max_steps, accounting.every),
                    accountant=self.privacy_engine.accountant.mechanism(),
                )
                / accounting.noise_multiplier
            )  # the σ whose charged σ′ = σ·(σ′ at 1) meets the target
        criterion = self.criterion or trainer_loss.ghost_criterion(self.label_smoother)  # smoothed per example
        extra: dict[str, Any] = {"criterion": criterion} if self._ghost else {}
        if self._mechanism is not None:  # its coefficients are optimized for the run's length
            extra.update(noise_mechanism=self._mechanism, steps=self.state.max_steps)
        self.model.train()  # as training_step does; evaluate() or from_pretrained leave eval mode, Opacus refuses it
        if is_distributed(self):  # Opacus' DPDDP: make_private builds the distributed optimizer
            self._ranks = rank_wrapper(self.model)
        module = self.model if self._ranks is None else self._ranks
        out = self.privacy_engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=self._logical_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=self.args.per_sample_max_grad_norm,
            poisson_sampling=True,
            grad_sample_mode=self.args.grad_sample_mode,
            wrap_model=False,
            post_hooks=self._denoisers,
            doctor=False if self.args.doctor == "off" else self.args.doctor,
            new_privacy_unit=self.args.new_privacy_unit,
            batch_check=False,  # the Trainer checks per-example gradients itself (training_step)
            **extra,
            **(self.args.make_private_kwargs or {}),
        )
        self._hooks, self._dp = out[0], out[1]
        self._dp_criterion = out[2] if self._ghost else None
        watched = self._poisson_sampler
        if self.privacy_engine.mechanism_run is not None:  # train on the sampler the accountant is charged for
            watched = bind_sampler(self.privacy_engine.mechanism_run, self._physical, self.args)
            self._poisson_sampler = watched.batch_sampler
        if self.privacy_engine.doctor is not None:  # the steps draw from our loader, not make_private's
            self.privacy_engine.doctor.watch_batches(watched)
        if out[-1].sample_rate != self.sample_rate:  # the loader we train on and the accountant must agree
            raise RuntimeError(f"sample rates differ: loader {self.sample_rate}, accountant {out[-1].sample_rate}")
        self.noise_multiplier = self._dp.noise_multiplier
        set_run_delta(self.privacy_engine, self.args.target_delta)
        if self._resume is not None:
            self._restore(self._resume)
        if self._ranks is not None and self.privacy_engine.mechanism_run is not None:  # one partition, one cycle
            check_ranks_agree(mechanism_setup(self.privacy_engine.mechanism_run))
        self.prior_steps = composed_steps(self.privacy_engine)  # the accountant's history starts with them
        self._set_budget(accounting)
        self.optimizer = self._dp
        return self._dp

    def _set_budget(self, accounting: Any) -> None:
        """:attr:`budget_steps`: the DP steps within ``target_epsilon``, counted in the accountant's steps (one every
        ``accounting.every`` DP steps, at rate ``accounting.sample_rate``) and converted back (× every)."""
        total = budget_steps(
            self.privacy_engine.accountant,
            max_steps=accounted(self.state.max_steps, accounting.every) + self.prior_steps,
            target_epsilon=self.args.target_epsilon,
            noise_multiplier=self.noise_multiplier * accounting.noise_multiplier,
            sample_rate=accounting.sample_rate,
            delta=self.args.target_delta,
        )
        self.budget_steps = None if total is None else (total - self.prior_steps) * accounting.every

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Across processes: the model in Opacus' DPDDP (accelerate's autocast and placement, never torch DDP)."""
        if not (training and self._ranks is not None):
            return super()._wrap_model(model, training, dataloader)
        self.accelerator.prepare_model(self.model, evaluation_mode=True)  # evaluation_mode: no DDP wrapper
        return self._ranks

    @property
    def _ghost(self) -> bool:
        return self.args.grad_sample_mode == "ghost"

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default ``target_delta``), from Opacus' accountant."""
        steps = accounted_steps(self.privacy_engine.accountant)
        if steps == 0:
            return 0.0
        if spends_infinite_epsilon(self.privacy_engine.accountant):  # no noise: the accountants overflow (PRV) instead
            return math.inf
        if delta is not None and delta != self.args.target_delta:
            return float(self.privacy_engine.get_epsilon(delta))
        if self._eps_cache[0] != steps:
            self._eps_cache = (steps, float(self.privacy_engine.get_epsilon(self.args.target_delta)))
        return self._eps_cache[1]

    # -- one micro-batch ----------------------------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Per-example loss and backward; a virtual (clip-and-accumulate) step unless this micro-batch ends the
        logical batch, whose noise the Trainer's ``optimizer.step()`` adds."""
        dp = self._dp
        if dp is None:
            raise RuntimeError("DPTrainer.training_step runs inside train()")
        if self.batch_check_result is None and self.args.batch_check != "off":
            self._check_batches()
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
        if self.batch_check_result is not None:
            self.batch_check_result.check_batch(inputs)  # a left-padded batch the probe found unfixable
        with self.compute_loss_context_manager():
            loss = self._dp_loss(model, inputs)
        # torch's full-backward-hook warning (docs/engine.md, "Warnings"): the first backward's only; the ε reads and
        # audits between steps reset Python's once-per-place record, so it would come back at every step
        with without_full_backward_hook_warning() if self._backwards else contextlib.nullcontext():
            loss.backward()  # the engine clips in float32 under bf16 autocast (:mod:`~opacus_spectral.step.precision`)
        self._backwards += 1
        if not last:  # BatchMemoryManager's virtual step: clip and accumulate, no noise, no update
            dp.signal_skip_step(do_skip=True)
            dp.step()
            dp.zero_grad(set_to_none=True)
        return loss.detach() / self.args.gradient_accumulation_steps  # the Trainer sums the micro-batches' losses

    def _dp_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        """The loss whose backward hands Opacus each example's own gradient (:mod:`~opacus_spectral.hf.loss`)."""
        labels = inputs.get("labels")
        task = self.task or task_of_batch(labels)
        if task == "sequence_classification" and not self._ghost:
            return self.compute_loss(model, self._model_inputs(inputs))  # the model's mean over the examples
        if labels is None:
            raise ValueError(
                f"task {task!r} needs 'labels' in the batch (the loss is computed per example); for a "
                "causal LM use DataCollatorForLanguageModeling(tokenizer, mlm=False)"
            )
        logits = _logits(model(**self._model_inputs(inputs, labels=False)))  # never labels= (trainer_loss)
        if task == "sequence_classification":
            if logits.dim() != 2:
                raise ValueError(
                    f"ghost clipping: logits of {logits.dim()} dimensions with labels of {labels.dim()} "
                    "are not sequence classification; pass DPTrainer(task=...)"
                )
            return self._dp_criterion(logits, labels)
        losses = example_losses(task, logits, labels, inputs.get("attention_mask"))
        return opacus_loss(losses, loss_reduction=self._dp.loss_reduction, ghost_criterion=self._dp_criterion)

    def _model_inputs(self, inputs: dict[str, Any], *, labels: bool = True) -> dict[str, Any]:
        """What the model is called with: without ``labels`` when asked, with ``position_ids`` from the mask on a
        left-padded batch once the batch check found the model needs them (:mod:`~opacus_spectral.hf.batch_check`)."""
        inputs = inputs if labels else {k: v for k, v in inputs.items() if k != "labels"}
        return with_positions(inputs) if self.position_ids_from_mask else inputs

    def _check_batches(self) -> None:
        """DESIGN invariant 8 on this Trainer's model, data and collator, once, before the first DP step."""
        if self._check_data is None:
            return
        self.batch_check_result = TrainerBatchCheck(self, *self._check_data)
        self.position_ids_from_mask = self.batch_check_result.run()

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

    # The Trainer's clipping (max_grad_norm) is refused: DP clips per example. Nor is the clean gradient's norm taken.
    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log plus ``epsilon`` and ``delta``; a training record keeps only public keys
        (:mod:`~opacus_spectral.hf.logs`) unless ``release_nonprivate_stats``; evaluation records are kept whole."""
        if not self.args.release_nonprivate_stats and not self._evaluating:
            unknown = [k for k in drop_unlisted(logs) if k not in self._warned_keys]
            if unknown:
                self._warned_keys.update(unknown)
                warnings.warn(
                    f"DPTrainer did not log {sorted(unknown)}: a training log record carries only keys known to be "
                    "public or noised (opacus_spectral.hf.logs.PUBLIC_LOG_KEYS). Log a value you have "
                    "privatized yourself outside trainer.log, or pass release_nonprivate_stats=True (NOT private).",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self._dp is not None:
            logs["epsilon"], logs["delta"] = self.get_epsilon(), float(self.args.target_delta)  # a bound (gdp: PRV's)
        super().log(logs, start_time)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate``; its log record (on the evaluation set you chose) is not filtered."""
        self._evaluating = True
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._evaluating = False

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[Any, Any, Any]:
        """Causal LM: the batch's mean next-token loss (its sum and count kept for :meth:`evaluation_loop`), logits
        and labels; other tasks: the Trainer's."""
        if self.task != "causal_lm" or inputs.get("labels") is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        labels = inputs["labels"]
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = _logits(model(**self._model_inputs(inputs, labels=False)))
            total, count = next_token_loss_sum(logits, labels, inputs.get("attention_mask"))
        self._eval_sums[0] += float(total)
        self._eval_sums[1] += count
        loss = (total / max(count, 1)).float()
        return (loss, None, None) if prediction_loss_only else (loss, logits.detach(), labels)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop; for a causal LM ``<prefix>_loss`` is then the per-token mean over the whole set (the
        Trainer's averages batch means) and ``<prefix>_perplexity`` its exponential."""
        check_evaluation(self)
        self._eval_sums = [0.0, 0]
        out = super().evaluation_loop(*args, **kwargs)
        total, count = self._eval_sums
        if self.task == "causal_lm" and count > 0:
            prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
            out.metrics[f"{prefix}_loss"] = total / count
            out.metrics[f"{prefix}_perplexity"] = math.exp(min(total / count, 700.0))
        return out

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0 unless ``release_nonprivate_stats``: the Trainer's count (``total_flos``) is proportional to the
        number of tokens of the Poisson-sampled records."""
        return super().floating_point_ops(inputs) if self.args.release_nonprivate_stats else 0

    # -- the run ------------------------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; once per DPTrainer (resume with a new one). Opacus' hooks are removed afterwards."""
        if self._trained:
            raise RuntimeError("a DPTrainer trains once; create a new one (resume_from_checkpoint=... to continue)")
        self._trained = True
        check_dp_settings(self.args)  # edited since construction?
        self._attach_alternation()
        try:
            return super().train(*args, **kwargs)
        finally:
            self._release()

    def _attach_alternation(self) -> None:
        """The alternation controller an installed plugin attaches to this Trainer (``args.alternation``; the
        ``opacus_spectral_alternation_controller`` hook, which peft-lalora implements for a LALoRA model)."""
        attached = alternation_controller(self) if self.args.alternation else None
        if attached is not None:
            self.controller = attached

    def _release(self) -> None:
        if self._dp is not None:
            self._clear_per_sample_state()
        if self.privacy_engine.doctor is not None:
            self.privacy_engine.doctor.remove()
        if self._hooks is not None:
            self._hooks.cleanup()

    # -- checkpoints --------------------------------------------------------------------------------------
    def _dp_config(self) -> dict[str, Any]:
        handle, run = self.privacy_engine.post_hooks, self.privacy_engine.mechanism_run
        return {
            "mechanism": self.privacy_engine.accountant.mechanism(),
            "noise_multiplier": float(self.noise_multiplier),
            "sample_rate": float(self.sample_rate),
            "per_sample_max_grad_norm": float(self.args.per_sample_max_grad_norm),
            "target_delta": float(self.args.target_delta),
            "target_epsilon": None if self.args.target_epsilon is None else float(self.args.target_epsilon),
            "grad_sample_mode": self.args.grad_sample_mode,
            "denoisers": None if handle is None else [denoiser_name(d) for d in handle.denoisers],
            "noise_mechanism": {"name": "gaussian"}
            if run is None
            else {**run.mechanism.describe(), "steps": run.steps},
        }

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        run = self.privacy_engine.mechanism_run
        if self._dp is not None and self.args.should_save:
            out = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(out, exist_ok=True)
            state = dp_state(
                self._dp_config(),
                self.privacy_engine.accountant,
                self.privacy_engine.post_hooks,
                self.state.global_step,
                parameters_digest(self.model, self._dp.original_optimizer),
                resume_state(self.privacy_engine),
                None if run is None else run.state_dict(),  # never the noise buffers
            )
            torch.save(state, os.path.join(out, DP_STATE_FILE))
        super()._save_checkpoint(model, trial)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (adapter, config), and beside it the model's privacy record (``privacy_record.json``)."""
        super()._save(output_dir, state_dict)
        if self.args.should_save and privacy_record_of(self.model) is not None:
            save_privacy_record(self.model, output_dir or self.args.output_dir, delta=self.args.target_delta)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._resume = read_checkpoint(resume_from_checkpoint)
        seed = self.args.noise_seed
        if seed is not None:  # new streams for the resumed steps, not a replay of the first steps' noise
            step = int(self._resume.dp["global_step"])
            self.privacy_engine.noise_source = NoiseSource(resumed_noise_seed(seed, step))
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _restore(self, evidence: Any) -> None:
        """Restore the accountant and denoiser state of a checkpoint, refusing one of another DP set-up or one
        that disagrees with the Trainer's step counters or the loaded weights (:mod:`~opacus_spectral.hf.state`)."""
        step = self.state.global_step
        check_resume(
            evidence, self._dp_config(), global_step=step, every=self.accounted_every, scale=self.accounted_scale
        )
        check_parameters(evidence, parameters_digest(self.model, self._dp.original_optimizer))
        run = self.privacy_engine.mechanism_run
        if run is not None:  # the same partition, the group cycle continued, a fresh noise stream
            skipped = 0 if self.args.ignore_data_skip else step % len(self._poisson_sampler)  # the Trainer's skip
            where = f"{evidence.directory}/{DP_STATE_FILE}"
            resume_sampler(run, evidence.dp.get(MECHANISM_KEY), where=where, global_step=step, skipped=skipped)
        self.privacy_engine.accountant.load_state_dict(evidence.dp["accountant"])
        restore_record(self.privacy_engine, evidence.dp.get(RECORD_STATE_KEY))
        if evidence.dp["post_hooks"] is not None:
            self.privacy_engine.post_hooks.load_state_dict(evidence.dp["post_hooks"])


#: DPTrainingArguments' own fields, and the old per-example bound's name (a DPTrainer keyword once)
_DP_FIELDS = {f.name for f in fields(DPTrainingArguments)} - {f.name for f in fields(TrainingArguments)}


def _check_arguments(args: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a DPTrainer without :class:`DPTrainingArguments`, or with a DP setting given to the Trainer itself."""
    misplaced = sorted(set(kwargs) & (_DP_FIELDS | {"max_grad_norm"}))
    if misplaced:
        hint = " (the per-example bound is per_sample_max_grad_norm)" if "max_grad_norm" in misplaced else ""
        raise TypeError(
            f"DPTrainer got {misplaced}: DP settings are DPTrainingArguments fields, "
            f"DPTrainer(args=DPTrainingArguments(..., {misplaced[0]}=...)){hint}"
        )
    if not isinstance(args, DPTrainingArguments):
        got = "no args" if args is None else type(args).__name__
        raise TypeError(
            "DPTrainer needs args=DPTrainingArguments(...) (TrainingArguments plus the DP settings: target_delta, "
            f"target_epsilon or noise_multiplier, per_sample_max_grad_norm, ...); got {got}"
        )


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
