"""``dp-bench mechanism-cost`` and ``dp-bench mf-proxy`` end to end at tiny sizes: every ratio and share recomputed from
what the JSON stores, the stream's memory against (b − 1) × the trainable bytes, and the proxy against an independent
float64 computation of its definition (no timing assertions)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TINY_QV_PARAMS = 2 * (2 * 32 * 32 + 32 * 32 + 16 * 32)  # tiny Llama, LoRA r = 32 on q / v, 2 layers
VISION_PARAMS = {"mlp": 203_530, "cnn": 26_010}


def _cost(tmp_path: Path, *flags: str) -> dict:
    from dp_bench import cli

    return cli.run(
        [
            "mechanism-cost",
            "--model",
            "tiny",
            "--bands",
            "1,8",
            "--horizon",
            "16",
            "--lora-batch",
            "4",
            "--lora-physical",
            "2",
            "--seq",
            "8",
            "--lora-records",
            "32",
            "--vision-batch",
            "8",
            "--vision-records",
            "64",
            "--lora-rounds",
            "2",
            "--vision-rounds",
            "2",
            "--reps",
            "3",
            "--out",
            str(tmp_path / "mc.json"),
            "--plot",
            str(tmp_path / "mc.png"),
            *flags,
        ]
    )


def test_mechanism_cost_ratios_shares_and_stream_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _cost(tmp_path)
    stored = json.loads((tmp_path / "mc.json").read_text())
    assert stored == json.loads(json.dumps(res)) and (tmp_path / "mc.png").stat().st_size > 0
    assert stored["command"].startswith("dp-bench mechanism-cost --model tiny")
    assert list(stored["beds"]) == ["lora", "mlp", "cnn"]
    for bed, c in stored["beds"].items():
        assert c["trainable_params"] == VISION_PARAMS.get(bed, TINY_QV_PARAMS)
        assert c["trainable_bytes"] == 4 * c["trainable_params"]  # float32
        assert c["sample_rate"] == pytest.approx(c["batch"] / c["records"])
        assert set(c["arms"]) == {"gaussian", "b1", "b8"}
        for arm in c["arms"].values():
            assert len(arm["raw_step_s"]) == 2 and len(arm["raw_add_noise_s"]) == 2  # one add_noise per DP step
            assert arm["step_s"]["median"] == statistics.median(arm["raw_step_s"]) > 0
        g = c["arms"]["gaussian"]
        for b, r in c["bands"].items():
            a = c["arms"][f"b{b}"]
            assert r["step_ratio"] == pytest.approx(a["step_s"]["median"] / g["step_s"]["median"])
            rounds = [x / y for x, y in zip(a["raw_step_s"], g["raw_step_s"], strict=True)]
            assert r["round_ratio"]["median"] == pytest.approx(statistics.median(rounds))
            assert r["noise_share_of_step"] == pytest.approx(a["add_noise_s"]["median"] / a["step_s"]["median"])
            extra = (a["add_noise_s"]["median"] - g["add_noise_s"]["median"]) / g["step_s"]["median"]
            assert r["extra_noise_share"] == pytest.approx(extra)
            offline = r["offline_stream"]
            assert f"threads_{stored['threads']}" in offline
            for o in offline.values():
                assert o["seconds"]["n"] == 3 and o["seconds"]["median"] > 0
                assert o["share_of_gaussian_step"] == pytest.approx(o["seconds"]["median"] / g["step_s"]["median"])
            # primed to the steady state: b − 1 buffers of every trainable tensor (3 DP steps alone would hold 3)
            assert r["stream_bytes"] == r["expected_bytes"] == (int(b) - 1) * c["trainable_bytes"]
    assert stored["beds"]["lora"]["bands"]["1"]["stream_bytes"] == 0
    capsys.readouterr()
    from dp_bench import cli

    cli.run(["mechanism-cost", "--replot", "--out", str(tmp_path / "mc.json"), "--plot", str(tmp_path / "re.png")])
    table = capsys.readouterr().out
    assert "| cnn | 8 |" in table and "| lora | 1 |" in table and (tmp_path / "re.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--beds", "mlp,bogus"], "unknown or no beds"),
        (["--bands", "0,4"], "--bands must be integers"),
        (["--bands", "4", "--horizon", "2"], "[1, --horizon=2]"),
        (["--lora-physical", "8", "--lora-batch", "4"], "--lora-physical <= --lora-batch"),
    ],
)
def test_mechanism_cost_refuses_bad_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dp_bench.commands import mechanism_cost

    with pytest.raises(SystemExit):
        mechanism_cost.main(flags)
    assert message in capsys.readouterr().err


def _independent_ratio(coefs: list[float], steps: int, sigma_b: float, sigma_1: float) -> float:
    """σ_b ‖A M⁻¹‖_F / (σ_1 ‖A‖_F) in numpy: A the prefix sums, M[t, t − j] = c_j."""
    m = sum(np.diag(np.full(steps - j, c), -j) for j, c in enumerate(coefs))
    a = np.tril(np.ones((steps, steps)))
    return sigma_b * np.linalg.norm(a @ np.linalg.inv(m)) / (sigma_1 * np.linalg.norm(a))


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
def test_mf_proxy_matches_its_definition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dp_bench import cli
    from opacus_spectral.accounting.calibration import noise_multiplier_for

    out, png = tmp_path / "mfp.json", tmp_path / "mfp.png"
    flags = ["--steps", "12", "--bands", "1,2,4,16", "--epsilons", "2", "--sample-rate", "0.3", "--accountant", "rdp"]
    flags += ["--tolerance", "0.05"]
    res = cli.run(["mf-proxy", *flags, "--out", str(out), "--plot", str(png)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and png.stat().st_size > 0
    assert list(res["cells"]["12"]["epsilons"]["2"]["bands"]) == ["1", "2"]  # b·q > 1 (4 × 0.3), b > T (16) skipped
    cell, fact = res["cells"]["12"]["epsilons"]["2"], res["cells"]["12"]["factorizations"]
    assert res["cells"]["12"]["dpsgd_frobenius"] == pytest.approx(np.linalg.norm(np.tril(np.ones((12, 12)))))
    sigma_1 = noise_multiplier_for(
        target_epsilon=2, target_delta=1e-5, sample_rate=0.3, steps=12, accountant="rdp", epsilon_tolerance=0.05
    )
    sigma_2 = noise_multiplier_for(
        target_epsilon=2, target_delta=1e-5, sample_rate=0.6, steps=6, accountant="rdp", epsilon_tolerance=0.05
    )
    assert cell["bands"]["1"]["sigma"] == sigma_1 and cell["bands"]["2"]["sigma"] == sigma_2
    assert cell["bands"]["1"]["ratio"] == 1.0
    assert fact["2"]["kappa"] == pytest.approx(1.0, abs=1e-12)
    want = _independent_ratio(fact["2"]["coefficients"], 12, sigma_2, sigma_1)
    assert cell["bands"]["2"]["ratio"] == pytest.approx(want, rel=1e-9)
    assert cell["bands"]["2"]["rmse"] == pytest.approx(sigma_2 * fact["2"]["frobenius"] / math.sqrt(12))
    assert cell["best_b"] == int(min(cell["bands"], key=lambda b: cell["bands"][b]["ratio"]))
    capsys.readouterr()
    cli.run(["mf-proxy", "--replot", "--out", str(out), "--plot", str(png)])
    assert "| 12 | 2 | 1.000 |" in capsys.readouterr().out
    # the final parameters' noise under momentum 0.9, the coefficients unchanged (still the prefix-sum ones)
    res = cli.run(["mf-proxy", *flags, "--momentum", "0.9", "--rows", "last", "--out", str(out), "--plot", str(png)])
    cell, fact2 = res["cells"]["12"]["epsilons"]["2"], res["cells"]["12"]["factorizations"]
    assert fact2["2"]["coefficients"] == fact["2"]["coefficients"]
    last = np.array([sum(0.9**k for k in range(12 - s)) for s in range(12)])  # Σ_{u=s}^{11} β^{u−s}
    assert res["cells"]["12"]["dpsgd_frobenius"] == pytest.approx(np.linalg.norm(last), rel=1e-12)
    m = sum(np.diag(np.full(12 - j, c), -j) for j, c in enumerate(fact["2"]["coefficients"]))
    want = sigma_2 * np.linalg.norm(last @ np.linalg.inv(m)) / (sigma_1 * np.linalg.norm(last))
    assert cell["bands"]["2"]["ratio"] == pytest.approx(want, rel=1e-9) and cell["bands"]["1"]["ratio"] == 1.0


def test_mechanism_setup_compares_the_optimizers_and_times_the_set_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dp-bench mechanism-setup`` at tiny sizes (issue 50): the structured optimum's objective within 1e-6 of the
    dense one's, make_private with an empty and a filled coefficient cache, and DPTrainer with
    BandMF for a few steps; the JSON is what the command returned and its replot prints the tables."""
    from dp_bench import cli

    out, png = tmp_path / "setup.json", tmp_path / "setup.png"
    flags = ["--dense-steps", "40", "--dense-bands", "4", "--setup-steps", "300", "--setup-bands", "8"]
    flags += [
        "--long-steps",
        "0",
        "--trainer-steps",
        "8",
        "--out",
        str(out),
        "--plot",
        str(png),
    ]  # no optimizer-only case
    res = cli.run(["mechanism-setup", *flags])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and png.stat().st_size > 0
    assert abs(res["dense"][0]["result"]["relative_objective"]) < 1e-6
    assert res["make_private"]["result"]["seconds"] > 0 and res["make_private_cached"]["steps"] == 300
    assert "long" not in res
    from opacus_spectral import epsilon_from_history

    # BandMF b = 4 at q = 8/512, σ = 1 (κ = 1): DP-SGD's (1, 4q) charged at steps 0 and 4 of 8
    charged = epsilon_from_history([(1.0, 4 * 8 / 512, 2)], 1e-5, "prv")
    assert res["trainer"]["result"]["steps_done"] == 8
    assert res["trainer"]["result"]["epsilon"] == pytest.approx(charged, rel=1e-6)
    capsys.readouterr()
    cli.run(["mechanism-setup", "--replot", "--out", str(out), "--plot", str(png)])
    assert "| make_private_cached | 300 | 8 |" in capsys.readouterr().out
