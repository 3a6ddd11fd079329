"""What the distributions declare: one range per dependency across every pyproject (extras included), and the
tested pins in constraints.txt inside every range, so what CI tests is what a user's resolver may pick."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from repo_support import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's); 3.10 skips this module
LIBRARIES = ("opacus_spectral", "peft_lalora", "benchmarks")
PYPROJECTS = sorted([*(ROOT / d for d in LIBRARIES), *(ROOT / "plugins").iterdir()])
OURS = {"opacus-spectral", "peft-lalora"}


def _declared() -> dict[str, dict[str, str]]:
    """{dependency: {where: specifier}} over the dependencies and extras of every distribution."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for folder in PYPROJECTS:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
        for extra, reqs in groups.items():
            for text in reqs:
                req = Requirement(text)
                name = canonicalize_name(req.name)
                if name not in OURS:
                    out[name][f"{project['name']}[{extra}]" if extra else project["name"]] = str(req.specifier)
    return out


def _pins_of(path: Path) -> dict[str, str]:
    pairs = (line.split("==") for line in path.read_text().splitlines() if "==" in line and not line.startswith("#"))
    return {canonicalize_name(name): version.strip() for name, version in pairs}


def test_each_dependency_has_one_declared_range_wherever_it_is_declared():
    ranged = {name: where for name, where in _declared().items() if len({s for s in where.values() if s}) > 1}
    assert not ranged, f"one dependency, several ranges: {ranged}"


def test_the_tested_pins_satisfy_every_declared_range():
    pins = _pins_of(ROOT / "constraints.txt")
    outside = [
        f"{name}=={pins[name]} vs {spec} in {where}"
        for name, declared in _declared().items()
        for where, spec in declared.items()
        if name in pins and spec and not Requirement(f"{name}{spec}").specifier.contains(pins[name], prereleases=True)
    ]
    assert not outside, outside


def test_torch_and_transformers_are_bounded_above():
    for name in ("torch", "transformers"):
        for where, spec in _declared()[name].items():
            assert "<" in spec, f"{name} in {where} has no upper bound ({spec!r}): an unconstrained install drifts"


COMPAT_FLOATS = {
    "torch",
    "opacus",
    "peft",
    "transformers",
    "accelerate",
    "huggingface-hub",
    "tokenizers",
    "safetensors",
}


def test_the_compat_env_floats_only_the_core_stack_and_pins_the_rest_as_ci_does():
    tested, compat = _pins_of(ROOT / "constraints.txt"), _pins_of(ROOT / "constraints-compat.txt")
    assert compat == {name: v for name, v in tested.items() if name not in COMPAT_FLOATS}


RELEASED = (ROOT / "opacus_spectral", ROOT / "peft_lalora", *sorted((ROOT / "plugins").iterdir()))


def test_the_released_distributions_share_one_version_with_the_packages_and_the_changelog():
    versions = {d.name: tomllib.loads((d / "pyproject.toml").read_text())["project"]["version"] for d in RELEASED}
    for package in ("opacus_spectral", "peft_lalora"):
        init = (ROOT / package / "src" / package / "__init__.py").read_text()
        versions[f"{package}.__version__"] = re.search(r'^__version__ = "([^"]+)"', init, flags=re.M).group(1)
    newest = re.search(r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    versions["CHANGELOG.md"] = newest.group(1)
    assert len(set(versions.values())) == 1, versions


def test_every_released_distribution_carries_the_repository_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for d in RELEASED:
        project = tomllib.loads((d / "pyproject.toml").read_text())["project"]
        assert project["license"] == "Apache-2.0", d
        assert (d / "LICENSE").read_text() == text, f"{d.name}/LICENSE is not the repository's (a link to ../LICENSE)"
