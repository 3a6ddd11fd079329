"""The clients' training losses: mean cross-entropy of a classifier on a batch ``(*inputs, labels)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Batch", "LossFn", "NamedInputsLoss", "sequence_classification_loss"]

Batch = Sequence[torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def sequence_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of an HF sequence classifier on ``(input_ids, attention_mask, token_type_ids, labels)``
    (``token_type_ids`` optional: a 3-tuple is ``(input_ids, attention_mask, labels)``)."""
    if len(batch) == 4:
        ids, mask, types, labels = batch
        logits = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    elif len(batch) == 3:
        ids, mask, labels = batch
        logits = model(input_ids=ids, attention_mask=mask).logits
    else:
        raise ValueError(f"expected a batch of 3 or 4 tensors, got {len(batch)}")
    return nn.functional.cross_entropy(logits, labels)


@dataclass(frozen=True)
class NamedInputsLoss:
    """``loss_fn`` for a batch ``(*inputs, labels)`` whose inputs are passed by keyword ``input_names``
    (e.g. ``("inputs_embeds", "attention_mask")`` for a frozen-bottom BERT top (``dp_bench.frozen.BertTop``)):
    mean cross-entropy of ``model(**inputs).logits``."""

    input_names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        *inputs, labels = batch
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"expected {len(self.input_names)} inputs {self.input_names} + labels, got {len(batch)} tensors"
            )
        logits = model(**dict(zip(self.input_names, inputs, strict=True))).logits
        return nn.functional.cross_entropy(logits, labels)
