"""Deprecated path: the Flower app is :mod:`peft_lalora.federated.flower.app` (components
``peft_lalora.federated.flower.app:server_app`` / ``:client_app``); an app written with the old path still runs."""

from __future__ import annotations

import warnings

from .flower.app import LALoraStrategy, assign_partitions, client_app, server_app

__all__ = ["LALoraStrategy", "assign_partitions", "client_app", "server_app"]

warnings.warn(
    "peft_lalora.federated.flower_app is deprecated: the Flower app's components are "
    "peft_lalora.federated.flower.app:server_app / :client_app",
    DeprecationWarning,
    stacklevel=2,
)
