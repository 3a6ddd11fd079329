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
  denoisers run after that all-reduce, on the same gradient on every rank;
* at the start of training the ranks check among themselves that they hold the same dataset in the same order and
  the same sampling and DP set-up (:func:`check_ranks_agree`): the split into shards assumes it;
* a noise mechanism with cyclic Poisson sampling (``bandmf``): ``make_private`` builds each rank's sampler of its
  share of group t mod b, with rank 0's partition seed on every rank; the ranks then check that they hold the same
  partition seed and step (:func:`mechanism_setup`, after a resume too); rank 0 alone adds the (correlated) noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch import nn

__all__ = [
    "FINGERPRINT_BATCH",
    "LockstepPoissonSampler",
    "check_evaluation",
    "check_ranks_agree",
    "dataset_fingerprint",
    "is_distributed",
    "mechanism_setup",
    "rank_wrapper",
    "run_setup",
    "unsupported_parallelism",
]

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


# -- the ranks agree on the data and the set-up ------------------------------------------------------------------

MAX_DEPTH = 64  #: nesting levels a record's value is hashed to
#: a Hugging Face dataset is read this many rows at a time (its columns hashed batch by batch, in index order)
FINGERPRINT_BATCH = 1024


def dataset_fingerprint(dataset: Any) -> str:
    """SHA-256 of every record, in index order (so the order counts): tensors and arrays by dtype, shape and bytes,
    strings, bytes, numbers, mappings / sequences, dataclasses and objects' attributes recursively (an object with
    neither fields nor attributes by its type). A Hugging Face ``datasets.Dataset`` is read in batches of
    :data:`FINGERPRINT_BATCH` rows (its index mapping applied). Compared between the ranks, never logged or saved."""
    h = hashlib.sha256()
    if callable(getattr(dataset, "iter", None)) and hasattr(dataset, "column_names"):
        h.update(b"hf-batches:")
        for batch in dataset.iter(batch_size=FINGERPRINT_BATCH):
            _feed(h, batch)
        return h.hexdigest()
    for i in range(len(dataset)):
        _feed(h, dataset[i])
    return h.hexdigest()


def _feed(h: Any, value: Any, depth: int = 0) -> None:
    """Hash ``value`` with a type tag and its length, so that no two different values give the same stream (objects
    nested deeper than :data:`MAX_DEPTH`, e.g. a cycle of references, by their type only)."""
    if depth > MAX_DEPTH:
        h.update(f"D{type(value).__qualname__};".encode())
        return
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        t = (t.to_dense() if t.layout != torch.strided else t).contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray) and value.dtype == object:
        h.update(f"O{value.shape}".encode())
        _feed(h, value.tolist(), depth + 1)
    elif isinstance(value, np.ndarray | np.generic):
        a = np.ascontiguousarray(value)
        h.update(f"A{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(value, str | bytes | bytearray):
        raw = value.encode() if isinstance(value, str) else bytes(value)
        h.update(f"{type(value).__name__}{len(raw)}:".encode())
        h.update(raw)
    elif value is None or isinstance(value, bool | int | float | complex):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, Mapping):
        h.update(f"M{len(value)}".encode())
        for key in sorted(value, key=str):
            _feed(h, str(key), depth + 1)
            _feed(h, value[key], depth + 1)
    elif isinstance(value, list | tuple):
        h.update(f"L{len(value)}".encode())
        if not _feed_numbers(h, value):
            for item in value:
                _feed(h, item, depth + 1)
    else:  # an object of another type: its fields or attributes (never its repr: it may hold a memory address)
        h.update(f"O{type(value).__module__}.{type(value).__qualname__};".encode())
        if dataclasses.is_dataclass(value):
            _feed(h, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, depth + 1)
        elif isinstance(getattr(value, "__dict__", None), dict):
            _feed(h, vars(value), depth + 1)


def _feed_numbers(h: Any, values: list | tuple) -> bool:
    """A sequence of Python ints (or of floats) in one go, as int64 (float64) bytes; False for any other."""
    for kind, dtype in ((int, np.int64), (float, np.float64)):
        if values and all(type(v) is kind for v in values):
            try:
                raw = np.asarray(values, dtype=dtype).tobytes()
            except OverflowError:  # an int beyond int64: one by one
                return False
            h.update(f"{kind.__name__}s:".encode())
            h.update(raw)
            return True
    return False


def run_setup(trainer: Any, dataset: Any) -> dict[str, Any]:
    """What every rank of ``trainer``'s job must share: the dataset (length, fingerprint), the sampling (rate,
    logical batch, accumulation, processes) and the DP set-up (not the per-rank sampler generators)."""
    a = trainer.args
    k, world = a.gradient_accumulation_steps, a.world_size
    return {
        "dataset length": len(dataset),
        "records": dataset_fingerprint(dataset),
        "sample rate": trainer.sample_rate,
        "logical batch": trainer._train_batch_size * k * world,
        "gradient_accumulation_steps": k,
        "world size": world,
        "per_sample_max_grad_norm": trainer.args.per_sample_max_grad_norm,
        "noise_multiplier": trainer.noise_multiplier,
        "target_epsilon": trainer.args.target_epsilon,
        "target_delta": trainer.args.target_delta,
        "accountant": trainer.privacy_engine.accountant.mechanism(),
        "grad_sample_mode": trainer.args.grad_sample_mode,
        "noise_mechanism": trainer.args.noise_mechanism,
    }


def mechanism_setup(run: Any) -> dict[str, Any]:
    """What every rank must share once ``make_private`` built a noise mechanism's sampler (and a resume restored
    it): the partition seed (as secret as the sampler's, ``docs/mechanisms.md``) and the sampler's step in the group
    cycle."""
    return {"partition seed": run.partition_seed, "sampler step": run.loader.batch_sampler.step}


def check_ranks_agree(local: dict[str, Any]) -> None:
    """Exchange ``local`` (:func:`run_setup`) between the ranks over the process group and raise ``ValueError`` on
    every rank, naming what differs, unless all ranks hold the same; the fingerprint and the partition seed (a
    secret, ``docs/mechanisms.md``) are never shown."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("DPTrainer across processes needs the torch.distributed process group (run with torchrun)")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    differ = [key for key in local if any(g[key] != gathered[0][key] for g in gathered)]
    if not differ:
        return
    hidden = {
        "records": "the records (a hash of their content, in order, differs)",
        "partition seed": "the partition seed",
    }
    what = [
        hidden.get(key) or f"{key} ({', '.join(f'rank {r}: {g[key]}' for r, g in enumerate(gathered))})"
        for key in differ
    ]
    raise ValueError(
        f"DPTrainer's ranks do not train the same run: {'; '.join(what)}. Every rank must hold the same dataset in "
        "the same order and the same settings: each takes its share of the one dataset, so a record could be "
        "drawn twice in a step (its gradient counted twice: sensitivity 2C) or never, and ranks would account "
        "different ε. Build the dataset identically on every rank (shuffle with a fixed seed, or not at all); "
        "randomness drawn when a record is read (augmentation in __getitem__) belongs in the data collator."
    )
