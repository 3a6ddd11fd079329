"""Federated LA-LoRA: partitioning, DP clients, FedAvg of A/B/head, privacy ledger, two runners.

Modules: :mod:`.config` (the run's :class:`FederationConfig`), :mod:`.builders` (what is built from it),
:mod:`.task`, :mod:`.partition`, :mod:`.client`, :mod:`.server`, :mod:`.aggregate`, :mod:`.ledger`, the in-process
runner :mod:`.simulation`, and the Flower deployment in the subpackage :mod:`.flower` (extra ``[flower]``).

Heavy or optional dependencies are imported lazily: partitioning needs ``flwr-datasets`` and the Flower
app needs ``flwr`` (extra ``[flower]``); the DP client needs ``opacus-spectral`` (extra ``[dp]``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .aggregate import AggregationError, AggregationResult, Rejection, fedavg, validate_update
from .ledger import PrivacyLedger, epsilon_from_history

_LAZY = {
    "Partition": "partition",
    "partition_dataset": "partition",
    "dirichlet_partition": "partition",
    "iid_partition": "partition",
    "group_partition": "partition",
    "label_skew": "partition",
    "ClientConfig": "client",
    "ClientUpdate": "client",
    "DPClient": "client",
    "ReplayedRoundError": "client",
    "ReproducibleNoiseWarning": "client",
    "Evaluator": "evaluate",
    "classification_metrics": "evaluate",
    "Task": "task",
    "build_task": "task",
    "FederationServer": "server",
    "FederationPlan": "plan",
    "RoundRecord": "server",
    "adapter_state": "client",
    "load_adapter_state": "client",
    "ALGORITHMS": "config",
    "FILTERS": "config",
    "FederationConfig": "config",
    "TaskSettings": "config",
    "FederationResult": "server",
    "run_simulation": "simulation",
    "LocalFederation": "flower",
    "run_flower": "flower",
    "TLSConfig": "flower",
}

__all__ = [
    "AggregationError",
    "AggregationResult",
    "PrivacyLedger",
    "Rejection",
    "epsilon_from_history",
    "fedavg",
    "validate_update",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
