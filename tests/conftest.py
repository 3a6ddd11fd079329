"""Shared fixtures: tiny models and data, CPU by default (OPACUS_SPECTRAL_TEST_DEVICE=cuda for the GPU check)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


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
