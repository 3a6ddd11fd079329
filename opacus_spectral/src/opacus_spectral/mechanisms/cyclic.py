"""Cyclic Poisson sampling, the sampler of banded MF (``docs/mechanisms.md``; arXiv 2306.08153, Thm 4–5).

The records are split once into b groups of (nearly) equal size by a permutation drawn from a partition seed; step t
Poisson-samples group t mod b at rate p = b·B/N, so a step's expected batch is B. The partition is kept for the whole
run (the seed is saved with the DP state, so a resumed run and every DDP rank use the same groups), while the
per-step draws stay fresh (the sampler generator). The assignment need not be secret: the analysis bounds every
record's privacy whatever group it is in (each record takes part only at the steps of its group, b apart); it must not
depend on the data, which a permutation from a seed does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["CyclicPoissonSampler", "partition"]


def partition(num_samples: int, groups: int, seed: int) -> list[torch.Tensor]:
    """The b groups of record indices, each in ascending order: a permutation from ``seed`` dealt round-robin (sizes
    differ by ≤ 1). One group is every record in order, so that b = 1 draws exactly Opacus' Poisson sample."""
    if groups == 1:
        return [torch.arange(num_samples)]
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(int(seed)))
    return [order[g::groups].sort().values for g in range(groups)]


class CyclicPoissonSampler(Sampler[list[int]]):
    """Batch sampler: ``steps_per_epoch`` batches per pass; the batch of global step t is group t mod b, each of its
    records kept with probability ``sample_rate`` (drawn from ``generator``); under DDP (``shard`` = (rank, world
    size)) a rank keeps only its share of the group, every rank with the same partition. ``step`` is the global step
    of the next batch (a resumed run sets it so that the group cycle continues where it stopped)."""

    def __init__(
        self,
        *,
        num_samples: int,
        groups: int,
        sample_rate: float,
        steps_per_epoch: int,
        partition_seed: int,
        generator: torch.Generator | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"cyclic Poisson sampling needs a rate in (0, 1], got {sample_rate}")
        self.groups, self.sample_rate, self.steps_per_epoch = int(groups), float(sample_rate), int(steps_per_epoch)
        self.partition_seed = int(partition_seed)
        self.parts = partition(num_samples, self.groups, self.partition_seed)
        self.generator = generator
        self.shard = shard  #: (rank, world size): under DDP each rank samples its share of the group
        self.step = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            rank, world = self.shard
            group = self.parts[self.step % self.groups][rank::world]
            mask = torch.rand(len(group), generator=self.generator) < self.sample_rate
            self.step += 1
            yield group[mask].tolist()
