"""What both runners build from a :class:`~peft_lalora.federated.config.FederationConfig`: the client settings, the
adapter model, the partition, the clients, the evaluator, the round's sample and its aggregate.

Every :class:`~peft_lalora.federated.client.dp_client.ClientConfig` field is named where :func:`client_config` builds it
(those the run does not set are listed in :data:`CLIENT_DEFAULTS_KEPT`): a renamed field is an error, not a silent
default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .client.dp_client import REPRODUCIBLE_NOISE_NOTE, ClientConfig, DPClient, NamedInputsLoss
from .config import FILTERS, FederationConfig, clients_per_round
from .data.task import Task, build_task

__all__ = [
    "CLIENT_DEFAULTS_KEPT",
    "aggregate_updates",
    "build_client",
    "build_evaluator",
    "build_partition",
    "build_task",
    "client_config",
    "make_client",
    "make_peft_config",
    "make_peft_model",
    "noise_record",
    "sample_clients",
]

#: ClientConfig fields a federation leaves at their default (no FederationConfig field sets them)
CLIENT_DEFAULTS_KEPT: tuple[str, ...] = ("momentum", "grad_sample_mode", "secure_mode", "allow_non_private", "device")


def client_config(cfg: FederationConfig) -> ClientConfig:
    """The :class:`~peft_lalora.federated.client.dp_client.ClientConfig` every client of ``cfg`` shares: σ calibrated
    for ``(epsilon, delta)`` over ``rounds × local_steps`` steps when ``epsilon > 0`` (else ``noise_multiplier``), and
    the filter's post_hooks."""
    calibrate = cfg.epsilon > 0
    return ClientConfig(
        local_steps=cfg.local_steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        b_lr_ratio=cfg.b_lr_ratio,
        max_grad_norm=cfg.max_grad_norm,
        noise_multiplier=None if calibrate else cfg.noise_multiplier,
        target_epsilon=cfg.epsilon if calibrate else None,
        planned_steps=cfg.rounds * cfg.local_steps if calibrate else None,
        delta=cfg.delta,
        accountant=cfg.accountant,
        post_hooks=[tuple(h) if isinstance(h, list) else h for h in FILTERS[cfg.filter]],
        reproducible_noise=cfg.reproducible_noise,
    )


def make_peft_config(cfg: FederationConfig) -> Any:
    """The ``LALoraConfig`` of the run (alternation from ``cfg.algo`` through
    :data:`~peft_lalora.federated.config.ALGORITHMS`; classifier head trainable)."""
    from ..tuners.lalora.config import LALoraConfig

    return LALoraConfig(
        task_type="SEQ_CLS",
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=[m.strip() for m in cfg.target_modules.split(",") if m.strip()],
        alternation=cfg.alternation,
        first_factor=cfg.first_factor,
    )


def make_peft_model(cfg: FederationConfig, task: Task) -> Any:
    """Base model + LALoRA adapter, with the adapter's random init (LoRA A, head) seeded by ``cfg.seed``:
    the initial global adapter must not depend on the process's RNG state (server vs. simulation)."""
    from peft import get_peft_model

    base = task.model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        return get_peft_model(base, make_peft_config(cfg))


def build_partition(cfg: FederationConfig, task: Task) -> Any:
    """Split ``task.train`` over ``cfg.num_clients`` clients as ``cfg.partition`` says."""
    from .data.partition import dirichlet_partition, group_partition, iid_partition

    if cfg.partition == "iid":
        return iid_partition(task.train, cfg.num_clients, seed=cfg.seed)
    if cfg.partition == "group":
        if task.group_column is None:
            raise ValueError(f"task {task.name!r} has no group column for partition='group' (set group_column)")
        return group_partition(task.train.with_format(None), task.group_column, cfg.num_clients, seed=cfg.seed)
    return dirichlet_partition(
        task.train, cfg.num_clients, cfg.alpha, seed=cfg.seed, min_partition_size=cfg.min_partition_size
    )


def build_client(cfg: FederationConfig, task: Task, partition: Any, client_id: int) -> DPClient:
    """The :class:`~peft_lalora.federated.client.dp_client.DPClient` for partition ``client_id``."""
    return make_client(cfg, task, task.tensors("train", partition.indices[client_id]), client_id)


def make_client(cfg: FederationConfig, task: Task, data: Any, client_id: int) -> DPClient:
    """The :class:`~peft_lalora.federated.client.dp_client.DPClient` ``client_id`` training on ``data`` (its own
    rows)."""
    return DPClient(
        client_id,
        make_peft_model(cfg, task),
        None,
        data,
        client_config(cfg),
        seed=cfg.seed,
        loss_fn=NamedInputsLoss(task.input_names),
    )


def build_evaluator(cfg: FederationConfig, task: Task) -> Any:
    """Server-side evaluator; its freshly built adapter is the initial global state."""
    from .server.evaluate import Evaluator

    return Evaluator(make_peft_model(cfg, task), None, task.tensors("test"), input_names=task.input_names)


def noise_record(cfg: FederationConfig) -> dict[str, Any]:
    """What the result JSON says about where the DP noise came from (``"noise"`` key)."""
    if cfg.reproducible_noise:
        return {
            "reproducible": True,
            "source": "seeded from (seed, client, round) — public: seed is in the run config",
            "note": REPRODUCIBLE_NOISE_NOTE,
        }
    return {
        "reproducible": False,
        "source": "fresh OS entropy per client and round (secrets), never stored or sent",
        "note": "not reproducible run to run; rounds are refused if replayed",
    }


def sample_clients(cfg: FederationConfig, server_round: int) -> list[int]:
    """Sorted ids of the clients sampled in ``server_round`` (1-based): ``max(min_clients, round(fraction·N))``
    drawn without replacement from a generator seeded by ``(seed, server_round)``."""
    n, m = cfg.num_clients, clients_per_round(cfg)
    if m == n:
        return list(range(n))
    rng = np.random.default_rng([cfg.seed, server_round, 0x5A])
    return sorted(int(i) for i in rng.choice(n, size=m, replace=False))


def aggregate_updates(
    cfg: FederationConfig,
    global_state: Mapping[str, torch.Tensor],
    states: Sequence[Mapping[str, torch.Tensor]],
    num_examples: Sequence[int],
    client_ids: Sequence[int],
    *,
    update_bound: float | None = None,
) -> Any:
    """FedAvg of the round's updates in client-id order (same float sums in every runner).

    ``num_examples`` must be the sizes the *server* assigned (``partition.sizes``), never client reports.
    ``update_bound``: the bound the server computed
    (:func:`~peft_lalora.federated.server.update_bound.server_update_bound`); ``None``: ``cfg.max_update_norm`` (0 =
    none)."""
    from .server.aggregate import fedavg

    order = sorted(range(len(client_ids)), key=lambda i: client_ids[i])
    return fedavg(
        [states[i] for i in order],
        [float(num_examples[i]) for i in order] if cfg.weighted else None,
        server_lr=cfg.server_lr,
        global_state=global_state,
        min_clients=cfg.min_clients,
        client_ids=[client_ids[i] for i in order],
        max_update_norm=update_bound if update_bound is not None else (cfg.max_update_norm or None),
        update_norm_policy=cfg.update_norm_policy,
        rule=cfg.aggregation,
        trim_fraction=cfg.trim_fraction,
    )
