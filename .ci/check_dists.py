"""Build, check and install the five distributions as a user gets them (the ``packaging`` tox env).

1. ``python -m build``: a wheel and an sdist of ``opacus_spectral``, ``peft_lalora`` and each of ``plugins/``;
2. ``twine check --strict`` on all of them, then their metadata against the pyprojects: name, the one shared
   version, the Apache-2.0 license expression and the repository's LICENSE text inside, the Python requirement, a
   Markdown description, the entry points, the import package as the wheel's only top level;
3. a fresh virtual environment with the wheels installed under ``constraints.txt`` (extras ``[hf]`` and
   ``[dp,flower]``), and the public API imported from it, outside the source tree.

Usage: ``python .ci/check_dists.py OUT_DIR`` (from the repository root); exits non-zero naming what failed.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = [ROOT / "opacus_spectral", ROOT / "peft_lalora", *sorted((ROOT / "plugins").glob("*/"))]
EXTRAS = {"opacus-spectral": "[hf]", "peft-lalora": "[dp,flower]"}
IMPORTS = """
import importlib.metadata as md
from opacus_spectral import PrivacyEngine, available_denoisers
from opacus_spectral.denoisers import RMTDenoiser
from opacus_spectral.hf import DPTrainer
from opacus_spectral.plugins.registry import load_errors
import peft_lalora
from peft_lalora import LALoraConfig
assert "/site-packages/" in peft_lalora.__file__, peft_lalora.__file__
names = set(available_denoisers())
assert {"rmt", "lowpass", "ema", "svht", "doppler", "disk"} <= names, names
assert not load_errors(), load_errors()
print("imported from the wheels:", {d: md.version(d) for d in %r}, sorted(names))
"""


def run(*cmd: object, cwd: Path = ROOT) -> None:
    print("$", *cmd, flush=True)
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True)


def project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def wheel_of(dist: Path, name: str) -> Path:
    (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    return wheel


def _member(z: zipfile.ZipFile, name: str) -> str:
    return z.read(name).decode() if name in z.namelist() else ""


def check_wheel(wheel: Path, proj: dict, version: str) -> list[str]:
    """What is wrong with one wheel's metadata, entry points and contents."""
    info = f"{proj['name'].replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(_member(z, f"{info}/METADATA"))
        entry = configparser.ConfigParser(delimiters=("=",))
        entry.optionxform = str  # entry-point names are case-sensitive
        entry.read_string(_member(z, f"{info}/entry_points.txt"))
        license_text = _member(z, f"{info}/licenses/LICENSE")
        tops = {n.split("/")[0] for n in z.namelist() if not n.startswith(info)}
    want = {
        "Name": proj["name"],
        "Version": version,
        "License-Expression": proj["license"],
        "Requires-Python": proj["requires-python"],
        "Description-Content-Type": "text/markdown",
        "License-File": "LICENSE",
    }
    wrong = [f"{wheel.name}: {k} is {meta.get(k)!r}, not {v!r}" for k, v in want.items() if meta.get(k) != v]
    groups = {**proj.get("entry-points", {}), **({"console_scripts": proj["scripts"]} if "scripts" in proj else {})}
    for group, points in groups.items():
        got = dict(entry[group]) if entry.has_section(group) else {}
        wrong += [f"{wheel.name}: entry point {group}:{k} missing" for k in points if got.get(k) != points[k]]
    if license_text != (ROOT / "LICENSE").read_text():
        wrong.append(f"{wheel.name}: the LICENSE inside is not the repository's")
    if tops != {proj["name"].replace("-", "_")}:
        wrong.append(f"{wheel.name}: top-level entries {sorted(tops)}, expected only the import package")
    return wrong


def check_sdist(dist: Path, proj: dict, version: str) -> list[str]:
    name = f"{proj['name'].replace('-', '_')}-{version}"
    with tarfile.open(dist / f"{name}.tar.gz") as t:
        files = {m.name for m in t.getmembers() if m.isfile()}
    return [
        f"{name}.tar.gz lacks {f}" for f in ("pyproject.toml", "README.md", "LICENSE") if f"{name}/{f}" not in files
    ]


def main(out: Path) -> int:
    dist = out / "dist"
    projects = {folder: project(folder) for folder in FOLDERS}
    version = projects[ROOT / "opacus_spectral"]["version"]
    for folder in FOLDERS:
        run(sys.executable, "-m", "build", "-q", "--outdir", dist, folder)
    run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    wrong = [
        f"{p['name']}: version {p['version']}, not {version}" for p in projects.values() if p["version"] != version
    ]
    for proj in projects.values():
        wrong += check_wheel(wheel_of(dist, proj["name"]), proj, version) + check_sdist(dist, proj, version)
    if wrong:
        print("\n".join(wrong), file=sys.stderr)
        return 1
    fresh = out / "fresh"
    run(sys.executable, "-m", "venv", "--clear", fresh)
    wheels = [f"{wheel_of(dist, p['name'])}{EXTRAS.get(p['name'], '')}" for p in projects.values()]
    run(fresh / "bin" / "pip", "install", "-q", "-c", ROOT / "constraints.txt", *wheels)
    names = [p["name"] for p in projects.values()]
    run(fresh / "bin" / "python", "-c", IMPORTS % (names,), cwd=out)  # outside the source tree
    run(fresh / "bin" / "peft-lalora", "--help", cwd=out)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
