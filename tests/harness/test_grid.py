"""The Fashion-MNIST bed: the IDX reader (on files written here), the missing-package error, the real Debian
package when installed (required under PEFT_LALORA_REQUIRE_DATA=1), and a smoke run of ``dp-bench grid`` on a
small synthetic copy of the dataset (tuning + paired evaluation + report)."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
from dp_bench import data as D  # noqa: E402
from dp_bench.data import images  # noqa: E402
from fmnist_support import synthetic_fmnist, write_idx  # noqa: E402

pytestmark = pytest.mark.slow


def test_read_idx_round_trip_and_rejects_corrupt_files(tmp_path: Path) -> None:
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", a)
    np.testing.assert_array_equal(images.read_idx(tmp_path / "a.gz"), a)
    with gzip.open(tmp_path / "short.gz", "wb") as f:  # header says 2×3×4, body has 5 bytes
        f.write(struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">3I", 2, 3, 4) + bytes(5))
    with pytest.raises(ValueError, match="bytes for shape"):
        images.read_idx(tmp_path / "short.gz")
    with gzip.open(tmp_path / "float.gz", "wb") as f:  # dtype 0x0D (float32) is not what the loader parses
        f.write(struct.pack(">BBBB", 0, 0, 0x0D, 1) + struct.pack(">I", 1) + bytes(4))
    with pytest.raises(ValueError, match="unsigned-byte"):
        images.read_idx(tmp_path / "float.gz")


def test_loader_scales_and_pairs_and_names_the_package_when_missing(tmp_path: Path) -> None:
    d = D.load_fashion_mnist(synthetic_fmnist(tmp_path, n_train=40, n_test=20))
    x, y = d["train"]
    assert x.shape == (40, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.max()) == 1.0 and float(x.min()) >= 0.0
    assert d["test"][0].shape[0] == 20
    with pytest.raises(D.DataUnavailableError, match="apt-get install dataset-fashion-mnist"):
        D.load_fashion_mnist(tmp_path / "nowhere")


def test_real_debian_package_has_the_published_sizes() -> None:
    if not (images.DEFAULT_ROOT / images.FILES["train"][0]).is_file():
        msg = f"dataset-fashion-mnist not installed ({images.DEFAULT_ROOT})"
        if os.environ.get("PEFT_LALORA_REQUIRE_DATA") == "1":
            pytest.fail(msg + " but PEFT_LALORA_REQUIRE_DATA=1 (.ci/run installs it as root)")
        pytest.skip(msg)
    d = D.load_fashion_mnist(images.DEFAULT_ROOT)
    assert d["train"][0].shape == (60000, 1, 28, 28) and d["test"][0].shape == (10000, 1, 28, 28)
    counts = torch.bincount(d["train"][1], minlength=10)
    assert counts.tolist() == [6000] * 10  # the dataset is balanced: 6,000 per class


def test_grid_command_smoke_tunes_evaluates_paired_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dp_bench.commands import grid

    monkeypatch.setenv("FASHION_MNIST_ROOT", str(synthetic_fmnist(tmp_path / "data")))
    methods = ["none", "rmt"]
    out = grid.main(
        [
            "--smoke",
            "--methods",
            *methods,
            "--epsilons",
            "1",
            "3",
            "--out",
            str(tmp_path),
            "--name",
            "s",
            "--no-references",
        ]
    )
    saved = json.loads((tmp_path / "s.json").read_text())
    evals = [r for k, r in saved["runs"].items() if k.startswith("eval|")]
    assert any(k.startswith("tune|") for k in saved["runs"])  # lr chosen on validation runs first
    assert {r["method"] for r in evals} == set(methods)
    assert {r["seed"] for r in evals} == {0, 1}
    for r in evals:  # every ε printed comes from the PRV accountant and sits at (or under) its target
        assert 0 < r["epsilon_prv"] <= r["target_epsilon"] * 1.001
        assert 0.0 <= r["final_test"] <= 1.0
    # the same seed gives every method the same initial model and batches: step-0 accuracy is shared
    first = {(r["method"], r["seed"], r["target_epsilon"]): r["test"][0][1] for r in evals}
    for (_method, s, e), acc in first.items():
        assert acc == first[("none", s, e)]
    assert (tmp_path / "s.png").is_file()
    assert out["analysis"]
    from dp_bench.meta import checkout

    for r in saved["runs"].values():  # every run proves its code, its time and its sampler (§12.G)
        p = r["provenance"]
        assert {k: p[k] for k in ("commit", "dirty", "diff")} == checkout() and p["started"] <= p["ended"]
        assert (p["sampler"], p["adjacency"], p["accountant"]) == ("poisson", "add/remove", "prv")


def test_the_grid_prints_validation_only_and_reports_test_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """While a grid runs nothing prints a test score; ``--replot`` (its report, test included) refuses an
    incomplete grid (§12.G)."""
    from dp_bench.commands import grid

    monkeypatch.setenv("FASHION_MNIST_ROOT", str(synthetic_fmnist(tmp_path / "data")))
    argv = ["--smoke", "--methods", "none", "--epsilons", "3", "--out", str(tmp_path), "--name", "v", "--no-references"]
    grid.main(argv)
    printed = capsys.readouterr()
    text = printed.err + printed.out
    assert re.search(r" val 0\.\d{4}", text) and not re.search(r"test \d", text)  # no test score printed
    assert "--replot" in printed.out
    stored = json.loads((tmp_path / "v.json").read_text())
    assert grid.missing_cells(stored) == 0
    del stored["runs"][next(k for k in stored["runs"] if k.startswith("eval|"))]
    (tmp_path / "v.json").write_text(json.dumps(stored))
    assert grid.missing_cells(stored) == 1
    with pytest.raises(SystemExit, match="1 planned cells are not run yet"):
        grid.main([*argv, "--replot"])
    assert "final test" not in capsys.readouterr().out


def test_several_tuning_seeds_plan_a_cell_each_and_record_each_seeds_score() -> None:
    from dp_bench import runner
    from dp_bench.commands import grid

    cfg = grid.Config(
        methods=["none"], optimizers=["sgd"], batches=[256], epsilons=[3.0], seeds=[0], references=False,
        tune_seeds=[100, 101, 102], lr_grid_sgd=[1.0, 2.0, 4.0],
    )  # fmt: skip
    plan = grid.planned(cfg)
    assert [(c.phase, c.seed) for c in plan] == [("tune", 100), ("tune", 101), ("tune", 102), ("eval", 0)]
    result: dict = {"runs": {}, "lr_choice": {}}
    scores = {100: (0.9, 0.5, 0.4), 101: (0.1, 0.6, 0.5), 102: (0.1, 0.6, 0.5)}  # seed 100 alone would choose 1
    for seed, vals in scores.items():
        for lr, v in zip((1.0, 2.0, 4.0), vals, strict=True):
            result["runs"][grid.run_key("tune", "none", "sgd", 256, 3.0, seed, lr)] = {"final_val": v}
    assert grid.GridSchedule(cfg).lrs(plan[-1], result) == [2.0]
    choice = result["lr_choice"]["none|sgd|B256"]
    assert choice["val"][2.0] == pytest.approx(0.5666666, abs=1e-6) and choice["val_by_seed"][100][1.0] == 0.9
    with pytest.raises(SystemExit):
        from dp_bench.config import parse_config

        parse_config(grid.Config, ["--tune-seeds", "0", "--seeds", "0", "1"], prog="dp-bench grid", description="")
    assert runner.next_run(result["runs"], plan, grid.GridSchedule(cfg), result, lambda k: True)[0][2].startswith(
        "eval|none|sgd|B256|eps3|s0|lr2"
    )


def test_resume_may_grow_the_grid_but_never_drop_or_change_what_is_stored() -> None:
    from dp_bench.commands import grid
    from dp_bench.config import as_json

    stored = as_json(grid.Config(epsilons=[3.0], seeds=[0, 1], methods=["none", "rmt"]))
    grown = grid.Config(epsilons=[3.0, 1.0], seeds=[0, 1, 2], methods=["none", "rmt", "ema"], threads=1)
    assert grid.resumable(stored, as_json(grown))
    elsewhere = grid.Config(epsilons=[3.0], seeds=[0, 1], methods=["none", "rmt"], out=Path("/another/checkout"))
    assert grid.resumable(stored, as_json(elsewhere))  # the same grid, resumed from another clone
    for bad in (
        grid.Config(epsilons=[1.0], seeds=[0, 1], methods=["none", "rmt"]),  # drops ε = 3
        grid.Config(epsilons=[3.0], seeds=[1], methods=["none", "rmt"]),  # drops seed 0
        grid.Config(epsilons=[3.0], seeds=[0, 1], methods=["none", "rmt"], epochs=5.0),  # another budget
        grid.Config(epsilons=[3.0], seeds=[0, 1], methods=["none", "rmt"], lr_grid_sgd=[1.0]),
    ):
        assert not grid.resumable(stored, as_json(bad))


def test_top_layers_reaches_the_cached_bed_and_keeps_older_grids_resumable(monkeypatch: pytest.MonkeyPatch) -> None:
    from dp_bench.commands import grid
    from dp_bench.config import as_json, parse_config

    calls, task = [], object()
    monkeypatch.setattr(grid, "frozen_text_task", lambda *a, **k: calls.append((a, k)) or task)
    assert grid.load_task(grid.Config(model="minilm", top_layers=2, val_size=1000)) is task
    assert calls == [(("minilm", 48, 2), {"val_size": 1000})]  # the bottom 4 of MiniLM's 6 layers cached
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"top_layers must be in \[1, 2\]"):  # the tiny BERT has 2 layers
        grid.frozen_text_task("tiny", 16, 3)
    older = as_json(grid.Config(model="minilm"))
    older.pop("top_layers")  # a grid stored before the option (§8's rt.json) resumes at its default
    assert grid.resumable(older, as_json(grid.Config(model="minilm")))
    assert not grid.resumable(older, as_json(grid.Config(model="minilm", top_layers=2)))
    with pytest.raises(SystemExit):  # argparse error: the option belongs to the MiniLM bed only
        parse_config(grid.Config, ["--model", "mlp", "--top-layers", "2"], prog="dp-bench grid", description="")


def test_no_tune_plans_no_tuning_run_and_trains_every_arm_at_its_one_learning_rate() -> None:
    from dp_bench.commands import grid
    from dp_bench.config import parse_config

    argv = ["--optimizers", "adamw", "--lr-grid-adamw", "5e-4", "--batches", "2000", "--epsilons", "6.7"]
    argv += ["--target-epsilon", "6.7", "--seeds", "0", "1", "--methods", "none", "rmt", "--no-tune"]
    cfg = parse_config(grid.Config, argv, prog="dp-bench grid", description="")
    plan = grid.planned(cfg)
    assert [c.phase for c in plan] == ["eval"] * 8  # 2 seeds x (2 methods + 2 references), no tuning cell
    schedule = grid.GridSchedule(cfg)
    assert {c.method for c in plan} == {"none", "rmt", "nonprivate", "clip-only"}
    assert all(schedule.lrs(c, {"runs": {}, "lr_choice": {}}) == [5e-4] for c in plan)  # no choice is waited for
    with pytest.raises(SystemExit):  # two candidate rates but nothing to choose them with
        parse_config(grid.Config, [*argv, "--lr-grid-adamw", "5e-4", "1e-3"], prog="dp-bench grid", description="")
    with pytest.raises(SystemExit):  # --smoke trains its own two-value grids
        parse_config(grid.Config, [*argv, "--smoke"], prog="dp-bench grid", description="")
    assert grid.planned(grid.Config())[0].phase == "tune"  # the default still tunes


def test_grid_grown_on_resume_keeps_its_runs_and_lr_choice_and_adds_only_the_new_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dp_bench.commands import grid

    monkeypatch.setenv("FASHION_MNIST_ROOT", str(synthetic_fmnist(tmp_path / "data")))
    base = ["--smoke", "--methods", "none", "--out", str(tmp_path), "--name", "g", "--no-references"]
    grid.main([*base, "--epsilons", "3"])
    first = json.loads((tmp_path / "g.json").read_text())
    grid.main([*base, "--epsilons", "3", "1", "--resume"])
    grown = json.loads((tmp_path / "g.json").read_text())
    for key, rec in first["runs"].items():  # nothing stored is rerun or rewritten
        assert grown["runs"][key] == rec
    added = set(grown["runs"]) - set(first["runs"])
    assert added and all(k.startswith("eval|none|") and "|eps1|" in k for k in added)  # no new tuning run
    assert grown["lr_choice"] == first["lr_choice"]
    assert len(grown["commands"]) == 2 and grown["config"]["epsilons"] == [3.0, 1.0]
    with pytest.raises(SystemExit, match="may grow"):
        grid.main([*base, "--epsilons", "3", "--resume"])  # would drop the stored ε = 1 runs
    key = next(iter(grown["runs"]))
    grown["runs"][key]["provenance"]["commit"] = "0" * 40  # a run made by other code
    (tmp_path / "g.json").write_text(json.dumps(grown))
    with pytest.raises(SystemExit, match="other code"):
        grid.main([*base, "--epsilons", "3", "1", "8", "--resume"])
    grid.main([*base, "--epsilons", "3", "1", "8", "--resume", "--allow-mixed-commits"])
    mixed = json.loads((tmp_path / "g.json").read_text())["mixed_commits"]
    from dp_bench.meta import checkout

    assert len(mixed) == 1 and mixed[0]["commit"] == checkout()["commit"] != "0" * 40


def test_more_lr_extensions_on_resume_move_an_edge_choice_and_supersede_its_evaluations() -> None:
    """A grid tuned with ``--lr-extensions 0`` whose best rate sat at the grid's edge (§10) resumes with more: the
    tuning round reopens outward, evaluation waits for the new choice and runs at it, and the report reads only the
    runs at the current choice (the old ones stay stored). Fewer extensions than stored are refused."""
    from dp_bench import runner
    from dp_bench.commands import grid, grid_report
    from dp_bench.config import as_json

    kw = dict(methods=["none"], optimizers=["sgd"], batches=[256], epsilons=[3.0], seeds=[0], references=False)
    old, more = grid.Config(**kw, lr_extensions=0), grid.Config(**kw, lr_extensions=2)
    assert grid.resumable(as_json(old), as_json(more)) and not grid.resumable(as_json(more), as_json(old))
    tune = grid.cell_of("tune", "none", "sgd", 256, 3.0, 100)
    result: dict = {"runs": {}, "lr_choice": {}}
    for lr, val in zip(grid.LR_GRIDS["sgd"], (0.5, 0.6, 0.7, 0.8), strict=True):  # best at the upper edge
        result["runs"][tune.key(lr)] = {"final_val": val}
    assert grid.tune_round(result, old, tune) == [] and result["lr_choice"]["none|sgd|B256"]["lr"] == 4.0

    def evaluation(lr: float) -> dict:
        return {"method": "none", "optimizer": "sgd", "batch": 256, "seed": 0, "lr": lr, "target_epsilon": 3.0}

    result["runs"]["eval|none|sgd|B256|eps3|s0|lr4"] = evaluation(4.0)
    assert grid_report.evaluations(result) == [evaluation(4.0)]
    plan = grid.planned(more)
    (cell, lr, _), _, _ = runner.next_run(result["runs"], plan, grid.GridSchedule(more), result, lambda k: True)
    assert (cell.phase, lr) == ("tune", 8.0)  # reopened outward
    result["runs"][tune.key(8.0)] = {"final_val": 0.9}
    result["runs"][tune.key(16.0)] = {"final_val": 0.85}  # 8 is now interior: final
    (cell, lr, _), _, _ = runner.next_run(result["runs"], plan, grid.GridSchedule(more), result, lambda k: True)
    assert (cell.phase, lr) == ("eval", 8.0) and result["lr_choice"]["none|sgd|B256"]["lr"] == 8.0
    result["runs"]["eval|none|sgd|B256|eps3|s0|lr8"] = evaluation(8.0)
    assert grid_report.evaluations(result) == [evaluation(8.0)]  # the run at 4 is superseded, still stored
    assert len([k for k in result["runs"] if k.startswith("eval|")]) == 2


def test_released_oracle_is_exact_without_noise_and_sees_a_scaled_update() -> None:
    """Clipping only (σ = 0): the released update is the clean clipped mean, so cos = 1 and the norm ratio 1;
    a denoiser that halves the update keeps cos = 1 and halves the ratio (globally and per matrix)."""
    from dp_bench.commands.grid import ReleasedOracle
    from dp_bench.train import run_dp
    from dp_bench.vision import build

    from opacus_spectral import Denoiser

    class Half(Denoiser):
        name = "half"

        def __call__(self, records):  # type: ignore[no-untyped-def]
            return [r.tensor * 0.5 for r in records]

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    for hooks, ratio in (([], 1.0), ([Half()], 0.5)):
        oracle = ReleasedOracle(every=1)
        run_dp(
            build("mlp", 0),
            data,
            data,
            input_names=None,
            post_hooks=hooks,
            noise_multiplier=0.0,
            batch_size=32,
            steps=2,
            seed=0,
            lr=0.1,
            optimizer="sgd",
            physical_batch=32,
            oracle=False,
            per_param=False,
            grad_sample_mode="ghost",
            allow_non_private=True,
            on_step=oracle,
        )
        assert len(oracle.cos) == 2 and len(oracle.per_matrix) == 4  # two steps × two weight matrices
        for _, cos_clean, _ in oracle.cos:
            assert cos_clean == pytest.approx(1.0, abs=1e-9)
        for _, r in oracle.norm_ratio:
            assert r == pytest.approx(ratio, rel=1e-9)
        for _, _, cos_m, r_m in oracle.per_matrix:
            assert cos_m == pytest.approx(1.0, abs=1e-9) and r_m == pytest.approx(ratio, rel=1e-9)


def test_spectral_methods_are_paired_with_the_best_non_spectral_peer() -> None:
    """The target comparison: each spectral method minus the peer with the highest mean, paired by seed."""
    from dp_bench.commands import grid_report

    finals = {
        "none": [0.80, 0.81, 0.82],
        "ema": [0.81, 0.80, 0.83],
        "doppler": [0.84, 0.85, 0.83],
        "rmt": [0.85, 0.87, 0.83],
        "ema+rmt-js": [0.84, 0.84, 0.84],
    }
    runs = {
        f"eval|{m}|sgd|B256|eps3|s{s}|lr1": {
            "method": m,
            "optimizer": "sgd",
            "batch": 256,
            "target_epsilon": 3.0,
            "seed": s,
            "lr": 1.0,
            "final_test": acc,
            "steps": 10,
            "test": [[0, 0.1], [10, acc]],
        }
        for m, accs in finals.items()
        for s, acc in enumerate(accs)
    }
    result = {"runs": runs, "config": {"epsilons": [3.0], "target_epsilon": 3.0}}
    peer = grid_report.analyze(result)["vs_best_peer"]
    assert set(peer) == {"sgd|B256|eps3|rmt", "sgd|B256|eps3|ema+rmt-js"}  # none/ema/doppler are not spectral
    assert peer["sgd|B256|eps3|rmt"]["peer"] == "doppler"  # mean 0.84 beats ema's 0.813
    d = peer["sgd|B256|eps3|rmt"]["diff"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.01)  # (0.01 + 0.02 + 0.00) / 3
    assert d["lo"] < 0.01 < d["hi"]
    assert peer["sgd|B256|eps3|ema+rmt-js"]["diff"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert "best non-spectral peer" in grid_report.tables({**result, "analysis": None})
    # paper A's unit, paired per seed: (none's steps − rmt's steps) / none's steps to none's mean final accuracy
    # (0.81), by linear interpolation from 0.1 at step 0; none's seeds 0 and 1 never pass it (budget 10)
    none_t = [10.0, 10.0, 10 * 0.71 / 0.72]
    rmt_t = [10 * 0.71 / (a - 0.1) for a in finals["rmt"]]
    want = sum((b - a) / b for a, b in zip(rmt_t, none_t, strict=True)) / 3
    st = grid_report.analyze(result)["cells"]["sgd|B256|eps3|rmt"]["steps_to_baseline"]
    assert st["fewer_steps_fraction"]["mean"] == pytest.approx(want, rel=1e-9) and st["never_reached"] == 0


def test_a_worker_waiting_on_anothers_tuning_run_tunes_the_next_cell_and_evaluates_only_final_choices() -> None:
    """:func:`dp_bench.runner.next_run` with the grid's schedule on stored runs: the open round of a cell is what
    :func:`grid.tune_round` says; a run another worker holds is skipped, not waited on, while other cells have work;
    an evaluation run is handed out only once its cell's choice is final (an edge best first extends the grid)."""
    from dp_bench import runner
    from dp_bench.commands import grid

    cfg = grid.Config(
        methods=["none", "rmt"],
        optimizers=["sgd"],
        batches=[256],
        epsilons=[3.0],
        seeds=[0],
        references=False,
        lr_grid_sgd=[0.5, 1.0, 2.0],
    )
    plan = grid.planned(cfg)
    result: dict = {"runs": {}, "lr_choice": {}}

    def store(method: str, lr: float, val: float) -> None:
        result["runs"][grid.run_key("tune", method, "sgd", 256, 3.0, 100, lr)] = {"final_val": val}

    def next_run(claim):
        return runner.next_run(result["runs"], plan, grid.GridSchedule(cfg), result, claim)

    held = {grid.run_key("tune", "none", "sgd", 256, 3.0, 100, 2.0)}  # another worker trains it
    store("none", 0.5, 0.6), store("none", 1.0, 0.7)
    (cell, lr, key), waiting, done = next_run(lambda k: k not in held)
    assert (key, cell.phase, cell.method, lr) == ("tune|rmt|sgd|B256|eps3|s100|lr0.5", "tune", "rmt", 0.5)
    assert waiting and done == 0
    store("none", 2.0, 0.8)  # the held run lands: the best is at the upper edge, so 4.0 is the next round
    assert grid.tune_round(result, cfg, grid.cell_of("tune", "none", "sgd", 256, 3.0, 100)) == [4.0]
    run, _, _ = next_run(lambda k: True)
    assert run[2] == "tune|none|sgd|B256|eps3|s100|lr4"
    store("none", 4.0, 0.75)  # 2.0 stays best, inside what was tried: final
    for lr in (0.5, 1.0, 2.0):
        store("rmt", lr, {0.5: 0.5, 1.0: 0.9, 2.0: 0.4}[lr])
    held = {grid.run_key("eval", "none", "sgd", 256, 3.0, 0, 2.0)}
    (cell, lr, key), waiting, done = next_run(lambda k: k not in held)
    assert (key, cell.phase, cell.method, lr) == ("eval|rmt|sgd|B256|eps3|s0|lr1", "eval", "rmt", 1.0) and done == 2
    assert result["lr_choice"]["none|sgd|B256"]["lr"] == 2.0 and result["lr_choice"]["rmt|sgd|B256"]["lr"] == 1.0
    result["runs"]["eval|rmt|sgd|B256|eps3|s0|lr1"] = {}
    assert next_run(lambda k: k not in held) == (None, True, 3)  # only the held run left
    result["runs"]["eval|none|sgd|B256|eps3|s0|lr2"] = {}
    assert next_run(lambda k: True) == (None, False, 4)  # all done: the worker stops


def test_adambc_optimizers_are_tuned_and_compared_with_adamw_paired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dp_bench.commands import grid, grid_report

    monkeypatch.setenv("FASHION_MNIST_ROOT", str(synthetic_fmnist(tmp_path / "data")))
    argv = ["--smoke", "--methods", "none", "--epsilons", "3", "--out", str(tmp_path), "--name", "bc"]
    out = grid.main([*argv, "--optimizers", "adamw", "adambc:1e-8", "--no-references"])
    vs = out["analysis"]["vs_adamw"]
    assert len(vs) == 1 and next(iter(vs)).startswith("adambc:1e-8|")
    cells = out["analysis"]["cells"]
    adamw = {k: c for k, c in cells.items() if k.startswith("adamw|")}
    ci = next(iter(vs.values()))
    bc = next(c for k, c in cells.items() if k.startswith("adambc:"))
    assert ci["mean"] == pytest.approx(bc["final_test"][0] - next(iter(adamw.values()))["final_test"][0], abs=1e-12)
    best = max(out["lr_choice"][next(k for k in out["lr_choice"] if "|adambc:1e-8|" in k)]["val"].values())
    assert "− adamw" in grid_report.tables(out) and f"| {100 * best:.2f} |" in grid_report.tables(out)
    with pytest.raises(SystemExit):
        grid.main([*argv, "--optimizers", "adambc"])
    assert "unknown optimizer 'adambc'" in capsys.readouterr().err


def test_bandmf_methods_are_calibrated_for_their_own_accounting_and_paired_with_dp_sgd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dp_bench.commands import grid

    from opacus_spectral import epsilon_from_history

    monkeypatch.setenv("FASHION_MNIST_ROOT", str(synthetic_fmnist(tmp_path / "data")))
    methods = ["none", "bandmf:2", "cyclic:2"]
    argv = ["--smoke", "--methods", *methods, "--epsilons", "3", "--steps", "4", "--out", str(tmp_path)]
    out = grid.main([*argv, "--name", "mf", "--no-references"])
    evals = [r for k, r in out["runs"].items() if k.startswith("eval|")]
    for r in evals:
        bands = 1 if r["method"] == "none" else 2
        # the engine's rate is Opacus' 1/len(loader): 700 training images (smoke: 1,200 − 500) in ⌈700/256⌉ = 3 batches
        q, steps = bands / 3, -(-r["steps"] // bands)
        history = [(r["noise_multiplier"], q, steps)]
        assert r["epsilon_prv"] == pytest.approx(epsilon_from_history(history, 1e-5, "prv"), rel=1e-6)
        # the stored RDP ε is computed at the grid's B/N (≥ 1/len(loader): an over-estimate, as before)
        history = [(r["noise_multiplier"], bands * r["batch"] / 700, steps)]
        assert r["epsilon_rdp"] == pytest.approx(epsilon_from_history(history, 1e-5, "rdp"), rel=1e-9)
        assert 2.5 < r["epsilon_prv"] <= 3.0  # calibrated through its own accounting (at B/N = 0.366 ≥ 1/3)
    sigma = {r["method"]: r["noise_multiplier"] for r in evals}
    assert sigma["bandmf:2"] > sigma["none"]  # b·q over T/b steps needs more noise per step at equal ε
    assert sigma["cyclic:2"] == sigma["bandmf:2"]  # the ablation: the same sampler and accounting, M = I
    assert grid.mechanism_of_method("cyclic:2") == ("bandmf", {"bands": 2, "coefficients": [1.0, 0.0]})
    cos = {r["method"]: r["cos"] for r in evals if r["seed"] == evals[0]["seed"]}  # noisy vs clean gradient, per step
    assert cos["cyclic:2"] != cos["bandmf:2"]  # correlated (x_0 = z_0 / c_0, …) and uncorrelated noise differ
    assert any(k.endswith("|bandmf:2") and "diff_vs_none" in c for k, c in out["analysis"]["cells"].items())
    from dp_bench.commands import grid_report

    rows = grid_report.tables(out).splitlines()
    chosen = [line for line in rows if "| 3 | bandmf:2 |" in line and line.count("|") == 8]
    assert len(chosen) == 1  # the only b tried is the b chosen on validation, beside its difference to DP-SGD
