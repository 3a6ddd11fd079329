"""The Flower deployment of a federation (extra ``[flower]``): the Flower app (:mod:`~peft_lalora.federated.flower.app`:
``ServerApp``, ``ClientApp``, the strategy) and a one-command local federation on loopback (:func:`run_flower`,
:class:`LocalFederation`: processes, TLS certificates, SuperNode keys, private work folders).

Importing this package imports neither ``flwr`` nor ``cryptography``: :mod:`~peft_lalora.federated.flower.app` imports
``flwr`` (the Flower processes load it by module path, ``peft_lalora.federated.flower.app:server_app``), the key and
certificate writers import ``cryptography`` when called. See ``docs/deployment.md``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "APP_MODULE": "app_config",
    "write_flower_app": "app_config",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
