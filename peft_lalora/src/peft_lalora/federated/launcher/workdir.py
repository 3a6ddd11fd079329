"""Work folders of a local federation: owner-only, and removed at the end unless kept.

A federation's folder holds the SuperLink's TLS key and every SuperNode's private key (``credentials/``), the
processes' logs, the run configuration and the final adapter, so every folder this package creates there is
``0700`` (:func:`private_dir`) and every key file ``0600``
(:func:`~peft_lalora.federated.launcher.certificates.write_private`). A folder made by :func:`new_workdir` is the run's
own: :func:`remove_workdir` deletes it when the run ends.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

__all__ = ["PRIVATE_DIR_MODE", "new_workdir", "private_dir", "remove_workdir"]

PRIVATE_DIR_MODE = 0o700


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and missing parents) and make it ``0700`` (also when it existed wider)."""
    p = Path(path)
    p.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    p.chmod(PRIVATE_DIR_MODE)  # an existing folder keeps its mode under mkdir
    return p


def new_workdir(prefix: str = "lalora-flwr-") -> Path:
    """A fresh ``0700`` folder under the system's temp directory."""
    return private_dir(tempfile.mkdtemp(prefix=prefix))


def remove_workdir(path: str | Path) -> None:
    """Delete ``path`` and everything in it (keys included); a missing folder is fine."""
    if Path(path).exists():
        shutil.rmtree(path)
