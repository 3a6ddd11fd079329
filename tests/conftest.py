"""Shared fixtures: the device, CPU by default (OPACUS_SPECTRAL_TEST_DEVICE=cuda for the GPU check).

The tests are laid out like the code: ``opacus_spectral/<subpackage>/``, ``peft_lalora/<subpackage>/``, ``harness/``,
and ``repository/`` for the checks of the whole repository; the support modules they share live in ``support/``. A
module whose tests take more than ~10 s on 2 cores (federations, grids, the Trainer, processes) declares
``pytestmark = pytest.mark.slow`` — the one way to leave the fast lane (``pytest -m "not slow"``)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from repo_support import subprocess_env

# one thread per pytest-xdist worker (the README's command runs two on the two cores), at most two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
# every process a test starts (a Flower SuperNode or ServerApp rebuilding ``fed_tiny:tiny``, a torchrun rank, a
# ``python -c`` probe) inherits the environment: name the support folder there as pytest's ``pythonpath`` does here
os.environ["PYTHONPATH"] = subprocess_env()["PYTHONPATH"]
# BandMF's coefficient cache (opacus_spectral.mechanisms.bandmf): a fresh folder per session, not the user's
os.environ["OPACUS_SPECTRAL_CACHE"] = tempfile.mkdtemp(prefix="opacus-spectral-cache-")


@pytest.fixture
def device() -> torch.device:
    return torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu").startswith("cuda"):
        return
    skip_gpu = pytest.mark.skip(reason="needs OPACUS_SPECTRAL_TEST_DEVICE=cuda")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
