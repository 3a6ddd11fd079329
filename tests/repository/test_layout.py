"""What the layout promises: the libraries import without the harness' heavy dependencies, and no source file
refers outside the repository, edits sys.path or grows a function past the size a reader can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_support import ROOT

MAX_FUNCTION_LINES = 80
SOURCES = [
    p
    for d in ("opacus_spectral", "peft_lalora", "benchmarks", "plugins")
    for p in (ROOT / d).rglob("*.py")
    if "tests" not in p.relative_to(ROOT).parts and "build" not in p.relative_to(ROOT).parts
]


@pytest.mark.slow
def test_importing_the_libraries_pulls_in_neither_flower_nor_datasets():
    code = (
        "import sys, peft_lalora, peft_lalora.federated, opacus_spectral\n"
        "bad = sorted(m for m in ('flwr', 'datasets', 'flwr_datasets', 'dp_bench') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    ("pattern", "what"),
    [
        (r"\.\./shared|shared/notes|DESIGN\.md", "a file outside the repository"),
        (r"\b(issue|item) \d+\b", "a tracker word"),
        (r"sys\.path\.(insert|append)", "a sys.path edit"),
    ],
)
def test_sources_do_not_refer_outside_the_repository(pattern, what):
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(pattern, line)
    ]
    assert not hits, f"{what} in {hits}"


#: the pages whose backticked repository paths must exist (docs/results.md aside: a log of runs, paths as they were)
DOC_PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md"),
]
TOP_FOLDERS = ("opacus_spectral", "peft_lalora", "plugins", "benchmarks", "examples", "tests", "docs")


def test_the_docs_name_repository_files_that_exist():
    """A backticked file path that starts at a top folder of the repository names a file there (plugins.md once
    sent plugin authors to `opacus_spectral/hookspecs.py`, not `opacus_spectral/src/opacus_spectral/hookspecs.py`)."""
    folders = "|".join(TOP_FOLDERS)
    named = [
        (page.name, path)
        for page in DOC_PAGES
        for path in re.findall(rf"`((?:{folders})/[\w./-]+\.\w+)(?:::\w+)?`", page.read_text(encoding="utf-8"))
    ]
    assert len(named) > 20
    missing = [f"{page}: {path}" for page, path in named if not (ROOT / path).is_file()]
    assert not missing, missing


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_functions_are_short():
    """Layout by concept, not by line count: files may be long, but no function is over 80 lines."""
    long = {
        f"{p.relative_to(ROOT)}::{f.name}": f.end_lineno - f.lineno + 1
        for p in SOURCES
        for f in _functions(p)
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, long


def test_no_formatter_skips():
    """Sources are formatted by ruff (120 columns); none opts out line by line."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: " + "skip" in line or "fmt: " + "off" in line
    ]
    assert not hits, hits


TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"
#: the test tree mirrors the code: a folder per distribution (with its subpackages), one for the harness, one for the
#: checks of the whole repository
LIBRARIES = {
    "opacus_spectral": ROOT / "opacus_spectral/src/opacus_spectral",
    "peft_lalora": ROOT / "peft_lalora/src/peft_lalora",
}


def test_no_test_module_imports_another():
    """Shared test helpers live in the support modules (``tests/support/``), never in a ``test_*.py`` module another
    one imports (so that each test module runs, and is collected, on its own)."""
    pattern = re.compile(r"^\s*(from|import)\s+test_\w+", re.MULTILINE)
    hits = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if pattern.search(p.read_text("utf-8")))
    assert not hits, hits
    helpers = [p.name for p in TESTS.rglob("test_*.py") if "def test_" not in p.read_text(encoding="utf-8")]
    assert not helpers, f"test modules without tests: {helpers}"


def test_tests_are_laid_out_like_the_code():
    """A library's tests sit in its folder or in the folder of one of its subpackages (``tests/opacus_spectral/hf/``
    for ``opacus_spectral.hf``); the support modules in ``tests/support/``, ``conftest.py`` at the top."""
    allowed = {TESTS / "harness", TESTS / "repository"}
    for name, package in LIBRARIES.items():
        allowed.add(TESTS / name)
        allowed |= {TESTS / name / d.name for d in package.iterdir() if (d / "__init__.py").exists()}
    misplaced = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if p.parent not in allowed)
    assert not misplaced, misplaced
    others = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if not p.name.startswith("test_") and p.parent != SUPPORT and p != TESTS / "conftest.py"
    )
    assert not others, others


def test_slow_tests_are_marked_one_way():
    """``pytest.mark.slow`` is the one way out of the fast lane: the markers of processes and federations (``ddp``,
    ``flower``, ``opacus_upstream``) come with it, and conftest adds none."""
    unmarked = []
    for p in TESTS.rglob("test_*.py"):
        text = p.read_text("utf-8")
        if re.search(r"mark\.(ddp|flower|opacus_upstream)\b", text) and "mark.slow" not in text:
            unmarked.append(str(p.relative_to(TESTS)))
    assert not unmarked, unmarked
    assert "add_marker(pytest.mark.slow" not in (TESTS / "conftest.py").read_text("utf-8")


def _harness_references(path: Path) -> list[str]:
    """Imports of ``dp_bench`` and strings naming one of its objects (``"dp_bench.task:tiny"``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "dp_bench"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dp_bench":
            found.append(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"dp_bench[\w.:]*", node.value)
        ):
            found.append(node.value)
    return found


def test_library_tests_do_not_use_the_harness():
    """The libraries' tests, and the support modules, run without ``dp_bench`` installed (``pytest.importorskip``
    of it is a use too): what the harness adds is tested in ``tests/harness/``."""
    paths = [*SUPPORT.glob("*.py"), *(TESTS / "opacus_spectral").rglob("*.py"), *(TESTS / "peft_lalora").rglob("*.py")]
    hits = {str(p.relative_to(TESTS)): refs for p in paths if (refs := _harness_references(p))}
    assert not hits, hits
