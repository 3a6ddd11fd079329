"""Deprecated path: the local Flower federation is :mod:`peft_lalora.federated.flower` (``run_flower``,
``LocalFederation``, ``TLSConfig``; modules :mod:`~peft_lalora.federated.flower.launcher`,
:mod:`~peft_lalora.federated.flower.run`)."""

from __future__ import annotations

import warnings

from .flower.app_config import APP_MODULE, write_flower_app
from .flower.certificates import TLSConfig
from .flower.launcher import INSECURE_WARNING, LocalFederation
from .flower.processes import free_port
from .flower.run import run_flower

__all__ = [
    "APP_MODULE",
    "INSECURE_WARNING",
    "LocalFederation",
    "TLSConfig",
    "free_port",
    "run_flower",
    "write_flower_app",
]

warnings.warn(
    "peft_lalora.federated.launcher is deprecated: use peft_lalora.federated.flower (run_flower, LocalFederation, "
    "TLSConfig)",
    DeprecationWarning,
    stacklevel=2,
)
