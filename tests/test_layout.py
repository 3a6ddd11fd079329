"""What the layout promises: the libraries import without the harness' heavy dependencies, and no source file
refers outside the repository, edits sys.path or grows past the size a reader can hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("opacus_spectral", "peft_lalora", "benchmarks", "plugins") for p in (ROOT / d).rglob("*.py")
           if "tests" not in p.relative_to(ROOT).parts]  # fmt: skip


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
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(pattern, line)]  # fmt: skip
    assert not hits, f"{what} in {hits}"


def test_no_source_file_is_longer_than_a_reader_can_hold():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 460}
    assert not long, long
