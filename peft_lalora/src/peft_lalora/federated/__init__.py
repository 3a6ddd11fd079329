"""Federated LA-LoRA: partitioning, DP clients, FedAvg of A/B/head, privacy ledger, two runners.

Modules: :mod:`~peft_lalora.federated.config` (the run's :class:`FederationConfig`),
:mod:`~peft_lalora.federated.builders` (what is built from it), :mod:`~peft_lalora.federated.data.task`,
:mod:`~peft_lalora.federated.data.partition`, :mod:`~peft_lalora.federated.client.dp_client`,
:mod:`~peft_lalora.federated.server.rounds`, :mod:`~peft_lalora.federated.server.aggregate`,
:mod:`~peft_lalora.federated.server.ledger`, the in-process runner :mod:`~peft_lalora.federated.simulation`, and the
Flower deployment in the subpackage :mod:`~peft_lalora.federated.flower` (extra ``[flower]``).

Every name is imported lazily (``import peft_lalora.federated`` imports no torch of its own), and so are heavy or
optional dependencies: partitioning needs ``flwr-datasets`` and the Flower
app needs ``flwr`` (extra ``[flower]``); the DP client needs ``opacus-spectral`` (extra ``[dp]``).
"""

from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "AggregationError": "server.aggregate",
    "AggregationResult": "server.aggregate",
    "Rejection": "server.aggregate",
    "fedavg": "server.aggregate",
    "validate_update": "server.aggregate",
    "PrivacyLedger": "server.ledger",
    "epsilon_from_history": "server.ledger",
    "Partition": "data.partition",
    "partition_dataset": "data.partition",
    "dirichlet_partition": "data.partition",
    "iid_partition": "data.partition",
    "group_partition": "data.partition",
    "label_skew": "data.partition",
    "ClientConfig": "client.dp_client",
    "ClientUpdate": "client.dp_client",
    "DPClient": "client.dp_client",
    "ReplayedRoundError": "client.dp_client",
    "Evaluator": "server.evaluate",
    "classification_metrics": "server.evaluate",
    "Task": "data.task",
    "build_task": "data.task",
    "FederationServer": "server.rounds",
    "FederationPlan": "server.plan",
    "RoundRecord": "server.rounds",
    "adapter_state": "client.dp_client",
    "load_adapter_state": "client.dp_client",
    "ALGORITHMS": "config",
    "FILTERS": "config",
    "FederationConfig": "config",
    "TaskSettings": "config",
    "FederationResult": "server.rounds",
    "run_simulation": "simulation",
    "LocalFederation": "launcher",
    "run_flower": "launcher",
    "TLSConfig": "launcher",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
