"""``DPTrainer``'s batch-independence check and its left-padding fix (``docs/trainer.md``, "Batch independence";
the comparisons: :mod:`~opacus_spectral.doctor.batch_independence`).

``DPTrainer`` owns the loss, so it compares per-example *gradients*: before the first DP step it takes the dataset's
first records (the longest of the first 64 and up to three strictly shorter ones), collates them with the Trainer's
collator once with and once without the longest, and compares the remaining records' gradients of their own losses
(causal LM, token classification; as one weighted sum, one backward pass per batch) — or their logits, for sequence
classification, whose loss is the model's — in eval mode (no dropout), with Opacus' per-sample hooks off and under a
forked RNG (training is bit-identical with and without the check).

Left padding: a model that numbers positions ``0 … T−1`` whatever the padding (GPT-2, BERT) gives each left-padded
record positions shifted by the padding that the longest record forced. When the check finds a difference on a
left-padded batch, it tries again with ``position_ids = cumsum(attention_mask) − 1`` (each record's positions over
its own tokens — the positions it has unpadded); if that removes the difference, every training and evaluation batch
gets those ``position_ids`` (``DPTrainer.position_ids_from_mask``). Models that already number positions from the
mask (RoPE models with a mask, RoBERTa, OPT) pass the first comparison and are left alone.
"""

from __future__ import annotations

import inspect
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..doctor.batch_check import CANDIDATES, autocast_dtypes, quiet_forward
from ..doctor.batch_independence import (
    CAUSES,
    Comparison,
    compare_gradients,
    compare_outputs,
    left_padded,
    positions_from_mask,
    split_records,
    tolerance,
)
from ..errors import BatchCheckWarning, BatchDependenceError
from ..step.grad_sample import without_full_backward_hook_warning
from .loss import example_losses

__all__ = ["TrainerBatchCheck", "with_positions"]


def with_positions(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` plus ``position_ids`` from the attention mask when the batch is left padded (and has none)."""
    mask = inputs.get("attention_mask")
    if mask is None or "position_ids" in inputs or mask.dim() != 2 or not left_padded(mask):
        return inputs
    return {**inputs, "position_ids": positions_from_mask(mask)}


def _takes_position_ids(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "position_ids" in inspect.signature(base.forward).parameters


class TrainerBatchCheck:
    """One run of the check for a ``DPTrainer``: ``run()`` returns whether batches need ``position_ids``."""

    def __init__(self, trainer: Any, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.trainer, self.dataset, self.collate = trainer, dataset, collate
        self.outcome: Comparison | None = None
        self.seconds: float | None = None

    def run(self) -> bool:
        """Compare; raise :class:`BatchDependenceError` (``batch_check="raise"``) on a difference."""
        start = time.perf_counter()
        try:
            n = len(self.dataset)  # records drawn over the whole dataset (OS entropy), not its head
            items = [self.dataset[i] for i in sorted(random.SystemRandom().sample(range(n), min(n, CANDIDATES)))]
            chosen = split_records(items, self.collate)
            if chosen is None:
                return False
            records, dropped = chosen
            batches = [self.collate(records), self.collate(records[:dropped] + records[dropped + 1 :])]
            batches = [self.trainer._prepare_inputs(b) for b in batches]
            if self.trainer.task in ("causal_lm", "token_classification") and "labels" not in batches[0]:
                return False  # the first training step refuses the batch, saying what is missing
            self.outcome = self._compare(batches, dropped, positions=False)
            if self.outcome.independent is False and self._can_fix(batches[0]):
                fixed = self._compare(batches, dropped, positions=True)
                if fixed.independent:
                    self.outcome = fixed
                    return True
            if self.outcome.independent is False:
                self._fail()
            return False
        finally:
            self.seconds = time.perf_counter() - start

    def _can_fix(self, batch: dict[str, Any]) -> bool:
        mask = batch.get("attention_mask")
        return mask is not None and left_padded(mask) and _takes_position_ids(self.trainer.model)

    def _compare(self, batches: list[dict[str, Any]], dropped: int, *, positions: bool) -> Comparison:
        t = self.trainer
        per_example = t.task in ("causal_lm", "token_classification")
        results, dtypes = [], []
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            inputs = with_positions(inputs) if positions else inputs
            with quiet_forward(t.model, t._hooks), t.compute_loss_context_manager():
                with torch.set_grad_enabled(per_example):
                    out = t.model(**inputs)
                    logits = out["logits"] if hasattr(out, "keys") else out[0]
                    dtypes.append(logits.dtype)
                    if per_example:
                        results.append(self._gradients(logits, batch, dropped if batch is batches[0] else None))
                    else:
                        results.append(logits.detach())
        # bf16=True: accelerate runs the forward under autocast inside the model call and returns float32 logits
        autocast = [torch.bfloat16] if t.args.bf16 else autocast_dtypes(next(t.model.parameters()).device.type)
        tol = tolerance(dtypes + autocast)
        if per_example:
            return compare_gradients([results[0]], [results[1]], tol)
        masks = (batches[0].get("attention_mask"), batches[1].get("attention_mask"))
        return compare_outputs(results[0], results[1], dropped=dropped, masks=masks, tol=tol)

    def _gradients(self, logits: torch.Tensor, batch: dict[str, Any], dropped: int | None) -> torch.Tensor:
        """The gradient of ``Σ_r w_r · loss_r`` over the remaining records (``w_r = r + 1`` in the order they share
        in both batches): one backward pass per batch. Equal per-example gradients give equal sums; a changed one
        changes it (unless the changes cancel exactly under these weights — a set of measure zero)."""
        losses = example_losses(self.trainer.task, logits, batch["labels"], batch.get("attention_mask"))
        keep = [r for r in range(losses.shape[0]) if r != dropped]
        weights = torch.arange(1, len(keep) + 1, dtype=losses.dtype, device=losses.device)
        params = [p for p in self.trainer._dp.params if p.requires_grad]
        with without_full_backward_hook_warning():  # the audit's own backward: not the user's to see
            grads = torch.autograd.grad((losses[keep] * weights).sum(), params, allow_unused=True)
        return torch.cat(
            [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
        )

    @property
    def _compared(self) -> str:
        per_example = self.trainer.task in ("causal_lm", "token_classification")
        return "per-example gradient" if per_example else "logits"

    def _fail(self) -> None:
        assert self.outcome is not None
        text = (
            f"DPTrainer's batch independence check failed: a record's {self._compared} changed when the longest "
            "record of its batch was removed and the rest re-collated by the data collator"
            f"{' (' + self.outcome.note + ')' if self.outcome.note else ''}. Each record's clipped gradient then "
            "depends on which other records were sampled, so one record can move the clipped sum by more than "
            "per_sample_max_grad_norm and the privacy guarantee is void. " + CAUSES
        )
        if self.trainer.args.batch_check == "raise":
            raise BatchDependenceError(text)
        warnings.warn(text, BatchCheckWarning, stacklevel=4)
