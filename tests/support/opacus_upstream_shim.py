"""A pytest plugin for running Opacus' own test modules in a subprocess
(``tests/opacus_spectral/test_opacus_upstream.py``).

Loaded with ``-p opacus_upstream_shim`` before the test modules are imported, it

* swaps ``opacus.PrivacyEngine`` / ``opacus.privacy_engine.PrivacyEngine`` for ``opacus_spectral.PrivacyEngine``
  when ``OPACUS_UPSTREAM_ENGINE=opacus_spectral`` (the modules import it with ``from opacus import PrivacyEngine``),
  with one default changed: ``noise_seed`` is drawn from torch's global RNG, the source Opacus' own default draws its
  noise and sample from. Several tests pin ``torch.manual_seed`` and compare two runs (or a statistical tolerance
  of one), which the engine's real default, OS-entropy noise, fails by design (``docs/engine.md``);
* loads a hypothesis profile with ``OPACUS_UPSTREAM_EXAMPLES`` examples per property (default 1), derandomized, so
  both engines see the same examples, and without shrinking (a failing example is not minimized);
* lets the PyPI torchvision wheel (a CUDA build) import next to the CPU torch: its C operators cannot load, and
  ``torchvision._meta_registrations`` then registers fake kernels for ``torchvision::nms`` / ``qnms`` without checking
  that they exist. Their schemas are declared first (no kernel: calling them raises), so the pure-Python models,
  transforms and ``FakeData`` the tests use import as published.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import hypothesis
import torch

ENGINE_ENV = "OPACUS_UPSTREAM_ENGINE"
EXAMPLES_ENV = "OPACUS_UPSTREAM_EXAMPLES"
_TORCHVISION_OPS = ("nms", "qnms")
_LIBRARIES: list[torch.library.Library] = []  # kept alive: a dropped Library removes its definitions


def _declare_torchvision_ops() -> None:
    if importlib.util.find_spec("torchvision") is None or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in _TORCHVISION_OPS:
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARIES.append(lib)


def _swap_engine() -> None:
    engine = os.environ.get(ENGINE_ENV, "opacus")
    if engine == "opacus":
        return
    if engine != "opacus_spectral":
        raise ValueError(f"{ENGINE_ENV} must be 'opacus' or 'opacus_spectral', got {engine!r}")
    import opacus
    import opacus.privacy_engine

    import opacus_spectral

    class GlobalSeeded(opacus_spectral.PrivacyEngine):
        def __init__(self, *, secure_mode: bool = False, noise_seed: int | None = None, **kwargs: object) -> None:
            if not secure_mode and noise_seed is None:
                noise_seed = int(torch.randint(0, 2**62, (1,)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", opacus_spectral.errors.ReproducibleNoiseWarning)
                super().__init__(secure_mode=secure_mode, noise_seed=noise_seed, **kwargs)  # type: ignore[arg-type]

    opacus.PrivacyEngine = GlobalSeeded
    opacus.privacy_engine.PrivacyEngine = GlobalSeeded


def pytest_configure(config: object) -> None:
    _declare_torchvision_ops()
    _swap_engine()
    examples = int(os.environ.get(EXAMPLES_ENV, "1"))
    hypothesis.settings.register_profile(
        "opacus-upstream",
        max_examples=examples,
        derandomize=True,
        database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # no shrinking: an outcome is what counts
    )
    hypothesis.settings.load_profile("opacus-upstream")
