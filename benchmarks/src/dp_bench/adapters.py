"""What the centralized text beds train on top of a frozen bottom: LoRA on chosen modules, or full weights."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn

from .frozen import BertTop
from .task import FrozenTextTask

__all__ = ["MODULES", "Trainable", "build_top", "lora_target_regex"]

#: Short names of the Linear modules of a BERT layer (PEFT target suffixes).
MODULES = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "o": "attention.output.dense",
    "i": "intermediate.dense",
    "d": "output.dense",
}


@dataclass(frozen=True)
class Trainable:
    """LoRA (``targets`` = letters of :data:`MODULES`, ``rank``, ``alpha`` — default ``rank``) or full weights."""

    kind: str = "lora"  # "lora" | "full"
    targets: str = "qv"
    rank: int = 8
    alpha: float | None = None

    @property
    def label(self) -> str:
        return "full weights" if self.kind == "full" else f"LoRA r={self.rank} {','.join(self.targets)}"

    @staticmethod
    def parse(spec: str) -> Trainable:
        """``full`` or ``lora:<targets>:<rank>`` (e.g. ``lora:qkvoid:16``)."""
        if spec == "full":
            return Trainable("full")
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] != "lora" or not parts[1] or not set(parts[1]) <= set(MODULES):
            raise ValueError(
                f"trainable spec must be 'full' or 'lora:<subset of {''.join(MODULES)}>:<rank>', got {spec!r}"
            )
        return Trainable("lora", parts[1], int(parts[2]))

    @property
    def spec(self) -> str:
        return "full" if self.kind == "full" else f"lora:{self.targets}:{self.rank}"


def lora_target_regex(layers: range, targets: str) -> str:
    """PEFT ``target_modules`` regex: the ``targets`` modules of the encoder ``layers`` (full-name match)."""
    ids = "|".join(str(i) for i in layers)
    mods = "|".join(re.escape(MODULES[t]) for t in targets)
    return rf".*encoder\.layer\.({ids})\.({mods})"


def build_top(
    task: FrozenTextTask,
    trainable: Trainable,
    seed: int,
    *,
    pooling: str = "mean",
    reinit_head: bool = True,
    trim_padding: bool = False,
) -> nn.Module:
    """A fresh trainable :class:`~dp_bench.frozen.BertTop` (layers ``k..``) on a copy of the base model.

    The global RNG is seeded with ``seed`` and then, in this order, draws the classifier head
    (``reinit_head=True``: normal(0, initializer_range), zero bias) and the LoRA initialization.
    """
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(task.base)
    torch.manual_seed(seed)
    if reinit_head:
        std = float(getattr(model.config, "initializer_range", 0.02))
        nn.init.normal_(model.classifier.weight, 0.0, std)
        nn.init.zeros_(model.classifier.bias)
    if trainable.kind == "full":
        top = BertTop(model, task.k, pooling=pooling, trim_padding=trim_padding)
        for p in top.parameters():
            p.requires_grad_(False)
        for p in list(top.layers.parameters()) + list(top.classifier.parameters()):
            p.requires_grad_(True)
    else:
        cfg = LoraConfig(
            task_type="SEQ_CLS",
            r=trainable.rank,
            lora_alpha=trainable.alpha or trainable.rank,
            lora_dropout=0.0,
            target_modules=lora_target_regex(range(task.k, task.n_layers), trainable.targets),
        )
        top = BertTop(get_peft_model(model, cfg).base_model.model, task.k, pooling=pooling, trim_padding=trim_padding)
    return top.train()
