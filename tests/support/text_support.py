"""A tiny random BERT and a learnable synthetic token-classification task for the libraries' tests.

The same tensors and weights as the harness's ``dp_bench.data.synthetic_text_task`` / ``tiny_bert`` /
``tiny_bert_config`` for the same arguments (pinned by ``test_support_equivalence.py``), without importing the
harness: the libraries' tests must run with ``opacus_spectral`` and ``peft_lalora`` installed alone.

(``tiny_models.tiny_bert`` is a different model: 64 positions and the caller's RNG consumed, so other weights.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["PAD_ID", "synthetic_text_task", "tiny_bert", "tiny_bert_config"]

#: Padding token id; ids 1..num_labels are the class trigger tokens, fillers start at num_labels + 1.
PAD_ID = 0

COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def tiny_bert_config(num_labels: int = 2, vocab_size: int = 1000, max_position_embeddings: int = 128) -> Any:
    """``BertConfig``: hidden 32, 2 layers of 2 heads, intermediate 64, padding id :data:`PAD_ID` (54 k parameters
    for 1000 tokens; the module names of all-MiniLM-L6-v2)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        pad_token_id=PAD_ID,
    )


def tiny_bert(num_labels: int = 2, seed: int = 0, vocab_size: int = 1000, max_position_embeddings: int = 128) -> Any:
    """A ``BertForSequenceClassification`` of :func:`tiny_bert_config`, initialized from ``torch.manual_seed(seed)``
    inside a forked CPU RNG (the caller's RNG is untouched), in train mode."""
    from transformers import BertForSequenceClassification

    config = tiny_bert_config(num_labels, vocab_size, max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    return model.train()


def _check(n: int, seq_len: int, min_len: int, triggers: int, num_labels: int, vocab_size: int) -> None:
    if n < 1 or seq_len < 1:
        raise ValueError(f"n and seq_len must be >= 1, got n={n}, seq_len={seq_len}")
    if min_len > seq_len or not 1 <= triggers <= max(1, min_len):
        raise ValueError(f"need 1 <= triggers_per_example ({triggers}) <= min_len ({min_len}) <= seq_len ({seq_len})")
    if vocab_size <= num_labels + 1:
        raise ValueError(f"vocab_size ({vocab_size}) must exceed num_labels + 1 ({num_labels + 1})")


def _draw(n: int, seq_len: int, seed: int, num_labels: int, vocab_size: int, min_len: int, triggers: int) -> dict:
    """The task's arrays, drawn from ``numpy.random.default_rng(seed)`` in a fixed order: labels (a permutation of
    ``i mod num_labels``), lengths, filler tokens, then one uniform key per valid position whose ``triggers``
    smallest mark the positions that get the trigger token ``1 + label``."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % num_labels)
    lengths = rng.integers(min_len, seq_len + 1, size=n)
    tokens = rng.integers(num_labels + 1, vocab_size, size=(n, seq_len))
    valid = np.arange(seq_len)[None, :] < lengths[:, None]
    keys = np.where(valid, rng.random((n, seq_len)), 2.0)  # padding positions sort after every valid one
    chosen = np.argsort(keys, axis=1)[:, :triggers]
    np.put_along_axis(tokens, chosen, (labels + 1)[:, None], axis=1)
    mask = valid.astype(np.int64)
    return {
        "input_ids": np.where(valid, tokens, PAD_ID).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((n, seq_len), dtype=np.int64),
        "label": labels.astype(np.int64),
    }


def synthetic_text_task(
    n: int,
    seq_len: int = 32,
    seed: int = 0,
    *,
    num_labels: int = 2,
    vocab_size: int = 1000,
    min_len: int | None = None,
    triggers_per_example: int = 2,
) -> Any:
    """``n`` token sequences whose class is the trigger token they carry (so 100 % accuracy is reachable), as a
    torch-format ``datasets.Dataset`` with int64 columns ``input_ids``, ``attention_mask``, ``token_type_ids``
    (length ``seq_len``) and a ``ClassLabel`` ``label``.

    Example i: balanced class ``y_i``, length ``L_i`` uniform in [``min_len`` (default ``seq_len // 2``),
    ``seq_len``], fillers uniform in [``num_labels + 1``, ``vocab_size``), ``triggers_per_example`` of its first
    ``L_i`` positions set to ``1 + y_i``, positions from ``L_i`` on :data:`PAD_ID` with attention mask 0.
    """
    import datasets

    min_len = seq_len // 2 if min_len is None else min_len
    _check(n, seq_len, min_len, triggers_per_example, num_labels, vocab_size)
    arrays = _draw(n, seq_len, seed, num_labels, vocab_size, min_len, triggers_per_example)
    row = datasets.Sequence(datasets.Value("int64"), length=seq_len)
    features = datasets.Features({**{c: row for c in COLUMNS}, "label": datasets.ClassLabel(num_classes=num_labels)})
    ds = datasets.Dataset.from_dict(arrays, features=features)
    ds.set_format("torch")
    return ds
