"""A local Flower federation on 127.0.0.1 (:func:`run_flower`, :class:`LocalFederation`): processes, TLS
certificates, SuperNode keys, private work folders, always torn down (``docs/deployment.md``). Importing this
package imports neither ``flwr`` nor ``cryptography``."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "INSECURE_WARNING": "launcher",
    "LocalFederation": "launcher",
    "TLSConfig": "certificates",
    "generate_tls": "certificates",
    "NodeKeys": "node_keys",
    "generate_node_keys": "node_keys",
    "run_flower": "run",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
