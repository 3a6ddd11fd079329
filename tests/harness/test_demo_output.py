"""dp-bench demo: where it writes (a fresh folder unless --out; the committed docs/results/demo* only with
--refresh-evidence), its arms (Opacus alone, the default rmt, rmt_paper labelled as paper A's setting) and --replot
of the committed demo.json (read, never rewritten)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("opacus_spectral")
from dp_bench.commands import demo  # noqa: E402
from dp_bench.meta import RESULTS  # noqa: E402

TINY = [
    "--model",
    "tiny",
    "--steps",
    "2",
    "--batch-size",
    "32",
    "--physical-batch",
    "16",
    "--max-length",
    "12",
    "--lora-layers",
    "1",
    "--eval-every",
    "1",
    "--tiny-train",
    "128",
    "--tiny-test",
    "64",
    "--epsilon",
    "2",
]
ARMS = {"dp-lora", "dp-lora+rmt", "dp-lora+rmt_paper"}


def evidence() -> dict[str, str]:
    """Hashes of the committed demo files."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.glob("demo*"))}


@pytest.mark.slow
def test_default_run_writes_a_fresh_folder_with_three_labelled_arms(tmp_path, monkeypatch, capsys):
    before = evidence()
    monkeypatch.chdir(tmp_path)
    res = demo.main(TINY)
    assert evidence() == before  # the committed evidence is untouched
    (folder,) = tmp_path.glob("dp-bench-demo-*")
    assert res["out"] == str(folder) and (folder / "demo.json").is_file() and (folder / "demo_accuracy.png").is_file()
    assert set(res["summary"]) == set(res["arms"]) == ARMS
    notes = {label: arm["note"] for label, arm in res["arms"].items()}
    assert notes == {"dp-lora": None, "dp-lora+rmt": "default", "dp-lora+rmt_paper": "paper A's setting"}
    assert res["arms"]["dp-lora+rmt"]["hooks"] == ["rmt"] and res["arms"]["dp-lora+rmt_paper"]["hooks"] == ["rmt_paper"]
    assert "dp-lora+rmt_paper: paper A's setting" in capsys.readouterr().out
    for label in ARMS - {"dp-lora"}:  # both denoisers see all 13 matrices each step
        assert res["summary"][label]["considered_layer_steps"] == 2 * 13


def test_the_committed_evidence_is_written_only_with_refresh_evidence(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--out", str(RESULTS)])
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--refresh-evidence", "--out", str(tmp_path)])
    cfg = demo.Config(refresh_evidence=True)
    cfg.validate()
    assert demo.output_folder(cfg) == RESULTS
    assert demo.output_folder(demo.Config(out=tmp_path / "x")) == tmp_path / "x"
    monkeypatch.chdir(tmp_path)
    first, second = demo.output_folder(demo.Config()), demo.output_folder(demo.Config())
    assert first != second and first.parent == second.parent == tmp_path  # a new folder each run, even in 1 s
    assert demo.Config(hooks=["ema", "rmt"]).denoised_arms() == [["ema", "rmt"]]  # --hooks: one arm, as before
    assert demo.Config(arms=["ema+rmt_paper"]).denoised_arms() == [["ema", "rmt_paper"]]


def test_replot_of_the_committed_json_copes_with_the_missing_arm(tmp_path, monkeypatch, capsys):
    """The committed demo.json predates the third arm; its "rmt" arm ran what is now rmt_paper."""
    before = evidence()
    monkeypatch.chdir(tmp_path)
    res = demo.main(["--replot"])
    assert evidence() == before
    assert res["source"] == str(RESULTS / "demo.json") and Path(res["plots"]["accuracy"]).stat().st_size > 0
    assert Path(res["out"]).parent == tmp_path
    assert set(res["summary"]) == {"dp-lora", "dp-lora+rmt"} and res["missing"] == ["dp-lora+rmt_paper"]
    assert res["notes"]["dp-lora+rmt"] == demo.LEGACY_NOTE
    out = capsys.readouterr().out
    assert "0.7491" in out and "0.7397" in out  # the stored accuracies, as docs/demo.md quotes them
    assert "dp-lora+rmt_paper" in out
