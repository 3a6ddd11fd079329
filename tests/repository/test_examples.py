"""Every script in ``examples/`` runs as a user runs it — ``python examples/<name>.py --tiny`` in a subprocess, from
an empty working directory — and follows the convention: a docstring that says what it shows, the real-size command
and ``--tiny``. The denoiser-plugin script first gets its plugin installed for real (pip, into a temporary target)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_support import ROOT, subprocess_env

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def _docstring(script: Path) -> str:
    match = re.match(r'\s*(?:#.*\n)*\s*"""(.*?)"""', script.read_text(), flags=re.S)
    return match.group(1) if match else ""


def _install_plugin(tmp_path: Path) -> Path:
    """The plugin's ``pip install``, from a copy (the build writes next to its sources), into a target folder."""
    source, target = tmp_path / "plugin-src", tmp_path / "site"
    shutil.copytree(EXAMPLES / "denoiser_plugin", source)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, text=True, timeout=300)
    return target


def _run(script: Path, tmp_path: Path, *args: str, front: tuple[Path, ...] = ()) -> str:
    env = subprocess_env(*front)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(script), "--tiny", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script.name} --tiny failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_each_example_documents_what_it_shows_its_real_size_command_and_tiny(script):
    doc = _docstring(script)
    assert len(doc.splitlines()) >= 3, f"{script.name}: no docstring saying what it shows"
    assert f"python examples/{script.name}" in doc, f"{script.name}: the docstring lacks the command that runs it"
    assert "--tiny" in doc, f"{script.name}: the docstring lacks the --tiny command"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_each_example_runs_tiny(script, tmp_path):
    if script.name == "engine_denoiser.py":
        out = _run(script, tmp_path)
        lines = out.splitlines()
        rows = {line.split()[0]: line.split() for line in lines[1:3]}
        assert set(rows) == {"none", "rmt"}, out
        assert all(abs(float(r[2]) - 3.0) < 0.05 for r in rows.values()), f"ε is not the target 3 in both arms: {out}"
        said = re.match(r"One seed, one noise draw per arm: the gap of ([+-][0-9.]+) points (.*)", lines[3])
        assert said, f"the example does not say that it ran one seed per arm: {out}"
        gap = 100 * (float(rows["rmt"][1]) - float(rows["none"][1]))  # from the rounded table: within 0.1
        assert abs(float(said.group(1)) - gap) <= 0.11, out
        seed_noise = abs(float(said.group(1))) <= 17
        assert said.group(2).startswith("is within seed noise" if seed_noise else "is wider than"), out
    elif script.name == "use_denoiser_plugin.py":
        out = _run(script, tmp_path, front=(_install_plugin(tmp_path),))
        assert "'softshrink' comes from the distribution 'opacus-spectral-softshrink'" in out, out
        assert re.search(r"softshrink set \d+\.\d% of the gradient entries to zero", out), out
    elif script.name == "federate_csv.py":
        out = _run(script, tmp_path, "--workdir", "run")
        for adapter in (tmp_path / "run" / "adapter", tmp_path / "run" / "adapter" / "lora"):
            assert (adapter / "adapter_config.json").is_file(), f"no adapter in {adapter}: {out}"
        assert re.search(r"predictions: \{'the movie was great': '(pos|neg)'", out), out
    else:  # an example without expectations of its own here: it must at least run
        _run(script, tmp_path)


def test_the_plugin_script_says_how_to_install_the_plugin_when_it_is_missing(tmp_path):
    """Without the plugin distribution the script stops with the install command, not a registry error."""
    from opacus_spectral import available_denoisers

    if "softshrink" in available_denoisers():
        pytest.skip("opacus-spectral-softshrink is installed in this environment")
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "use_denoiser_plugin.py"), "--tiny"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "pip install -c constraints.txt ./opacus_spectral ./examples/denoiser_plugin" in proc.stderr
