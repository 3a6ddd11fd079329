"""A classifier head that is never trained: its weight and bias are buffers, not parameters.

PEFT's sequence-classification models make every module named ``classifier`` trainable (a
``ModulesToSaveWrapper`` copy whose *parameters* get ``requires_grad``); a :class:`FixedLinear` there has no
parameters, so no optimizer, adapter state or DP engine sees it. With the head fixed at its random
initialization, only the LoRA factors can learn — the setting where LoRA schemes can differ at all.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FixedLinear", "fix_classifier"]


class FixedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` (``[out, in]``) and ``b`` (``[out]``) held as buffers."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
            raise ValueError(
                f"weight must be [out, in] and bias [out], got {tuple(weight.shape)} and "
                f"{None if bias is None else tuple(bias.shape)}"
            )
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, linear: nn.Linear) -> FixedLinear:
        """A fixed copy of ``linear``'s current weight and bias."""
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def fix_classifier(model: nn.Module) -> nn.Module:
    """Replace ``model.classifier`` (an ``nn.Linear``) by its :class:`FixedLinear` copy, in place; returns ``model``."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise TypeError(f"expected a model whose .classifier is an nn.Linear, got {type(head).__name__}")
    model.classifier = FixedLinear.of(head)
    return model
