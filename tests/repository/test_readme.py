"""The README is a front page that works as written: both quickstarts run unchanged (nothing filled in, offline), its
test command is the one CI runs, and its links reach files and headings that exist."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from repo_support import ROOT

README = ROOT / "README.md"


def _quickstarts() -> dict[str, str]:
    text = README.read_text()
    return dict(re.findall(r"^## Quickstart: (\S+)\n.*?```python\n(.*?)```", text, flags=re.S | re.M))


def _run(title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(tmp_path)  # the snippets write where they run, as they would for a user
    ns: dict = {"__name__": "__main__"}
    exec(compile(_quickstarts()[title], f"README:{title}", "exec"), ns)
    return ns


def test_the_readme_has_the_two_quickstarts_in_order():
    assert list(_quickstarts()) == ["opacus_spectral", "peft_lalora"]


def test_opacus_spectral_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    ns = _run("opacus_spectral", tmp_path, monkeypatch)
    assert ns["engine"].post_hooks.logical_steps == 2 * 16  # two epochs of 1024 records at an expected batch of 64
    assert "rmt" in ns["engine"].post_hooks.diagnostics.last.denoisers
    epsilon = ns["engine"].get_epsilon(1e-5)
    assert 0 < epsilon < 10
    assert f"ε = {epsilon:.2f} at δ = 1e-5" in capsys.readouterr().out


def test_peft_lalora_quickstart_runs_as_written(tmp_path, monkeypatch):
    ns = _run("peft_lalora", tmp_path, monkeypatch)
    assert ns["controller"].mode == "step"
    assert ns["engine"].post_hooks.logical_steps == 256 // 32
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter-lora" / "adapter_config.json").exists()


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert ci in [b.strip() for b in blocks], f"README has no block with CI's command {ci!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower()
    kept = (c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


def test_every_relative_link_of_the_readme_reaches_a_file_and_heading():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert len(links) > 10
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else README
        if not path.exists() or (anchor and anchor not in _anchors(path)):
            broken.append(link)
    assert not broken, broken


def test_slug_matches_github_on_a_heading_of_results_md():
    # the anchor results.md's own table of contents uses for §2 (GitHub's rendering)
    assert _slug("2. Centralized benchmark (paper A) and rmt + doppler (issue 5)") == (
        "2-centralized-benchmark-paper-a-and-rmt--doppler-issue-5"
    )
