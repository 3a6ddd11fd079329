"""2-step smoke runs of the harness's commands (dp-bench centralized, regime-map, noise-std) on the tiny model, plus
their math (dp-bench federated: tests/harness/test_federated_bench.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("datasets")
from dp_bench import analysis as A  # noqa: E402
from dp_bench.adapters import Trainable  # noqa: E402
from dp_bench.commands import centralized, regime_map  # noqa: E402

pytestmark = pytest.mark.slow


def test_crossing_step_interpolates_between_checkpoints() -> None:
    curve = [(0, 0.5), (10, 0.6), (20, 0.8)]
    assert centralized.crossing_step(curve, 0.7) == pytest.approx(15.0)
    assert centralized.crossing_step(curve, 0.6) == pytest.approx(10.0)
    assert centralized.crossing_step(curve, 0.45) == 0.0
    assert centralized.crossing_step(curve, 0.81) is None


def test_eps_at_accuracy_log_interpolation_and_range() -> None:
    pts = [(1.0, 0.6), (4.0, 0.7), (16.0, 0.8)]
    eps, flag = centralized.eps_at_accuracy(pts, 0.65)
    assert flag == "" and eps == pytest.approx(2.0)  # halfway in log ε between 1 and 4
    assert centralized.eps_at_accuracy(pts, 0.75)[0] == pytest.approx(8.0)
    assert centralized.eps_at_accuracy(pts, 0.9) == (None, ">16")
    assert centralized.eps_at_accuracy(pts, 0.5) == (None, "<1")
    # a non-monotone baseline curve is made monotone (running max) before inverting
    assert centralized.eps_at_accuracy([(1.0, 0.6), (2.0, 0.55), (4.0, 0.7)], 0.65)[0] == pytest.approx(math.sqrt(8))


def test_gated_gain_stats_counts_only_gated_finite_entries() -> None:
    steps = [
        {"gated_names": ["a", "b"], "cos": {"a": [0.1, 0.2], "b": [0.3, 0.2], "c": [0.0, 1.0]}},
        {"gated_names": ["a"], "cos": {"a": [float("nan"), 0.1]}},
    ]
    s = A.gated_gain_stats(steps)
    assert (s["gated_layer_steps"], s["positive"]) == (2, 1)
    assert s["mean_gain"] == pytest.approx(0.0)


def test_method_hooks_and_plan() -> None:
    assert centralized.method_hooks("dp-lora") == []
    assert centralized.method_hooks("rmt+doppler") == ["rmt", "doppler"]
    from dp_bench.config import parse_config

    args = parse_config(
        centralized.Config,
        [
            "--seeds",
            "0",
            "1",
            "--epsilons",
            "3",
            "8",
            "--baseline-epsilons",
            "8",
            "16",
            "--methods",
            "dp-lora",
            "rmt",
            "doppler",
            "--doppler-epsilons",
            "3",
        ],
        prog="t",
        description="",
    )
    plan = centralized.planned_runs(args)
    assert plan[:5] == [("dp-lora", 3.0, 0), ("rmt", 3.0, 0), ("doppler", 3.0, 0), ("dp-lora", 8.0, 0), ("rmt", 8.0, 0)]
    assert ("doppler", 8.0, 0) not in plan and ("dp-lora", 16.0, 1) in plan and len(plan) == 12
    args.order = "priority"
    prio = centralized.planned_runs(args)
    assert sorted(prio) == sorted(plan)
    assert prio[:8] == [(m, e, s) for s in (0, 1) for e in (3.0, 8.0) for m in ("dp-lora", "rmt")]
    assert prio[8:10] == [("dp-lora", 16.0, 0), ("dp-lora", 16.0, 1)] and prio[10:] == [
        ("doppler", 3.0, 0),
        ("doppler", 3.0, 1),
    ]


def test_same_config_ignores_execution_settings_and_accepts_new_options_at_their_default() -> None:
    from dp_bench.config import same_config

    defaults = {"lr": 1.0, "threads": 2, "new_option": "off"}
    stored = {"lr": 1.0, "threads": 1}
    assert same_config(stored, {"lr": 1.0, "threads": 4, "new_option": "off"}, defaults=defaults, ignore={"threads"})
    assert not same_config(stored, {"lr": 1.0, "threads": 1, "new_option": "on"}, defaults=defaults, ignore=set())
    assert not same_config(stored, {"lr": 2.0, "threads": 1}, defaults=defaults, ignore={"threads"})
    assert not same_config(stored, {"lr": 1.0, "threads": 4}, defaults=defaults, ignore=set())
    assert not same_config({**stored, "gone": 1}, {"lr": 1.0, "threads": 1}, defaults=defaults, ignore=set())


def test_trainable_spec_parsing() -> None:
    assert Trainable.parse("lora:qkv:16") == Trainable("lora", "qkv", 16)
    assert Trainable.parse("full").kind == "full"
    with pytest.raises(ValueError):
        Trainable.parse("lora:qx:8")


def test_regime_map_smoke(tmp_path: Path) -> None:
    res = regime_map.main(
        [
            "--model",
            "tiny",
            "--trainables",
            "lora:qv:4",
            "--batches",
            "16",
            "--traj-steps",
            "2",
            "--sweep-steps",
            "1",
            "--out",
            str(tmp_path),
            "--threads",
            "1",
        ]
    )
    data = json.loads((tmp_path / "regime_map.json").read_text())
    t = data["trainables"]["lora:qv:4"]
    assert len(t["trajectory"]["per_step"]) == 2
    # top layer only (--top-layers 1): (q, v) x (A, B) LoRA factors + the classifier weight
    assert len(t["matrix_names"]) == 5
    cell = t["sweep"]["warm"]["16"]
    assert cell["summary"]["encoder_matrices"] == 4 and cell["per_step"][0]["matrices"] == 5
    assert all(-1.0 <= c <= 1.0 for e in t["trajectory"]["per_step"] for c in e["cos_global"])
    assert data["versions"]["torch"] and data["config"]["noise_multiplier"] == 1.0
    assert (tmp_path / "regime_map.png").stat().st_size > 0
    assert regime_map.main(["--replot", "--out", str(tmp_path)]) == tmp_path / "regime_map.png"
    assert res["trainables"]["lora:qv:4"]["sweep"]["init"]["16"]["per_step"][0]["sigma"] == pytest.approx(1.0 / 16)


def test_centralized_smoke(tmp_path: Path) -> None:
    argv = [
        "--model",
        "tiny",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--seeds",
        "0",
        "--epsilons",
        "3",
        "--baseline-epsilons",
        "6",
        "--methods",
        "dp-lora",
        "rmt",
        "--out",
        str(tmp_path),
        "--threads",
        "1",
    ]
    res = centralized.main(argv)
    runs = res["runs"]
    base, rmt = "eval|dp-lora|eps3|s0|lr0.005", "eval|rmt|eps3|s0|lr0.005"
    assert set(runs) == {base, rmt, "eval|dp-lora|eps6|s0|lr0.005"}  # the runner's one key format
    for r in runs.values():
        assert r["epsilon"] == pytest.approx(r["target_epsilon"], rel=0.02)
        assert [s for s, _ in r["curve"]] == [0, 1, 2]
    # no denoiser: the "denoised" gradient is the noisy one
    assert all(e["cos_global"][0] == e["cos_global"][1] for e in runs[base]["per_step"])
    assert all("gated" in e for e in runs[rmt]["per_step"])
    # same seed: same initial accuracy and same noise level in both arms
    assert runs[rmt]["curve"][0] == runs[base]["curve"][0]
    assert runs[rmt]["noise_multiplier"] == runs[base]["noise_multiplier"]
    an = res["analysis"]
    assert set(an["_baseline_eps_curve"]) == {"3", "6"}
    assert "rmt|3" in an and an["rmt|3"]["n_with_baseline"] == 1
    assert "| 3 | rmt |" in centralized.tables(res)
    # --resume keeps finished runs (nothing left to run)
    again = centralized.main(argv + ["--resume"])
    assert again["runs"][rmt]["per_step"] == json.loads(json.dumps(runs[rmt]["per_step"]))
    # a JSON from before the one key format ("method|ε|seed", no lr in the records) resumes without retraining
    path = tmp_path / "centralized.json"
    old = json.loads(path.read_text())
    old["runs"] = {f"{r['method']}|{r['target_epsilon']:g}|{r['seed']}": r for r in old["runs"].values()}
    for r in old["runs"].values():
        del r["lr"]
    path.write_text(json.dumps(old))
    rekeyed = centralized.main(argv + ["--resume"])["runs"]
    assert set(rekeyed) == set(runs) and rekeyed[rmt]["train_seconds"] == runs[rmt]["train_seconds"]
    assert centralized.main(["--replot", "--out", str(tmp_path)]) == tmp_path / "centralized.png"


def test_mean_curve_and_speedup_on_mean_curves() -> None:
    runs = [{"curve": [(0, 0.5), (10, 0.7), (20, 0.8)]}, {"curve": [(0, 0.5), (10, 0.5), (20, 0.8)]}]
    mc = centralized._mean_curve(runs)
    assert mc == [(0, 0.5), (10, pytest.approx(0.6)), (20, pytest.approx(0.8))]
    assert centralized.crossing_step(mc, 0.7) == pytest.approx(15.0)


def test_noise_std_command_prints_every_case(capsys) -> None:
    from dp_bench.commands import noise_std

    out = noise_std.main([])
    assert set(out) == set(noise_std.CASES)
    for sigma, measured in out.values():
        assert measured == pytest.approx(sigma, rel=0.03)
    assert capsys.readouterr().out.count("\n") == len(noise_std.CASES) + 2


def test_dp_bench_cli_dispatches_and_refuses_unknown_commands(tmp_path: Path) -> None:
    from dp_bench import cli

    with pytest.raises(SystemExit, match="usage: dp-bench"):
        cli.run(["no-such-command"])
    assert set(cli.COMMANDS) == {
        "demo",
        "centralized",
        "regime-map",
        "regime-map-llm",
        "federated",
        "overhead",
        "noise-std",
        "isolation-cost",
        "batch-check-cost",
        "fingerprint-cost",
        "mechanism-cost",
        "mechanism-setup",
        "mf-proxy",
        "grid",
        "audit",
        "overhead-llm",
    }
    for module in cli.COMMANDS.values():  # every command has a config dataclass and a main
        mod = __import__(module, fromlist=["main"])
        assert callable(mod.main)


def test_batch_check_cost_smoke(tmp_path: Path) -> None:
    from dp_bench.commands import batch_check_cost

    # batches of 16 of 64 records: a Poisson batch of fewer than 2 records (nothing to audit) has probability < 1e-6
    flags = ["--steps", "2", "--batch", "16", "--records", "64", "--engine-steps", "10"]
    res = batch_check_cost.main([*flags, "--out", str(tmp_path / "b.json")])
    engine = res["engine_audit"]
    assert engine["audits"] >= 8 and engine["audit_s_mean"] > 0 and 0 < engine["amortized_share_1000"]
    assert engine["expected_audits_1000"] == pytest.approx(8 + sum(4 / (k + 1) for k in range(8, 1000)))
    right, left = res["sides"]["right"], res["sides"]["left"]
    assert right["independent"] and right["check_s"] > 0 and right["step_s_median"] > 0 and not right["refused"]
    assert left["check_s"] > 0 and left["refused"] == (not left["independent"]) and res["check_over_step"]["left"] > 0


def test_fingerprint_cost_smoke_and_replot(tmp_path: Path) -> None:
    from dp_bench.commands import fingerprint_cost

    out, png = tmp_path / "f.json", tmp_path / "f.png"
    res = fingerprint_cost.main(["--records", "64", "--reps", "1", "--out", str(out), "--plot", str(png)])
    assert set(res["seconds"]) == {"datasets, python format", "datasets, torch format", "pairs"}
    assert all(s > 0 for s in res["seconds"].values()) and png.stat().st_size > 1000
    again = fingerprint_cost.main(["--replot", "--out", str(out), "--plot", str(png)])
    assert again["seconds"] == res["seconds"]


def test_isolation_cost_and_overhead_smoke(tmp_path: Path) -> None:
    from dp_bench.commands import isolation_cost, overhead

    res = isolation_cost.main(
        [
            "--steps",
            "1",
            "--reps",
            "2",
            "--cases",
            "lora",
            "--batch",
            "2",
            "--seq",
            "8",
            "--out",
            str(tmp_path / "iso.json"),
        ]
    )
    c = res["cases"]["lora"]
    assert c["copy_s_median"] > 0 and 0 < c["copy_over_step"] < 1 and c["grad_bytes"] > 0
    res = overhead.main(
        [
            "--cases",
            "lora",
            "--batch",
            "2",
            "--seq",
            "8",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--reps",
            "2",
            "--out",
            str(tmp_path / "ovh.json"),
        ]
    )
    c = res["cases"]["lora"]
    assert c["max_rel_diff_batched_vs_naive"] < 1e-4 and c["denoised_matrices"] == 73  # 72 LoRA factors + head
    assert json.loads((tmp_path / "ovh.json").read_text())["cases"]["lora"]["peak_extra_bytes"] >= 0
