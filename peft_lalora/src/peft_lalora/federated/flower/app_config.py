"""The Flower app's ``pyproject.toml``: the run configuration as ``[tool.flwr.app.config]`` and the components by
module path (:data:`SERVER_APP`, :data:`CLIENT_APP`) from the installed package; and what both apps read from a
Flower ``Context`` (the :class:`~peft_lalora.federated.config.FederationConfig`, the thread count). Imports no
``flwr``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig

__all__ = [
    "CLIENT_APP",
    "RESULT_PATH_KEY",
    "SERVER_APP",
    "STATE_PATH_KEY",
    "THREADS_KEY",
    "federation_config",
    "log",
    "set_threads",
    "write_flower_app",
]

#: the Flower app's components (Flower's app shape: ``server_app.py`` / ``client_app.py``, each an ``app``),
#: imported by module path from the installed peft-lalora package
SERVER_APP = "peft_lalora.federated.flower.server_app:app"
CLIENT_APP = "peft_lalora.federated.flower.client_app:app"
#: run_config keys that are not FederationConfig fields
RESULT_PATH_KEY = "result-path"
STATE_PATH_KEY = "state-path"
THREADS_KEY = "threads"


def log(level: int, msg: str, *args: Any, **kwargs: Any) -> None:
    """Flower's logger (imported when called)."""
    from flwr.supercore import log as flwr_log

    flwr_log(level, msg, *args, **kwargs)


def set_threads(context: Any) -> None:
    """``torch.set_num_threads`` from the run config's ``threads`` (0 or absent: torch's default)."""
    n = int(context.run_config.get(THREADS_KEY, 0) or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)


def federation_config(context: Any) -> FederationConfig:
    """The run's :class:`~peft_lalora.federated.config.FederationConfig` from a Flower ``Context``'s run config."""
    from ..config import FederationConfig

    return FederationConfig.from_dict(context.run_config, extra_keys=(RESULT_PATH_KEY, STATE_PATH_KEY, THREADS_KEY))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def write_flower_app(directory: str | Path, run_config: Mapping[str, Any]) -> Path:
    """Write a Flower app to ``directory``: a ``pyproject.toml`` with ``run_config`` as
    ``[tool.flwr.app.config]`` whose components are :data:`SERVER_APP` and :data:`CLIENT_APP`, imported by module
    path from the installed package (no source is copied)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        'name = "lalora-flower-app"',
        'version = "1.0.0"',
        'description = "DP federated LA-LoRA (peft-lalora) on Flower"',
        'license = "Apache-2.0"',
        'dependencies = ["peft-lalora[flower,dp]"]',
        "",
        "[tool.flwr.app]",
        'publisher = "peft-lalora"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{SERVER_APP}"',
        f'clientapp = "{CLIENT_APP}"',
        "",
        "[tool.flwr.app.config]",
        *[f"{json.dumps(k)} = {_toml_value(v)}" for k, v in run_config.items()],
        "",
    ]
    (d / "pyproject.toml").write_text("\n".join(lines))
    return d
