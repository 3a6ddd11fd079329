"""Poisson logical batches as a fixed number of physical batches, for training loops that accumulate a fixed
number of micro-batches per optimizer step (the HF ``Trainer``'s ``gradient_accumulation_steps``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class PhysicalBatches(Sampler[list[int]]):
    """Each Poisson logical batch of ``logical`` as exactly ``k`` physical batches (sizes ⌊n·j/k⌋ apart).

    The Trainer's accumulation loop takes a fixed number of micro-batches per optimizer step; BatchMemoryManager's
    variable count (at most ``max_physical_batch_size`` examples each) would desynchronize it. The last physical
    batch is empty only when the whole logical batch is.
    """

    def __init__(self, logical: Sampler[list[int]], k: int) -> None:
        self.logical, self.k = logical, int(k)

    def __len__(self) -> int:
        return len(self.logical) * self.k  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.logical:
            n = len(batch)
            bounds = [n * j // self.k for j in range(self.k + 1)]
            for j in range(self.k):
                yield list(batch[bounds[j] : bounds[j + 1]])


class EmptyAwareCollate:
    """The user's collator; an empty physical batch becomes a collated example cut to zero rows (right keys,
    shapes and dtypes, no data) — HF models cannot run a forward pass on it, so training_step skips it."""

    def __init__(self, collate: Any, dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, examples: list[Any]) -> Any:
        if examples:
            return self.collate(examples)
        return _zero_rows(self.collate([self.dataset[0]]))


def _zero_rows(batch: Any) -> Any:
    if torch.is_tensor(batch):
        return batch[:0]
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: _zero_rows(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_zero_rows(v) for v in batch)
    return batch


def batch_size(inputs: Any) -> int | None:
    """The leading dimension of the first tensor in a batch (None: no tensor)."""
    values = inputs.values() if hasattr(inputs, "values") else inputs
    for v in values:
        if torch.is_tensor(v) and v.dim() > 0:
            return int(v.shape[0])
    return None
