"""What ``DPTrainer`` refuses when it is built (``docs/trainer.md``, "What cannot work, and is refused"): settings
under which the clipped, noised sum would not be what the accountant assumes, or that would release a statistic of
the private data without noise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from transformers import Trainer
from transformers.trainer_utils import has_length

from ..accounting.bounds import check_delta
from .distributed import EVALUATION, unsupported_parallelism

__all__ = ["check_run_length", "check_supported", "check_train_dataset", "loss_refusal"]


def check_supported(t: Any) -> None:
    """Raise ``ValueError`` naming the setting of the DPTrainer ``t`` that cannot work with its model, data and
    Trainer settings, and what to do instead (the DP settings on their own:
    :func:`~opacus_spectral.hf.dp_config.check_dp_settings`)."""
    a = t.args
    check_run_length(a.max_steps, a.num_train_epochs)
    if t.train_dataset is not None:
        check_train_dataset(t.train_dataset)
        check_delta(a.target_delta, len(t.train_dataset), "target_delta")  # δ < 1/N (.accounting)
    for bad, why in _refusals(t):
        if bad:
            raise ValueError(f"DPTrainer cannot train with {why}")


def _refusals(t: Any) -> list[tuple[bool, str | None]]:
    """(refused?, why) for every TrainingArguments / DPTrainer setting that cannot work (``docs/trainer.md``)."""
    a = t.args
    parallelism = unsupported_parallelism(t)  # plain data parallel (torchrun) runs: .trainer_distributed
    refusals = [
        (
            a.fp16,
            "fp16 mixed precision: its GradScaler scales the loss (Opacus would clip scaled per-example "
            "gradients) and skips steps with inf/NaN after the accountant counted them. Use bf16 or float32.",
        ),
        (
            a.torch_compile or type(t.model).__name__ == "OptimizedModule",
            "torch.compile: Opacus' per-sample hooks do not run inside a compiled graph. Train uncompiled.",
        ),
        (
            a.n_gpu > 1,
            f"{a.n_gpu} GPUs in one process (nn.DataParallel): Opacus' hooks see only one replica. "
            "Make one GPU visible (CUDA_VISIBLE_DEVICES).",
        ),
        (parallelism is not None, parallelism),
        (t.task == "causal_lm" and a.world_size > 1 and a.eval_strategy != "no", EVALUATION),
        (
            a.train_sampling_strategy != "random",
            f"train_sampling_strategy={a.train_sampling_strategy!r}: DP-SGD "
            "needs Poisson sampling, which decides the batches itself. Leave it at 'random'.",
        ),
        (a.dataloader_drop_last, "dataloader_drop_last: Poisson batches have no fixed size to drop."),
        (
            a.auto_find_batch_size,
            "auto_find_batch_size: changing the batch size changes the sampling rate the accountant assumed.",
        ),
        (
            bool(getattr(a, "activation_checkpointing", False)),
            "activation checkpointing: the recomputed forward "
            "pass fires Opacus' activation hooks twice. Train without it.",
        ),
        (
            a.include_num_input_tokens_seen not in ("no", False) and not a.release_nonprivate_stats,
            "include_num_input_tokens_seen: the token count of the sampled batches is not private; pass "
            "release_nonprivate_stats=True to log it anyway.",
        ),
        (
            a.bf16 and a.grad_sample_mode == "ghost",
            "bf16 under ghost clipping: Opacus computes the per-example norms from bfloat16 activations "
            "and the clipped gradient in a second bfloat16 backward, so a clipped example can "
            "exceed per_sample_max_grad_norm (opacus_spectral.hf.precision). Use grad_sample_mode='hooks' or float32.",
        ),
        (
            t.task in ("causal_lm", "token_classification")
            and bool(t.criterion or t.compute_loss_func or a.label_smoothing_factor or _overrides_compute_loss(t)),
            "criterion, compute_loss_func, "
            f"label_smoothing_factor or an overridden compute_loss for task={t.task!r}: DPTrainer computes each "
            "example's own token mean (opacus_spectral.hf.loss) and would ignore them. Remove them.",
        ),
    ]
    ghost_loss = loss_refusal(t)
    refusals.append((ghost_loss is not None, ghost_loss))
    return refusals


def _overrides_compute_loss(t: Any) -> bool:
    return type(t).compute_loss is not Trainer.compute_loss


def loss_refusal(t: Any) -> str | None:
    """Why ghost clipping of a sequence-classification loss cannot honour this set-up, or None. Ghost clipping needs
    each example's loss as a vector (``criterion`` on the logits); the Trainer's ``compute_loss`` returns the batch's
    scalar, so an override or ``compute_loss_func`` would be bypassed (hooks / functorch call them)."""
    if t.args.grad_sample_mode != "ghost" or t.task in ("causal_lm", "token_classification"):
        return None
    if _overrides_compute_loss(t) or t.compute_loss_func is not None:
        what = f"an overridden {type(t).__name__}.compute_loss" if _overrides_compute_loss(t) else "compute_loss_func"
        return (
            f"{what} under ghost clipping: ghost clipping needs each example's loss, which DPTrainer computes "
            "with criterion= on the logits, so it would bypass it. Pass criterion= (a per-example loss with a "
            "'reduction' attribute), or use grad_sample_mode='hooks'."
        )
    if t.criterion is not None and t.args.label_smoothing_factor:
        return (
            "label_smoothing_factor with a criterion under ghost clipping: DPTrainer applies label smoothing "
            "only to its default criterion; smooth in your criterion (e.g. nn.CrossEntropyLoss(label_smoothing=.."
            ")) and drop label_smoothing_factor."
        )
    head = None if t.criterion is not None else _head_ghost_cannot_train(t)
    if head is not None:
        return (
            f"{head} under ghost clipping: its default per-example loss is softmax cross-entropy on the logits, "
            "not this model's own loss. Use grad_sample_mode='hooks' (the model's own loss, per example), or pass "
            "criterion= a loss for this head with a 'reduction' attribute whose reduction='none' output is one value "
            "per example (shape (batch,); nn.BCEWithLogitsLoss gives (batch, labels): average over dim 1)."
        )
    return None


def _head_ghost_cannot_train(t: Any) -> str | None:
    """The sequence-classification head whose loss is not cross-entropy over classes (Hugging Face's choice from
    ``config.problem_type``, ``num_labels`` and the labels' dtype), or None."""
    model = t.model.get_base_model() if hasattr(t.model, "get_base_model") else t.model
    config = getattr(model, "config", None)
    problem, num_labels = getattr(config, "problem_type", None), getattr(config, "num_labels", None)
    if problem == "multi_label_classification":
        return "a multi-label head (problem_type='multi_label_classification')"
    if problem == "regression" or (problem is None and num_labels == 1):
        return "a regression head (problem_type='regression', or num_labels=1)"
    if problem not in (None, "single_label_classification"):
        return f"problem_type={problem!r}"
    if _float_labels(t):
        return "float labels with problem_type unset (the model's own loss is then multi-label BCE, or MSE)"
    return None


def _float_labels(t: Any) -> bool:
    """Whether the training set's labels are floats: from a ``datasets.Dataset``'s features, else its first record."""
    data = t.train_dataset
    if data is None or not has_length(data) or len(data) == 0:
        return False
    names = [*(t.label_names or []), "labels", "label", "label_ids"]
    features = getattr(data, "features", None)
    if isinstance(features, Mapping):
        return any(_is_float(_feature_dtype(features[n])) for n in names if n in features)
    record = data[0]
    return isinstance(record, Mapping) and any(_is_float(record[n]) for n in names if n in record)


def _feature_dtype(feature: Any) -> str:
    while hasattr(feature, "feature"):  # a datasets List / Sequence of values
        feature = feature.feature
    return str(getattr(feature, "dtype", ""))


def _is_float(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith(("float", "bfloat"))
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, np.ndarray | np.generic):
        return value.dtype.kind == "f"
    if isinstance(value, list | tuple):
        return bool(value) and _is_float(value[0])
    return isinstance(value, float)


def check_run_length(max_steps: int, num_train_epochs: float) -> None:
    """Refuse a run of zero optimizer steps (``max_steps=0``, or ``num_train_epochs=0`` without ``max_steps``)."""
    if max_steps == 0 or (max_steps < 0 and num_train_epochs <= 0):
        raise ValueError(
            f"DPTrainer cannot train with max_steps={max_steps}, num_train_epochs={num_train_epochs}: a run of 0 "
            "steps (the noise multiplier is calibrated and the budget checked for the run's steps, while transformers "
            "would still take "
            "one). Set max_steps >= 1, or max_steps=-1 and num_train_epochs > 0."
        )


def check_train_dataset(dataset: Any) -> None:
    """Refuse a training set without a length (Poisson sampling draws from all of it) or without examples."""
    if isinstance(dataset, IterableDataset) or not has_length(dataset):
        raise ValueError("DPTrainer needs a dataset with a length: Poisson sampling draws from all of it")
    if len(dataset) == 0:
        raise ValueError(
            "DPTrainer cannot train on an empty train_dataset (0 examples): Poisson sampling needs at "
            "least one record to draw from; check the dataset's split and filters"
        )
