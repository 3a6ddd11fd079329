"""DPTrainer's noise mechanism (``DPTrainingArguments.noise_mechanism``; ``docs/trainer.md``, "Noise mechanisms";
``docs/mechanisms.md``): the argument's forms, the accounting σ is calibrated and the budget is counted with, and
the sampler the Trainer trains on.

A mechanism with its own sampler (``bandmf``: cyclic Poisson sampling) is sampled by the one sampler the engine's
``make_private`` builds for it and charges the accountant for (``engine.mechanism_run.loader``): the Trainer's
loader holds a :class:`PendingSampler` until then, and trains on that sampler afterwards (one partition, one step
counter; the engine checks that every DP step trains on the batch it drew last). A resumed run continues the group
cycle: the sampler's step is set back by the batches the Trainer skips to reach the checkpoint's step, so the first
batch it trains on is that step's group.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import Sampler

from ..mechanisms.realization import realize
from ..plugins.registry import get_registry

__all__ = [
    "GAUSSIAN",
    "PendingSampler",
    "accounting_of",
    "bind_sampler",
    "check_mechanism",
    "mechanism_spec",
    "read_mechanism",
    "resume_sampler",
]

GAUSSIAN = "gaussian"
_FORMS = "a name ('gaussian', 'bandmf'), a dict {'name': 'bandmf', 'bands': 4} or its JSON string"


def read_mechanism(value: Any) -> str | dict[str, Any]:
    """The argument as a name, or ``{"name": ..., **kwargs}`` when it has keyword arguments: ``None`` is
    ``"gaussian"``; a JSON object string (the command line) is parsed; a ``(name, {kwargs})`` pair is accepted."""
    if value is None:
        return GAUSSIAN
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f'noise_mechanism {value!r} is not a JSON object like \'{{"name": "bandmf", "bands": 4}}\': {exc}'
            ) from exc
    if isinstance(value, tuple | list) and len(value) == 2 and isinstance(value[1], Mapping):
        value = {"name": value[0], **value[1]}
    if isinstance(value, Mapping):
        if not isinstance(value.get("name"), str):
            raise ValueError(f"noise_mechanism {dict(value)!r} needs a 'name', e.g. {{'name': 'bandmf', 'bands': 4}}")
        return dict(value) if len(value) > 1 else value["name"]
    if isinstance(value, str):
        return value
    raise TypeError(f"noise_mechanism must be {_FORMS}, got {value!r}")


def mechanism_spec(value: Any) -> str | tuple[str, dict[str, Any]] | None:
    """What ``make_private(noise_mechanism=...)`` gets: ``None`` for ``"gaussian"`` (Opacus' own noise, untouched),
    else the name or ``(name, kwargs)``."""
    value = read_mechanism(value)
    if value == GAUSSIAN:
        return None
    if isinstance(value, str):
        return value
    return value["name"], {k: v for k, v in value.items() if k != "name"}


def check_mechanism(value: Any) -> None:
    """Build the mechanism once from the registry: an unknown name (with its closest match) or a bad keyword is
    refused when the arguments are built, before any model or data."""
    spec = mechanism_spec(value)
    if spec is not None:
        get_registry().create_mechanism(spec)


def accounting_of(value: Any, sample_rate: float, *, steps: int, dataset_size: int) -> Any:
    """The accounting of the mechanism's realized strategy at noise multiplier 1 and the loader's rate q for a run of
    ``steps`` DP steps (:class:`~opacus_spectral.mechanisms.strategy.Accounting`: rate q′ and one accountant step
    every ``every`` DP steps): what σ is calibrated and the budget counted with. ``"gaussian"``: (q, every 1). The
    strategy is realized first, so its refusals (b > T, b·q > 1, an unstable strategy) come before any accounting."""
    mechanism = get_registry().create_mechanism(mechanism_spec(value) or GAUSSIAN)
    realized = realize(mechanism, steps=steps, sample_rate=sample_rate, dataset_size=dataset_size)
    return realized.accounting(1.0, sample_rate)


def accounted(dp_steps: int, every: int) -> int:
    """Accountant steps ``dp_steps`` DP steps charge when one is charged every ``every`` (from the first)."""
    return math.ceil(dp_steps / every)


class PendingSampler(Sampler[list[int]]):
    """Stands for the sampler ``make_private`` builds (the Trainer reads the loader's length before): its length,
    and no batch."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = int(steps_per_epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        raise RuntimeError(
            "DPTrainer: batches are drawn by the noise mechanism's sampler, which make_private builds in "
            "create_optimizer: iterate the training loader after it (Trainer.train does)"
        )


def resume_sampler(run: Any, saved: Any, *, where: str, global_step: int, skipped: int) -> None:
    """A resumed run: the engine's ``MechanismRun.load_state_dict`` (the checkpoint's mechanism and partition, the
    accountant hook's step, a fresh noise stream), then the sampler's step set back by the ``skipped`` batches the
    Trainer draws and drops to reach ``global_step`` in its epoch."""
    run.load_state_dict(saved, where=where)
    run.loader.batch_sampler.step = int(global_step) - int(skipped)


def bind_sampler(run: Any, physical: Any, args: Any) -> Any:
    """Train on the sampler ``make_private`` built for the mechanism (``physical``: the Trainer's
    :class:`~opacus_spectral.hf.physical_batches.PhysicalBatches`); with loader workers, which fetch batches ahead,
    the engine's check allows that many batches drawn ahead of the step. Returns the mechanism's loader."""
    physical.logical = run.loader.batch_sampler
    workers = int(args.dataloader_num_workers)
    if workers > 0:
        run.loader.lookahead = workers * 2  # torch's prefetch_factor, which DPTrainer's loader keeps
    return run.loader
