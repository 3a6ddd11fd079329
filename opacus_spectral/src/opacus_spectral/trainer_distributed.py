"""``DPTrainer`` across processes (``torchrun`` / DDP; ``docs/trainer.md``, "Across processes").

Opacus' distributed DP-SGD, driven by the Trainer (``docs/upstream.md`` §1.2, §1.3):

* sampling: each rank draws Poisson batches from its shard of the dataset at the one-process rate q
  (:class:`LockstepPoissonSampler`, Opacus' ``DistributedUniformWithReplacementSampler`` that also yields empty
  batches), so the union over ranks is a Poisson sample of the whole dataset at rate q;
* the model is wrapped in Opacus' ``DPDDP`` (parameters broadcast from rank 0, no gradient hooks), never in torch
  DDP: DDP's all-reduce of the clean ``p.grad`` would run besides Opacus' own, and it needs every rank to run a
  backward (an empty Poisson batch skips it) and every parameter to get a gradient (LA-LoRA freezes factors);
* ``make_private`` sees ``DPDDP`` and builds the distributed optimizer: rank 0 alone adds the noise, the
  gradients are summed over ranks and divided by the expected batch (per rank) times the world size, and the
  denoisers run after that all-reduce, on the same gradient on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch import nn

__all__ = ["LockstepPoissonSampler", "check_evaluation", "is_distributed", "rank_wrapper", "unsupported_parallelism"]

EVALUATION = (
    "a causal LM's evaluation across processes: DPTrainer's per-token eval_loss would sum this rank's tokens only, "
    "over batches in which accelerate repeats examples to even out the ranks. Evaluate in one process (a Trainer or "
    "DPTrainer on the saved adapter, without torchrun), or set eval_strategy='no' for the distributed run."
)


def is_distributed(trainer: Any) -> bool:
    """Whether the Trainer runs in several processes (``torchrun``, ``accelerate launch``)."""
    return trainer.args.world_size > 1


class LockstepPoissonSampler(DistributedUniformWithReplacementSampler):
    """Opacus' distributed Poisson sampler, yielding every batch — an empty one too — as a list of indices.

    Upstream skips a rank's empty batch, so that rank would take fewer steps than the others and the collective
    all-reduce of the next step would pair different steps (or hang). Here every rank yields ``len(self)``
    batches; an empty one is a DP step with noise only, as in one process.
    """

    def __init__(self, *, total_size: int, sample_rate: float, generator: torch.Generator | None) -> None:
        super().__init__(total_size=total_size, sample_rate=sample_rate, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:  # the public split of Opacus' sampler: a permutation seeded by the epoch
            split = torch.Generator().manual_seed(self.shuffle_seed + self.epoch)
            order = torch.randperm(self.total_size, generator=split)
        else:
            order = torch.arange(self.total_size)
        shard = order[self.rank : self.total_size : self.num_replicas]
        for _ in range(self.num_batches):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield shard[mask].tolist()


def check_evaluation(trainer: Any) -> None:
    """Refuse what :meth:`DPTrainer.evaluation_loop` cannot compute across processes (:data:`EVALUATION`)."""
    if trainer.task == "causal_lm" and is_distributed(trainer):
        raise ValueError(f"DPTrainer cannot run {EVALUATION}")


def rank_wrapper(model: nn.Module) -> nn.Module:
    """Opacus' ``DPDDP`` around ``model`` (broadcasts its parameters from rank 0, forwards to it)."""
    return DPDDP(model)


def unsupported_parallelism(trainer: Any) -> str | None:
    """Why the Trainer's multi-process set-up cannot run DP-SGD, or ``None`` when it can (plain data parallel)."""
    deepspeed = trainer.is_deepspeed_enabled or bool(trainer.args.deepspeed)
    fsdp = trainer.is_fsdp_enabled or bool(trainer.args.fsdp)  # the arguments too: accelerate on CPU drops FSDP
    if deepspeed or fsdp:
        kind = "DeepSpeed" if deepspeed else "FSDP"
        return (
            f"{kind}: it shards and reduces the gradients itself, so Opacus never sees each example's whole gradient "
            "to clip it. Use data parallel instead: torchrun --nproc_per_node N your_script.py (no DeepSpeed / FSDP "
            "config); DPTrainer then runs Opacus' distributed DP-SGD."
        )
    if trainer.is_distributed_loading_by_transformers:
        return (
            "a model sharded at load time (tp_plan / distributed_config): its parameters are DTensor shards that "
            "Opacus cannot clip per example. Load the model whole on every rank and run data parallel (torchrun)."
        )
    return None
