"""The Flower app's ``pyproject.toml``: the run configuration as ``[tool.flwr.app.config]`` and the components
by module path (``peft_lalora.federated.flower.app:server_app`` / ``:client_app``) from the installed package."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["APP_MODULE", "RESULT_PATH_KEY", "STATE_PATH_KEY", "THREADS_KEY", "write_flower_app"]

#: the Flower app's components, imported by module path from the installed peft-lalora package
APP_MODULE = "peft_lalora.federated.flower.app"
#: run_config keys that are not FederationConfig fields
RESULT_PATH_KEY = "result-path"
STATE_PATH_KEY = "state-path"
THREADS_KEY = "threads"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def write_flower_app(directory: str | Path, run_config: Mapping[str, Any]) -> Path:
    """Write a Flower app to ``directory``: a ``pyproject.toml`` with ``run_config`` as
    ``[tool.flwr.app.config]`` whose components are :mod:`peft_lalora.federated.flower.app`'s ``server_app`` /
    ``client_app``, imported by module path from the installed package (no source is copied)."""
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
        f'serverapp = "{APP_MODULE}:server_app"',
        f'clientapp = "{APP_MODULE}:client_app"',
        "",
        "[tool.flwr.app.config]",
        *[f"{json.dumps(k)} = {_toml_value(v)}" for k, v in run_config.items()],
        "",
    ]
    (d / "pyproject.toml").write_text("\n".join(lines))
    return d
