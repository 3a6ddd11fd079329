"""What a ``DPTrainer`` trains: the task, each example's loss in every grad-sample mode, and a causal LM's
evaluation loss (``docs/llm.md``, ``docs/trainer.md``).

Three tasks, told apart once, before training (:func:`resolve_task`):

* ``"causal_lm"`` — next-token prediction: ``labels`` (batch, seq_len) are the unshifted ids, position t
  predicts ``labels[:, t+1]``; each example's loss is :func:`~opacus_spectral.losses.per_sequence_loss`;
* ``"token_classification"`` — one label per position, no shift; each example's loss is the mean over its own
  labelled positions (:func:`token_example_loss`);
* ``"sequence_classification"`` — one label per example: the model's own loss (hooks / functorch; Opacus
  recovers per-example gradients from the batch mean) or ``criterion`` on the logits (ghost).

For the first two the model is called *without* ``labels``: Hugging Face averages token losses over all the
tokens of the batch, which couples the examples (``docs/llm.md``, "Why the loss matters"); the Trainer's
``num_items_in_batch`` (a token count of the sampled batch) is never used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..losses import IGNORE_INDEX, next_token_targets, per_sequence_loss

__all__ = [
    "TASKS",
    "example_losses",
    "ghost_criterion",
    "next_token_loss_sum",
    "opacus_loss",
    "resolve_task",
    "task_of_batch",
    "token_example_loss",
]

TASKS = ("causal_lm", "token_classification", "sequence_classification")
_PEFT_TASKS = {"CAUSAL_LM": "causal_lm", "TOKEN_CLS": "token_classification", "SEQ_CLS": "sequence_classification"}


def _class_task(name: str) -> str | None:
    from transformers.models.auto import modeling_auto as auto

    tables = (
        (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal_lm"),
        (auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "token_classification"),
        (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "sequence_classification"),
    )
    for table, task in tables:
        if name in set(table.values()):
            return task
    return None


def _peft_task(model: nn.Module) -> str | None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else next(iter(configs.values()), None)
    task_type = getattr(config, "task_type", None)
    return _PEFT_TASKS.get(getattr(task_type, "value", task_type))


def resolve_task(model: nn.Module | None, task: str | None) -> str | None:
    """``task`` when given; otherwise the PEFT adapter's ``task_type`` and the base model's class (a Hugging Face
    ``*ForCausalLM``, ``*ForTokenClassification`` or ``*ForSequenceClassification``); ``None`` when neither says.
    Two sources that disagree raise ``ValueError``."""
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS} or None (detect it from the model), got {task!r}")
        return task
    if model is None:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    found = {"PEFT task_type": _peft_task(model), name: _class_task(name)}
    found = {source: t for source, t in found.items() if t is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"the model's task is ambiguous ({found}); pass DPTrainer(task=...) with one of {TASKS}")
    return next(iter(found.values()), None)


def task_of_batch(labels: torch.Tensor | None) -> str:
    """The task of a model :func:`resolve_task` could not place, from its labels: one label per example is
    sequence classification; token-level integer labels are refused (next-token or per-position?)."""
    if labels is not None and labels.dim() > 1 and not labels.is_floating_point():
        raise ValueError(
            f"token-level labels ({labels.dim()} dimensions) for a model whose task DPTrainer cannot tell: pass "
            "DPTrainer(task='causal_lm') (next-token prediction, labels shifted by one) or "
            "task='token_classification' (one label per position). Each example's loss is then its own mean over "
            "its tokens, never the model's mean over the batch's tokens (which couples the examples)."
        )
    return "sequence_classification"


def token_example_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """(batch,) float32: each example's cross-entropy averaged over its own labelled, unpadded positions
    (no shift; 0 for an example without any)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"token classification pairs logits (batch, seq_len, classes) with labels (batch, seq_len); got logits of "
            f"{logits.dim()} dimensions and labels of {labels.dim()} whose (batch, seq_len) differ (the shapes are "
            "not shown: they come from the sampled batch)"
        )
    targets = labels if attention_mask is None else labels.masked_fill(attention_mask == 0, ignore_index)
    batch, steps, classes = logits.shape
    token = F.cross_entropy(
        logits.float().reshape(batch * steps, classes), targets.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(batch, steps)
    return token.sum(dim=1) / (targets != ignore_index).sum(dim=1).clamp(min=1)


def example_losses(task: str, logits: torch.Tensor, labels: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """The (batch,) per-example losses of a causal-LM or token-classification batch."""
    if task == "causal_lm":
        return per_sequence_loss(logits, labels, attention_mask)
    return token_example_loss(logits, labels, attention_mask)


def next_token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """(sum of the next-token cross-entropies over every target of the batch, float64; the number of targets):
    summed over batches and divided, the per-token mean of an evaluation set."""
    targets = F.pad(next_token_targets(labels, attention_mask), (0, 1), value=IGNORE_INDEX)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total.double(), int((targets != IGNORE_INDEX).sum())


def ghost_criterion(label_smoother: Any = None) -> nn.Module:
    """Ghost clipping's default per-example loss: cross-entropy, label-smoothed as the Trainer's ``LabelSmoother``
    (``TrainingArguments.label_smoothing_factor``) smooths the model's loss under hooks / functorch."""
    return nn.CrossEntropyLoss(label_smoothing=float(getattr(label_smoother, "epsilon", 0.0)))


def opacus_loss(losses: torch.Tensor, *, loss_reduction: str, ghost_criterion: Any = None) -> Any:
    """What ``backward()`` is called on: under ghost clipping the vector in Opacus'
    ``DPTensorFastGradientClipping`` (of the criterion ``make_private`` returned), else its mean (``loss_reduction
    ="mean"``: Opacus rescales per-sample gradients by the batch size) or sum; an empty batch gives 0."""
    if ghost_criterion is not None:
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        c = ghost_criterion
        return DPTensorFastGradientClipping(c.module, c.optimizer, losses, c.loss_reduction)
    return losses.sum() / max(losses.numel(), 1) if loss_reduction == "mean" else losses.sum()
