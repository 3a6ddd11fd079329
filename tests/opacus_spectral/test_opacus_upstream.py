"""Opacus' own engine tests, run with ``opacus_spectral.PrivacyEngine`` and compared with vanilla Opacus.

The five modules ship in Opacus' wheel (``opacus/tests/``). A run is a pytest subprocess with the plugin
``tests/support/opacus_upstream_shim.py`` (the engine swap, with ``noise_seed`` drawn from torch's global RNG; one
derandomized hypothesis example per property; a torchvision import fix), on the CPU with one thread. Ours must end every
test exactly as vanilla does, except the :data:`EXPECTED` divergences, which are deliberate and must fail for the
documented reason (``docs/engine.md``, "Opacus' own tests").

Vanilla's outcomes are a pure function of Opacus, torch and the shim: they are pinned in :data:`PINNED` under those
three (versions and the shim's SHA-256), and the vanilla run is made again, beside ours, whenever one of them differs
from what is installed, or with ``OPACUS_UPSTREAM_REPIN=1``, which also rewrites the pin. torchvision (models and
``FakeData`` for two modules) is installed by ``tox -e tests`` into a side directory named by
``OPACUS_UPSTREAM_SITE``, so the rest of the suite never imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import opacus
import pytest
import torch
from repo_support import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.opacus_upstream]

MODULES = (
    "privacy_engine_test",
    "batch_memory_manager_test",
    "gradient_accumulation_test",
    "randomness_test",
    "privacy_engine_validation_test",
)
#: test name -> (why ours differs, a string its failure message contains)
EXPECTED = {
    "test_checkpoints": ("a sigma=0 history loaded into a sigma=2 optimizer is refused", "misreport epsilon"),
    # PrivacyEngineSecureModeTest builds the engine before torch.manual_seed: ours fixes its noise source when it is
    # built (the shim's noise_seed, drawn from the unseeded global RNG) and never draws noise from the global RNG at
    # step time, so the seed set afterwards cannot reproduce the run (the other class's test_global_seed passes)
    "test_global_seed": ("noise never comes from torch's global RNG at step time", "False is not true"),
}
#: vanilla Opacus 1.6.0 on this machine (passed, failed, skipped); a changed Opacus or test list shows here
VANILLA = {"passed": 274, "failed": 0, "skipped": 37}
#: vanilla's outcome of every test, and what it is a function of
PINNED = Path(__file__).with_name("opacus_upstream_vanilla.json")
SHIM = Path(__file__).parents[1] / "support" / "opacus_upstream_shim.py"


def _pin_key() -> dict[str, str]:
    """What vanilla's outcomes depend on: Opacus, torch, and the shim that runs them."""
    shim = hashlib.sha256(SHIM.read_bytes()).hexdigest()
    return {"opacus": opacus.__version__, "torch": torch.__version__, "shim_sha256": shim}


def _pinned() -> dict[str, tuple[str, str]] | None:
    """The pinned vanilla outcomes, or None when they do not hold here (another Opacus, torch or shim; a re-pin)."""
    if os.environ.get("OPACUS_UPSTREAM_REPIN") == "1" or not PINNED.is_file():
        return None
    pin = json.loads(PINNED.read_text())
    if pin["key"] != _pin_key():
        return None
    return {k: (kind, "") for k, kind in pin["outcomes"].items()}


def _site() -> str:
    site = os.environ.get("OPACUS_UPSTREAM_SITE")
    if not site:
        pytest.skip("OPACUS_UPSTREAM_SITE is not set: run `tox -e tests` (it installs torchvision for these tests)")
    return site


def _command(engine: str, xml: Path) -> tuple[list[str], dict[str, str]]:
    folder = Path(opacus.__file__).parent / "tests"
    ini = xml.parent / "pytest.ini"  # an empty configuration: not this repository's pyproject.toml
    ini.write_text("[pytest]\n")
    env = dict(os.environ, OPACUS_UPSTREAM_ENGINE=engine, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env = subprocess_env(_site(), base=env)
    env.pop("OPACUS_SPECTRAL_TEST_DEVICE", None)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "opacus_upstream_shim", "-p", "no:cacheprovider"]
    args += ["-c", str(ini), f"--rootdir={folder}", f"--junitxml={xml}"]
    return args + [str(folder / f"{m}.py") for m in MODULES], env


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """``{module::class::test: (passed|failed|skipped, message)}`` from a junit XML report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if child is None else {"error": "failed", "failure": "failed"}.get(child.tag, "skipped")
        text = "" if child is None else f"{child.get('message', '')}\n{child.text or ''}"
        if kind == "failed" or key not in out:
            out[key] = (kind, text)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[str, str]]]:
    folder = tmp_path_factory.mktemp("opacus-upstream")
    pinned = _pinned()
    procs = {}
    for engine in ("opacus_spectral",) if pinned else ("opacus", "opacus_spectral"):
        args, env = _command(engine, folder / f"{engine}.xml")
        log = (folder / f"{engine}.log").open("w")
        procs[engine] = (subprocess.Popen(args, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT), log)
    for proc, log in procs.values():
        proc.wait(timeout=900)
        log.close()
    out = {engine: outcomes(folder / f"{engine}.xml") for engine in procs}
    if pinned is not None:
        out["opacus"] = pinned
    elif os.environ.get("OPACUS_UPSTREAM_REPIN") == "1":
        rows = {k: kind for k, (kind, _) in sorted(out["opacus"].items())}
        PINNED.write_text(json.dumps({"key": _pin_key(), "outcomes": rows}, indent=1) + "\n")
    return out


def test_vanilla_opacus_outcomes_are_the_pinned_ones(runs):
    counts = Counter(kind for kind, _ in runs["opacus"].values())
    assert dict(counts) == {k: v for k, v in VANILLA.items() if v}, "re-measure VANILLA (docs/engine.md)"


def test_the_pin_names_what_vanilla_depends_on(monkeypatch, tmp_path):
    """Another Opacus, torch or shim, or a re-pin request, makes the vanilla run again instead of trusting the pin."""
    module = sys.modules[__name__]
    monkeypatch.delenv("OPACUS_UPSTREAM_REPIN", raising=False)
    monkeypatch.setattr(module, "PINNED", tmp_path / "pin.json")
    module.PINNED.write_text(json.dumps({"key": _pin_key(), "outcomes": {"m::C::test_a": "passed"}}))
    assert _pinned() == {"m::C::test_a": ("passed", "")}
    (tmp_path / "shim.py").write_text("# another shim\n")
    for target, name, value in (
        (opacus, "__version__", "0.0.0"),
        (torch, "__version__", "0.0.0"),
        (module, "SHIM", tmp_path / "shim.py"),
    ):
        with monkeypatch.context() as m:
            m.setattr(target, name, value)
            assert _pinned() is None, name
    monkeypatch.setenv("OPACUS_UPSTREAM_REPIN", "1")
    assert _pinned() is None


def test_ours_ends_every_upstream_test_as_vanilla_does_but_the_documented_ones(runs):
    vanilla, ours = runs["opacus"], runs["opacus_spectral"]
    assert set(ours) == set(vanilla)
    differ = {k for k in vanilla if vanilla[k][0] != ours[k][0]}
    unexpected = sorted(k for k in differ if k.rpartition("::")[2] not in EXPECTED)
    assert not unexpected, [(k, vanilla[k][0], ours[k][0], ours[k][1][:300]) for k in unexpected]
    for key in sorted(differ):
        _, marker = EXPECTED[key.rpartition("::")[2]]
        assert vanilla[key][0] == "passed" and ours[key][0] == "failed" and marker in ours[key][1], key
    stale = set(EXPECTED) - {k.rpartition("::")[2] for k in differ}
    assert not stale, f"ours now passes {sorted(stale)}: remove them from EXPECTED and docs/engine.md"
