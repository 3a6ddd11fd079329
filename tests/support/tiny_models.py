"""Tiny random transformer models for tests (no hub access)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification


def tiny_bert(num_labels: int = 2, seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=1000,
        num_labels=num_labels,
        max_position_embeddings=64,
    )
    return BertForSequenceClassification(cfg)


def token_loader(n: int = 64, batch: int = 16, seq: int = 12, seed: int = 0) -> DataLoader:
    """Label = whether token 7 occurs in the sequence (learnable, separable)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (n, seq), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    pos = torch.randint(1, seq, (n,), generator=g)
    ids[labels == 1, pos[labels == 1]] = 7
    return DataLoader(TensorDataset(ids, labels), batch_size=batch)
