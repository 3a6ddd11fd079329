"""Cyclic Poisson sampling, the sampler of banded MF (``docs/mechanisms.md``; arXiv 2306.08153, Thm 4–5).

The records are split once into b groups, each record's group drawn independently and uniformly from a partition
seed (record i's group depends on the seed and i only, not on the number of records); step t Poisson-samples group
t mod b at rate p = b·B/N, so a step's expected batch is B. The partition is kept for the whole run (the seed is saved
with the DP state, so a resumed run and every DDP rank use the same groups), while the per-step draws stay fresh (the
sampler generator). Adjacency: the ε holds for adding or removing a record (Opacus') while the assignment is unknown
to the adversary, as a Poisson sample is — the seed is drawn from OS entropy unless ``noise_seed`` derives it, and it
is in the checkpoints, which are therefore as private as the data; with the assignment known it holds for zero-out
adjacency (a record replaced by one that adds nothing). Independent groups are what add/remove needs: a permutation
of N dealt into equal groups would regroup every other record when one is added (jax_privacy's ``EQUAL_SPLIT`` is
for zero-out and replace-one adjacency only, its ``INDEPENDENT`` for add/remove).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["CyclicPoissonSampler", "group_labels", "partition", "partition_digest"]

#: records whose groups one generator draws: record i's group is draw i mod CHUNK of generator ⌊i / CHUNK⌋
CHUNK = 1 << 16


def group_labels(num_samples: int, groups: int, seed: int) -> torch.Tensor:
    """Each record's group, i.i.d. uniform on {0, …, b − 1}; record i's depends on (``seed``, i) only."""
    labels = []
    for start in range(0, num_samples, CHUNK):
        tag = f"{int(seed)}/cyclic-groups/{start // CHUNK}".encode()
        chunk_seed = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "big") >> 1
        draw = torch.randint(groups, (CHUNK,), generator=torch.Generator().manual_seed(chunk_seed))
        labels.append(draw[: min(CHUNK, num_samples - start)])
    return torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)


def partition(num_samples: int, groups: int, seed: int) -> list[torch.Tensor]:
    """The b groups of record indices, each in ascending order (:func:`group_labels`; their sizes are binomial). One
    group is every record in order, so that b = 1 draws exactly Opacus' Poisson sample."""
    if groups == 1:
        return [torch.arange(num_samples)]
    labels = group_labels(num_samples, groups, seed)
    order = torch.argsort(labels, stable=True)  # ascending indices within each group
    return list(torch.split(order, torch.bincount(labels, minlength=groups).tolist()))


def partition_digest(parts: list[torch.Tensor]) -> str:
    """A digest of the groups (what a resume compares: the same seed must rebuild the same groups)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


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
        #: where the next iterator created records its draws (set by the DP loader around creating one)
        self.next_draws: Any = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        """The epoch's batches; each one's global step appended, as it is drawn, to the ``next_draws`` the DP loader
        set before creating the iterator that runs this one (read when it starts drawing)."""
        draws = self.next_draws
        for _ in range(self.steps_per_epoch):
            rank, world = self.shard
            group = self.parts[self.step % self.groups][rank::world]
            mask = torch.rand(len(group), generator=self.generator) < self.sample_rate
            if draws is not None:
                draws.append(self.step)
            self.step += 1
            yield group[mask].tolist()
