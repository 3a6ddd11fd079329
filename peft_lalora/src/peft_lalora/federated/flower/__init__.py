"""The Flower app of a federation (extra ``[flower]``), in Flower's app shape:
:mod:`~peft_lalora.federated.flower.server_app` (``app``, a ``ServerApp``),
:mod:`~peft_lalora.federated.flower.client_app` (``app``, a ``ClientApp``),
:mod:`~peft_lalora.federated.flower.strategy` (``LALoraStrategy``) and
:mod:`~peft_lalora.federated.flower.app_config` (the app's ``pyproject.toml``). The local TLS federation that runs it
is :mod:`peft_lalora.federated.launcher`.

Importing this package imports no ``flwr``: the two apps and the strategy import it (the Flower processes load the
apps by module path, :data:`~peft_lalora.federated.flower.app_config.SERVER_APP`). See ``docs/deployment.md``.
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_LAZY = {
    "CLIENT_APP": "app_config",
    "SERVER_APP": "app_config",
    "write_flower_app": "app_config",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
