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


#: the padding the left-padding probe puts before a record
PROBE_PAD = 3


def _pad_left(value: Any, length: int, fill: int) -> Any:
    """A per-token tensor of a one-record batch ((1, length, ...)) with :data:`PROBE_PAD` entries of ``fill`` before
    it; other values as they are."""
    if not torch.is_tensor(value) or value.dim() < 2 or value.shape[:2] != (1, length):
        return value
    pad = torch.full((1, PROBE_PAD, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
    return torch.cat([pad, value], dim=1)


def _takes_position_ids(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "position_ids" in inspect.signature(base.forward).parameters


class TrainerBatchCheck:
    """One run of the check for a ``DPTrainer``: ``run()`` returns whether batches need ``position_ids``."""

    def __init__(self, trainer: Any, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.trainer, self.dataset, self.collate = trainer, dataset, collate
        self.outcome: Comparison | None = None
        self.seconds: float | None = None
        self.left_padding: str | None = None  #: :meth:`_probe_left_padding`'s finding

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
            self.left_padding = self._probe_left_padding(items[0])
            if self.left_padding == "positions":  # every left-padded batch gets them, whatever this sample is
                self.outcome = self._compare(batches, dropped, positions=True)
                if self.outcome.independent is False:
                    self._fail()
                return True
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

    def _probe_left_padding(self, item: Any) -> str | None:
        """How this model treats a record padded on the left (by hand, with the model's pad token), whatever the
        batches sampled so far: ``"none"`` (its outputs do not change: positions come from the mask or the ids),
        ``"positions"`` (they do, and ``position_ids`` from the mask restore them), ``"couples"`` (nothing restores
        them: a left-padded batch would couple its records) — None when there is nothing to probe."""
        batch = self.trainer._prepare_inputs(self.collate([item]))
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if ids is None or mask is None or ids.dim() != 2 or ids.shape[0] != 1 or not bool(mask.all()):
            return None
        plain = {k: v for k, v in batch.items() if k != "labels"}
        padded = {k: _pad_left(v, ids.shape[1], self._pad_id() if k == "input_ids" else 0) for k, v in plain.items()}
        reference = self._logits(plain)
        if self._close(self._logits(padded), reference):
            return "none"
        if _takes_position_ids(self.trainer.model) and self._close(self._logits(with_positions(padded)), reference):
            return "positions"
        return "couples"

    def check_batch(self, inputs: dict[str, Any]) -> None:
        """Every training batch, once the probe found that no ``position_ids`` restore a left-padded record's outputs
        (``"couples"``): a left-padded batch is refused before its update (warned with ``batch_check="warn"``)."""
        mask = inputs.get("attention_mask")
        if self.left_padding != "couples" or mask is None or mask.dim() != 2 or not left_padded(mask):
            return
        text = (
            "DPTrainer: this batch is left padded, and on this model a record's outputs change with the padding "
            "before it, which no position_ids restore (e.g. a pooler that reads position 0): the padding is set by "
            "the longest record sampled, so one record could move the clipped sum by more than "
            "per_sample_max_grad_norm. Pad on the right (tokenizer.padding_side = 'right'). " + CAUSES
        )
        if self.trainer.args.batch_check == "raise":
            raise BatchDependenceError(text)
        warnings.warn(text, BatchCheckWarning, stacklevel=4)

    def _pad_id(self) -> int:
        """The pad token's id: the tokenizer's, else the model config's, else 0 (masked out either way)."""
        tokenizer = getattr(self.trainer, "processing_class", None)
        config = getattr(self.trainer.model, "config", None)
        for value in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None)):
            if isinstance(value, int):
                return value
        return 0

    def _logits(self, inputs: dict[str, Any]) -> torch.Tensor:
        t = self.trainer
        with quiet_forward(t.model, t._hooks), t.compute_loss_context_manager(), torch.no_grad():
            out = t.model(**inputs)
        return (out["logits"] if hasattr(out, "keys") else out[0]).detach()

    def _close(self, padded: torch.Tensor, plain: torch.Tensor) -> bool:
        """The record's outputs with and without the padding agree within the dtype's tolerance (per-token outputs:
        the padded ones at the record's own positions)."""
        if padded.dim() >= 3 and padded.shape[1] == PROBE_PAD + plain.shape[1]:
            padded = padded[:, PROBE_PAD:]
        if padded.shape != plain.shape:
            return False
        dtypes = [plain.dtype, *autocast_dtypes(plain.device.type)]
        return compare_gradients([plain.flatten()], [padded.flatten()], tolerance(dtypes)).independent is not False

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
