"""Shared fixtures: tiny models and data, CPU by default (OPACUS_SPECTRAL_TEST_DEVICE=cuda for the GPU check).

The tests live by distribution (``opacus_spectral/``, ``peft_lalora/``, ``harness/``, and ``repository/`` for the
checks of the whole repository); the support modules they share live here, in ``tests/``."""

from __future__ import annotations

import os

import pytest
import torch
from repo_support import subprocess_env

# one thread per pytest-xdist worker (the README's command runs two on the two cores), at most two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
# every process a test starts (a Flower SuperNode or ServerApp rebuilding ``fed_tiny:tiny``, a torchrun rank, a
# ``python -c`` probe) inherits the environment: name the support folder there as pytest's ``pythonpath`` does here
os.environ["PYTHONPATH"] = subprocess_env()["PYTHONPATH"]


@pytest.fixture
def device() -> torch.device:
    return torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))


#: integration modules (federations, the harness's grids and stores, the Trainer, DDP, subprocess runs), each over
#: 10 s on 2 cores: their tests are ``slow``, left out of the fast lane ``pytest -m "not slow"`` (README)
SLOW_MODULES = frozenset(
    {
        "test_audit_runs",
        "test_benchmarks_smoke",
        "test_ddp",
        "test_fed_cli",
        "test_fed_deploy",
        "test_fed_frozen",
        "test_fed_privacy",
        "test_fed_robust_defaults",
        "test_fed_runners",
        "test_fed_save_adapter",
        "test_fed_structure",
        "test_fed_trust",
        "test_grid",
        "test_overhead_llm",
        "test_store",
        "test_support_equivalence",
        "test_trainer",
        "test_trainer_batch_independence",
        "test_trainer_causal_lm",
        "test_trainer_ddp",
        "test_trainer_privacy",
        "test_trainer_privacy_record",
        "test_trainer_smollm2",
    }
)
#: markers whose tests are slow wherever they are (processes, real federations, Opacus' own test suite)
SLOW_MARKERS = ("flower", "ddp", "opacus_upstream")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module in SLOW_MODULES or any(m in item.keywords for m in SLOW_MARKERS):
            item.add_marker(slow)
    if os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu").startswith("cuda"):
        return
    skip_gpu = pytest.mark.skip(reason="needs OPACUS_SPECTRAL_TEST_DEVICE=cuda")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
