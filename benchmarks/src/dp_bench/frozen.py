"""Frozen-bottom split of a BERT sequence classifier: precompute the bottom layers once, train the top.

When the bottom ``k`` encoder layers (and the embeddings) are frozen and carry no adapter, their output
for a training example never changes. Computing it once (:func:`encode_bottom`) and training
:class:`BertTop` — encoder layers ``k..``, the pooler and the classification head, fed those hidden states
— gives the same logits as the full model (checked by :func:`split_error`) for ``k/n`` of the compute
per step. PEFT wraps :class:`BertTop` like any Hugging Face model (its ``config`` is the BERT config and
its head is called ``classifier``, so ``task_type="SEQ_CLS"`` trains it), and Opacus computes per-example
gradients of the top layers only.

One difference from training the full model: the bottom layers run in eval mode, so their dropout is
off (the top layers keep theirs in train mode).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["POOLINGS", "BertTop", "bert_attention_mask", "encode_bottom", "split_error", "trim_padding"]


def bert_attention_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The attention mask in the form the model's attention implementation expects (as ``BertModel``
    builds it from a ``[batch, seq]`` 0/1 mask)."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)


def _bert(seq_cls: nn.Module) -> nn.Module:
    bert = getattr(seq_cls, "bert", None)
    if bert is None or not hasattr(bert, "encoder") or not hasattr(seq_cls, "classifier"):
        raise TypeError(f"expected a BertForSequenceClassification-like model, got {type(seq_cls).__name__}")
    return bert


def _check_k(bert: nn.Module, k: int) -> int:
    n = len(bert.encoder.layer)
    if isinstance(k, bool) or int(k) != k or not 1 <= k < n:
        raise ValueError(f"frozen layers must be an integer in [1, {n - 1}] for this {n}-layer model, got {k!r}")
    return int(k)


@torch.no_grad()
def encode_bottom(
    seq_cls: nn.Module,
    k: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_type_ids: torch.Tensor | None = None,
    *,
    batch_size: int = 256,
    progress: bool = False,
) -> torch.Tensor:
    """Hidden states after encoder layer ``k - 1`` (embeddings + layers ``0..k-1``, eval mode, no grad),
    ``[n, seq, hidden]`` float32 on the CPU. The model's train/eval mode is restored afterwards."""
    from tqdm.auto import tqdm

    bert = _bert(seq_cls)
    k = _check_k(bert, k)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    was_training = seq_cls.training
    seq_cls.eval()
    out = []
    try:
        starts = range(0, input_ids.shape[0], batch_size)
        for s in tqdm(starts, desc=f"encode layers 0..{k - 1}", disable=not progress, unit="batch"):
            ids = input_ids[s : s + batch_size]
            mask = attention_mask[s : s + batch_size]
            h = bert.embeddings(input_ids=ids, token_type_ids=token_type_ids[s : s + batch_size])
            m = bert_attention_mask(bert.config, h, mask)
            for layer in bert.encoder.layer[:k]:
                h = layer(h, m)
                h = h[0] if isinstance(h, tuple) else h
            out.append(h.float().cpu())
    finally:
        seq_cls.train(was_training)
    if not out:
        return torch.zeros(0, input_ids.shape[1], bert.config.hidden_size)
    return torch.cat(out)


POOLINGS = ("cls", "mean")


def trim_padding(hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden[:, :L]`` and ``attention_mask[:, :L]``, ``L`` = one past the last column that is a valid token in
    some row (at least 1): only columns that are padding in every row are dropped, whatever the padding side."""
    used = attention_mask.bool().any(0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    if length == attention_mask.shape[1]:
        return hidden, attention_mask
    return hidden[:, :length], attention_mask[:, :length]


class BertTop(nn.Module):
    """Encoder layers ``k..`` + pooling + dropout + classifier of a ``BertForSequenceClassification``.

    Called like the full model but with ``inputs_embeds`` = the hidden states after layer ``k - 1`` (from
    :func:`encode_bottom`) and the same ``attention_mask``; returns a ``SequenceClassifierOutput``. It holds
    the full model's own top submodules (no copies), so its LoRA and head weights are the full model's.

    ``trim_padding=True`` drops the trailing columns that are padding in every row of the batch
    (:func:`trim_padding`) before the top layers: the same logits up to float rounding — a padding position is
    masked out of every valid position's attention and out of the pooling — in fewer tokens, which pays when a
    batch holds sequences of similar length (``dp_bench.train.LengthSortedBatches``).

    ``pooling="cls"`` is ``BertForSequenceClassification``'s own head (the pooler's dense + tanh on [CLS]):
    the logits equal the full model's. ``"mean"`` feeds the attention-masked mean of the last hidden states
    — the pooling sentence-transformers models such as all-MiniLM-L6-v2 were trained with — to the same
    dropout and classifier, and leaves the pooler unused.
    """

    def __init__(self, seq_cls: nn.Module, k: int, pooling: str = "cls", trim_padding: bool = False) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        bert = _bert(seq_cls)
        self.k = _check_k(bert, k)
        self.pooling = pooling
        self.config = seq_cls.config
        self.layers = nn.ModuleList(list(bert.encoder.layer[self.k :]))
        self.pooler = bert.pooler if pooling == "cls" else None
        self.dropout = seq_cls.dropout
        self.classifier = seq_cls.classifier
        self.num_labels = int(seq_cls.num_labels)
        self.trim_padding = trim_padding

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **_: Any,
    ) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        if inputs_embeds is None:
            raise ValueError(
                f"BertTop takes inputs_embeds = the hidden states after layer {self.k - 1} (see encode_bottom), "
                "not input_ids"
            )
        hidden = inputs_embeds
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        elif self.trim_padding:
            hidden, attention_mask = trim_padding(hidden, attention_mask)
        mask = bert_attention_mask(self.config, hidden, attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, mask)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.pooling == "mean":
            w = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)
        else:
            pooled = self.pooler(hidden) if self.pooler is not None else hidden[:, 0]
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


@torch.no_grad()
def split_error(
    seq_cls: nn.Module,
    k: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_type_ids: torch.Tensor | None = None,
) -> float:
    """``max |BertTop(encode_bottom(x)) - model(x)|`` over the logits, both in eval mode: the split is exact
    when this is at float rounding level."""
    was_training = seq_cls.training
    seq_cls.eval()
    try:
        tt = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        ref = seq_cls(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=tt).logits
        h = encode_bottom(seq_cls, k, input_ids, attention_mask, tt)
        got = BertTop(seq_cls, k).eval()(inputs_embeds=h, attention_mask=attention_mask).logits
    finally:
        seq_cls.train(was_training)
    return float((ref - got).abs().max())
