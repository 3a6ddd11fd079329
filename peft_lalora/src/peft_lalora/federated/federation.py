"""Deprecated path: the run's configuration is :mod:`peft_lalora.federated.config`, what is built from it
:mod:`peft_lalora.federated.builders` (both also at ``peft_lalora.federated``)."""

from __future__ import annotations

import warnings

from .builders import (
    aggregate_updates,
    build_client,
    build_evaluator,
    build_partition,
    build_task,
    make_client,
    make_peft_config,
    make_peft_model,
    noise_record,
    sample_clients,
)
from .config import ALGORITHMS, DEFAULTS, FILTERS, PARTITIONS, FederationConfig, clients_per_round

__all__ = [
    "ALGORITHMS",
    "DEFAULTS",
    "FILTERS",
    "FederationConfig",
    "PARTITIONS",
    "aggregate_updates",
    "build_client",
    "build_evaluator",
    "build_partition",
    "build_task",
    "clients_per_round",
    "make_client",
    "make_peft_config",
    "make_peft_model",
    "noise_record",
    "sample_clients",
]

warnings.warn(
    "peft_lalora.federated.federation is deprecated: import FederationConfig (and ALGORITHMS, FILTERS, ...) from "
    "peft_lalora.federated.config and the builders (build_task, make_peft_model, ...) from "
    "peft_lalora.federated.builders",
    DeprecationWarning,
    stacklevel=2,
)
