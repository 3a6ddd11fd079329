"""The per-example causal-LM loss: each sequence's token losses averaged over that sequence's own tokens.

Hugging Face causal LMs (``model(..., labels=...)``) average the token losses over *all* target tokens of
the batch. Under DP-SGD one example's gradient is then scaled by ``its tokens / the batch's tokens``: it
depends on the other examples' lengths, and adding, removing or lengthening one example changes every
other example's contribution to the clipped sum, whose sensitivity is then no longer bounded by the
clipping norm C. Here example i's loss is ``l_i = sum_t CE(i, t) / n_i`` over its own ``n_i`` targets
(0 when it has none), so its gradient is a function of example i alone and the clipped sum changes by at
most C between neighbouring batches (``tests/opacus_spectral/test_causal_lm_loss.py`` checks it in hooks, functorch and
ghost modes, and that it fails for the batch-token mean).

* :func:`per_sequence_loss` — the vector ``(l_1, ..., l_B)``; the one implementation.
* :func:`causal_lm_loss` — its batch reduction for ``grad_sample_mode`` ``"hooks"`` / ``"functorch"`` /
  ``"ew"``: the mean over the batch for ``loss_reduction="mean"`` (Opacus multiplies per-sample gradients by
  the batch size, so each is ``grad l_i``), the sum for ``"sum"``.
* :func:`ghost_causal_lm_loss` — for ``grad_sample_mode="ghost"``: the vector wrapped in Opacus'
  ``DPTensorFastGradientClipping`` (``loss.backward()`` runs both ghost-clipping passes).

Usage and the comparison with Opacus' own per-sequence averaging: ``docs/llm.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum")


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if logits.dim() != 3:
        raise ValueError(
            f"logits must be (batch, seq_len, vocab), got shape {tuple(logits.shape)}; pass model(...).logits "
            "unflattened"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels must be (batch, seq_len) = {tuple(logits.shape[:2])} like the logits, got {tuple(labels.shape)}; "
            "pass the unshifted labels (usually input_ids): the shift happens here"
        )
    if attention_mask is not None and attention_mask.shape != labels.shape:
        raise ValueError(
            f"attention_mask must have the labels' shape {tuple(labels.shape)}, got {tuple(attention_mask.shape)}"
        )


def next_token_targets(
    labels: torch.Tensor, attention_mask: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """(batch, seq_len - 1) targets: ``labels[:, 1:]``, with ``ignore_index`` where either the target or the
    position predicting it is padding (``attention_mask == 0``). A length-1 sequence has no target."""
    targets = labels[:, 1:].clone()
    if attention_mask is not None:
        valid = (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)
        targets[~valid] = ignore_index
    return targets


def per_sequence_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """(batch,) float32 losses: each sequence's next-token cross-entropy averaged over its own targets.

    ``logits`` (batch, seq_len, vocab) come from the model unshifted; ``labels`` (batch, seq_len) are the
    unshifted token ids with ``ignore_index`` (-100) where no loss is wanted (prompt, padding); padding in
    ``attention_mask`` is masked as well. A sequence without targets (all -100, all padding, length 1)
    gets loss 0 and a zero gradient, never NaN. Computed in float32 whatever the logits' dtype.
    """
    _check_shapes(logits, labels, attention_mask)
    targets = next_token_targets(labels, attention_mask, ignore_index=ignore_index)
    # the last position predicts nothing: pad the targets rather than slice the logits (no (B, T, V) copy)
    targets = F.pad(targets, (0, 1), value=ignore_index)
    batch, steps, vocab = logits.shape
    token_losses = F.cross_entropy(
        logits.float().reshape(batch * steps, vocab), targets.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(batch, steps)
    counts = (targets != ignore_index).sum(dim=1).clamp(min=1)
    return token_losses.sum(dim=1) / counts


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Scalar loss for Opacus' hooks / functorch / ew modes: the mean (``reduction="mean"``) or sum of
    :func:`per_sequence_loss` over the batch. ``reduction`` must equal the ``loss_reduction`` given to
    ``make_private`` (default ``"mean"``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS} (Opacus' loss_reduction), got {reduction!r}")
    losses = per_sequence_loss(logits, labels, attention_mask, ignore_index=ignore_index)
    # an empty (Poisson) batch gives 0, not the NaN of an empty mean
    return losses.sum() / max(losses.numel(), 1) if reduction == "mean" else losses.sum()


def ghost_causal_lm_loss(
    criterion: Any,
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> Any:
    """For ``grad_sample_mode="ghost"``: :func:`per_sequence_loss` as Opacus' ``DPTensorFastGradientClipping``.

    ``criterion`` is the ``DPLossFastGradientClipping`` that ``make_private(..., criterion=...)`` returned in
    ghost mode; its module, optimizer and ``loss_reduction`` are reused, so ``loss.backward()`` runs the
    two ghost-clipping passes and the clipped sum lands in ``p.grad``.
    """
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping, DPTensorFastGradientClipping

    if not isinstance(criterion, DPLossFastGradientClipping):
        raise TypeError(
            f"criterion must be the DPLossFastGradientClipping returned by make_private(..., "
            f"grad_sample_mode='ghost', criterion=...), got {type(criterion).__name__}; in hooks / functorch "
            "modes use causal_lm_loss"
        )
    losses = per_sequence_loss(logits, labels, attention_mask, ignore_index=ignore_index)
    return DPTensorFastGradientClipping(criterion.module, criterion.optimizer, losses, criterion.loss_reduction)
