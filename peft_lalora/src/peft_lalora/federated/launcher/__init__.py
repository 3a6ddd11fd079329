"""A local Flower federation on 127.0.0.1 (:func:`run_flower`, :class:`LocalFederation`): processes, TLS
certificates, SuperNode keys, private work folders, always torn down (``docs/deployment.md``). Importing this
package imports neither ``flwr`` nor ``cryptography``."""

from __future__ import annotations

from ..._lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _LAZY)
