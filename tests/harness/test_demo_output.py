"""dp-bench demo: where it writes (a fresh folder unless --out; the committed docs/results/demo* only with
--refresh-evidence), its arms (DP-SGD and BandMF with the noise-error proxy's b, each σ calibrated through its own
accounting; denoised DP-SGD arms on request) and --replot of the committed demo.json (read, never rewritten)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("opacus_spectral")
from dp_bench.commands import demo  # noqa: E402
from dp_bench.meta import RESULTS  # noqa: E402
from opacus_spectral.mechanisms.bandmf_math import optimal_coefficients  # noqa: E402

from opacus_spectral import epsilon_from_history, noise_multiplier_for  # noqa: E402

#: q = 16/128 = 0.125, T = 4, ε = 8: the proxy prefers b = 4 over DP-SGD here (b ∈ {1, 2, 4})
EPS, STEPS, Q = 8.0, 4, 16 / 128
TINY = [
    "--model",
    "tiny",
    "--steps",
    str(STEPS),
    "--batch-size",
    "16",
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
    str(EPS),
]


def evidence() -> dict[str, str]:
    """Hashes of the committed demo files."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.glob("demo*"))}


def sigma(q: float, steps: int) -> float:
    return noise_multiplier_for(target_epsilon=EPS, target_delta=1e-5, sample_rate=q, steps=steps, accountant="prv")


def proxy_ratios(q: float, steps: int) -> dict[int, float]:
    """RMSE_b / RMSE_1 = σ_b κ‖A M⁻¹‖_F / (σ_1‖A‖_F) (docs/mechanisms.md, "Choosing b"), with the prefix-sum A and
    the b-banded Toeplitz M built densely, σ_b calibrated for (b·q, ⌈T/b⌉), over b ∈ {1..32}, b ≤ T, b·q ≤ 1."""
    work = torch.tril(torch.ones(steps, steps, dtype=torch.float64))
    rmse = {}
    for b in (1, 2, 4, 8, 16, 32):
        if b > steps or b * q > 1:
            continue
        c = torch.tensor(optimal_coefficients(steps, b), dtype=torch.float64)
        m = sum(c[j] * torch.diag(torch.ones(steps - j, dtype=torch.float64), -j) for j in range(b))
        error = torch.linalg.solve_triangular(m, work, upper=False, left=False)  # A M⁻¹
        rmse[b] = sigma(b * q, math.ceil(steps / b)) * float(c.norm() * error.norm())
    return {b: r / rmse[1] for b, r in rmse.items()}


@pytest.mark.slow
def test_default_run_is_dp_sgd_against_bandmf_with_the_proxys_b(tmp_path, monkeypatch, capsys):
    before = evidence()
    monkeypatch.chdir(tmp_path)
    res = demo.main(TINY)
    assert evidence() == before  # the committed evidence is untouched
    (folder,) = tmp_path.glob("dp-bench-demo-*")
    assert res["out"] == str(folder) and (folder / "demo.json").is_file() and (folder / "demo_accuracy.png").is_file()
    assert not (folder / "demo_spectrum.png").exists()  # no denoised arm: no spectrum
    ratios = proxy_ratios(Q, STEPS)
    b = min(ratios, key=ratios.__getitem__)
    assert b > 1 and res["proxy"]["best_b"] == b
    assert {int(k): r["ratio"] for k, r in res["proxy"]["bands"].items()} == pytest.approx(ratios, rel=1e-9)
    assert list(res["arms"]) == list(res["summary"]) == ["dp-lora", f"bandmf:{b}"]
    dp, mf = res["arms"]["dp-lora"], res["arms"][f"bandmf:{b}"]
    assert (dp["method"], dp["hooks"], mf["method"], mf["hooks"]) == ("dp-sgd", [], f"bandmf:{b}", [])
    assert dp["noise_multiplier"] == sigma(Q, STEPS)
    assert mf["noise_multiplier"] == sigma(b * Q, math.ceil(STEPS / b)) != dp["noise_multiplier"]
    assert (mf["accounting"]["sample_rate"], mf["accounting"]["steps"]) == (b * Q, math.ceil(STEPS / b))
    for arm in (dp, mf):  # the engine's PRV ε: within 1 % below the target, for the accounting it was charged
        assert 0.99 * EPS <= arm["epsilon"] <= EPS
        charged = [(arm["noise_multiplier"], arm["accounting"]["sample_rate"], arm["accounting"]["steps"])]
        assert arm["epsilon"] == pytest.approx(epsilon_from_history(charged, 1e-5, "prv"), rel=1e-6)
    out = capsys.readouterr().out
    gap = 100 * (mf["accuracy"] - dp["accuracy"])
    assert (
        f"bandmf:{b} - dp-lora: {gap:+.2f} test accuracy points; eps {mf['epsilon']:.3f} vs {dp['epsilon']:.3f}" in out
    )
    assert demo.CAVEAT in out and f"bandmf:{b}: BandMF, b = {b}: lowest noise-error proxy" in out
    again = demo.main(["--replot", "--out", str(folder)])  # the new JSON replots, nothing missing
    assert again["missing"] == [] and again["summary"] == res["summary"]


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
    assert demo.Config(hooks=["ema", "rmt"]).extra_arms() == ["ema+rmt"]  # --hooks: one arm, as before
    assert demo.Config().extra_arms() == ["bandmf"]
    assert demo.arm_of("ema+rmt_paper") == demo.Arm("dp-lora+ema+rmt_paper", "dp-sgd", ("ema", "rmt_paper"))
    assert demo.arm_of("bandmf", 8) == demo.arm_of("bandmf:8") == demo.Arm("bandmf:8", "bandmf:8")
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--arms", "bandmf:0", "--out", str(tmp_path)])


def test_replot_of_the_committed_json_prints_its_comparison(tmp_path, monkeypatch, capsys):
    """The committed demo.json (DP-SGD vs BandMF, docs/demo.md "Measured") replots into a fresh folder, never over
    the evidence, with the numbers docs/demo.md quotes."""
    before = evidence()
    monkeypatch.chdir(tmp_path)
    res = demo.main(["--replot"])
    assert evidence() == before
    assert res["source"] == str(RESULTS / "demo.json") and Path(res["plots"]["accuracy"]).stat().st_size > 0
    assert Path(res["out"]).parent == tmp_path
    assert set(res["summary"]) == {"dp-lora", "bandmf:32"} and res["missing"] == []
    out = capsys.readouterr().out
    assert "0.7515" in out and "0.6868" in out  # the stored accuracies, as docs/demo.md quotes them
    assert "bandmf:32 - dp-lora: -6.47 test accuracy points; eps 6.684 vs 6.675" in out and demo.CAVEAT in out
    assert res["summary"]["bandmf:32"]["noise_multiplier"] == pytest.approx(0.920, abs=5e-4)  # docs/demo.md
