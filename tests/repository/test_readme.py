"""The README is a front page that works as written: its start-here block and both quickstarts run unchanged (nothing
filled in, offline), its test command is the one CI runs with the system package it needs, and its links reach files
and headings that exist."""

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


def _start_here() -> str:
    """The text of the README's first section, which must be "Start here", right below the title."""
    match = re.match(r"# [^\n]+\n\n## Start here\n(.*?)\n## ", README.read_text(), flags=re.S)
    assert match, "the README does not open with '## Start here' right below its title"
    return match.group(1)


def test_the_start_here_block_runs_as_written_and_prints_bandmfs_epsilon(tmp_path, monkeypatch, capsys):
    (code,) = re.findall(r"```python\n(.*?)```", _start_here(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__main__"}
    exec(compile(code, "README:start-here", "exec"), ns)
    engine = ns["engine"]
    # BandMF with b = 4 over T = 32 steps at q = 64/1024: charged as DP-SGD at (σ = 1, 4q, 32/4 steps)
    assert engine.mechanism_run is not None and engine.accountant.history == [(1.0, 0.25, 8)]
    assert f"ε = {engine.get_epsilon(1e-5):.2f} at δ = 1e-5" in capsys.readouterr().out


def test_the_start_here_proxy_command_parses_and_writes_outside_the_committed_results(tmp_path):
    """The ``dp-bench mf-proxy`` flags of "Start here" are the command's own, and its --out / --plot keep it off
    ``docs/results/`` (its defaults, which hold the committed evidence)."""
    mf_proxy = pytest.importorskip("dp_bench.commands.mf_proxy")
    from dp_bench.config import parse_config

    (command,) = re.findall(r"`\.tox-venv/bin/tox -e bench -- mf-proxy ([^`]*)`", _start_here())
    cfg = parse_config(mf_proxy.Config, command.split(), prog="dp-bench mf-proxy", description="")
    results = (ROOT / "docs" / "results").resolve()
    assert results not in (ROOT / cfg.out).resolve().parents and results not in (ROOT / cfg.plot).resolve().parents


def test_the_readme_names_the_system_package_the_tests_need():
    """.ci/run installs one Debian package as root; tox requires it (PEFT_LALORA_REQUIRE_DATA=1): the README says
    both, and what a user who is not root does."""
    package = re.search(r"apt-get install -y -qq (\S+)", (ROOT / ".ci" / "run").read_text()).group(1)
    assert re.search(r"^\s*PEFT_LALORA_REQUIRE_DATA = 1$", (ROOT / "tox.ini").read_text(), flags=re.M)
    development = README.read_text().partition("## Development")[2]
    assert f"`{package}`" in development and f"apt-get install -y {package}" in development
    assert "PEFT_LALORA_REQUIRE_DATA=1" in development and "Not root" in development


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
