"""The paired federated benchmark (``dp-bench federated``): a test/validation split fixed across seeds, the fixed
head, the gradient-share probe against a hand computation, the lr rule, tuning on the validation split only, the
paired analysis on a hand-made JSON, and a small end-to-end run with --resume / --replot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("flwr_datasets")
from dp_bench.commands import federated  # noqa: E402
from dp_bench.commands import federated_report as report  # noqa: E402
from dp_bench.fixed_head import FixedLinear, fix_classifier  # noqa: E402
from dp_bench.lr_rule import lr_edge_step  # noqa: E402
from dp_bench.probe import gradient_share  # noqa: E402
from peft_lalora.federated.builders import build_partition, build_task, make_peft_model  # noqa: E402
from peft_lalora.federated.config import FederationConfig  # noqa: E402

T975_2 = 4.302652729911275  # two-sided 95 % t quantile, 2 degrees of freedom


def tiny_cfg(seed: int, **opts: Any) -> FederationConfig:
    return FederationConfig(
        task="dp_bench.task:tiny",
        task_options=json.dumps(opts),
        n_train=120,
        n_test=40,
        seq_len=16,
        num_clients=4,
        alpha=1.0,
        seed=seed,
    )


def rows(ds: Any) -> list[tuple[int, ...]]:
    return [tuple(r) for r in ds.with_format(None)["input_ids"]]


def test_split_is_fixed_across_seeds_while_partitions_change() -> None:
    opts = {"split_seed": 0, "val_size": 20}
    t0, t1 = build_task(tiny_cfg(0, **opts)), build_task(tiny_cfg(1, **opts))
    assert rows(t0.test) == rows(t1.test) and rows(t0.train) == rows(t1.train) and len(t0.train) == 100
    p0, p1 = build_partition(tiny_cfg(0), t0), build_partition(tiny_cfg(1), t1)
    assert [ix.tolist() for ix in p0.indices] != [ix.tolist() for ix in p1.indices]
    v0 = build_task(tiny_cfg(0, eval_split="val", **opts))
    v1 = build_task(tiny_cfg(1, eval_split="val", **opts))
    assert rows(v0.test) == rows(v1.test) and rows(v0.train) == rows(t0.train)
    assert not set(rows(v0.test)) & set(rows(v0.train)) and not set(rows(v0.test)) & set(rows(t0.test))
    assert rows(build_task(tiny_cfg(0, split_seed=1, val_size=20)).test) != rows(t0.test)
    # without split_seed the split follows the run's seed, as before the option existed
    assert rows(build_task(tiny_cfg(0)).test) != rows(build_task(tiny_cfg(1)).test)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"val_sz": 3}, "unknown task_options"),
        ({"val_size": True}, "integer"),
        ({"split_seed": 1.5}, "integer"),
        ({"eval_split": "val"}, "val_size > 0"),
        ({"eval_split": "train", "val_size": 4}, "eval_split"),
        ({"head": "frozen"}, "head"),
        ({"split_seed": -1}, ">= 0"),
        ({"val_size": -2}, ">= 0"),
    ],
)
def test_task_options_are_validated(opts: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_task(tiny_cfg(0, **opts))


def test_fixed_head_leaves_only_the_adapters_trainable() -> None:
    lin = nn.Linear(5, 2)
    x = torch.randn(3, 5)
    assert torch.equal(FixedLinear.of(lin)(x), lin(x)) and not list(FixedLinear.of(lin).parameters())
    with pytest.raises(TypeError):
        fix_classifier(nn.Linear(2, 2))
    cfg = tiny_cfg(0, head="fixed", frozen_layers=1, pooling="mean")
    task = build_task(cfg)
    names = [n for n, p in make_peft_model(cfg, task).named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    free = tiny_cfg(0, frozen_layers=1, pooling="mean")
    assert any(
        "classifier" in n for n, p in make_peft_model(free, build_task(free)).named_parameters() if p.requires_grad
    )


class Chain(nn.Module):
    """z = c·b·a·x + h·u: scalars a (A), b (B) named as PEFT names LoRA factors (``layer.lora_A.default``), and
    a two-parameter head (c, h)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Module()
        self.layer.lora_A = nn.ParameterDict({"default": nn.Parameter(torch.tensor(1.0))})
        self.layer.lora_B = nn.ParameterDict({"default": nn.Parameter(torch.tensor(2.0))})
        self.classifier, self.classifier_h = nn.Parameter(torch.tensor(3.0)), nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        a, b = self.layer.lora_A["default"], self.layer.lora_B["default"]
        return self.classifier * b * a * x + self.classifier_h * u


def test_gradient_share_matches_a_hand_computation() -> None:
    a, b, c, h = 1.0, 2.0, 3.0, 0.5
    xs, us, ys = [1.0, -2.0, 0.5], [0.0, 4.0, -1.0], [0.0, 1.0, 3.0]
    max_norm = 2.0
    per_ex, summed = [], [0.0, 0.0, 0.0, 0.0]
    for x, u, y in zip(xs, us, ys, strict=True):
        r = c * b * a * x + h * u - y  # d(½ r²)/dz
        g = [r * c * b * x, r * c * a * x, r * b * a * x, r * u]  # dA, dB, dc, dh
        sq = [g[0] ** 2, g[1] ** 2, g[2] ** 2 + g[3] ** 2]
        per_ex.append([s / sum(sq) for s in sq])
        scale = min(1.0, max_norm / math.sqrt(sum(sq)))
        summed = [s + scale * gi for s, gi in zip(summed, g, strict=True)]
    s_sq = [summed[0] ** 2, summed[1] ** 2, summed[2] ** 2 + summed[3] ** 2]
    batch = [torch.tensor(xs), torch.tensor(us), torch.tensor(ys)]

    def loss(model: nn.Module, bt: list[torch.Tensor]) -> torch.Tensor:
        return 0.5 * ((model(bt[0], bt[1]) - bt[2]) ** 2).sum()

    out = gradient_share(Chain(), batch, loss, max_norm)
    got = out["per_example_share"]
    for j, g in enumerate(("lora_A", "lora_B", "head")):
        assert got[g] == pytest.approx(sum(p[j] for p in per_ex) / 3, rel=1e-6)
        assert out["clipped_sum_share"][g] == pytest.approx(s_sq[j] / sum(s_sq), rel=1e-6)
    assert sum(got.values()) == pytest.approx(1.0) and sum(out["clipped_sum_share"].values()) == pytest.approx(1.0)
    assert out["numel"] == {"head": 2, "lora_A": 1, "lora_B": 1} and 0 < out["clipped_fraction"] < 1


def test_lr_edge_step_follows_the_grid_rule() -> None:
    base = [1.0, 2.0, 4.0]
    assert lr_edge_step({1.0: 0.7, 2.0: 0.8, 4.0: 0.6}, base) == (2.0, [])
    assert lr_edge_step({1.0: 0.9, 2.0: 0.8, 4.0: 0.6}, base) == (1.0, [0.5])
    assert lr_edge_step({1.0: 0.6, 2.0: 0.8, 4.0: 0.8}, base) == (2.0, [])  # tie: the smaller lr
    assert lr_edge_step({1.0: 0.6, 2.0: 0.7, 4.0: 0.8, 8.0: 0.9}, base, max_extensions=1) == (8.0, [])
    assert lr_edge_step({1.0: float("nan"), 2.0: 0.5}, base) == (2.0, [4.0])


def fake_result(diffs: dict[str, list[float]], base: list[float]) -> dict[str, Any]:
    """Evaluation runs at ε = 1 whose final and last-3 accuracies are ``base[s] + diff`` (a flat curve)."""
    runs = []
    for m, ds in {"dp-lora": [0.0] * 3, **diffs}.items():
        for s, d in enumerate(ds):
            runs.append(
                {
                    "phase": "eval",
                    "method": m,
                    "epsilon": 1.0,
                    "seed": s,
                    "lr": 1.0,
                    "max_epsilon": 0.99,
                    "accuracy": [0.5] + [base[s] + d] * 4,
                }
            )
    return {"config": {"delta": 1e-5}, "runs": {federated.record_key(r): r for r in runs}}


def test_paired_analysis_on_a_hand_made_json() -> None:
    base = [0.60, 0.62, 0.58]
    res = fake_result(
        {
            "la-lora": [0.11, 0.13, 0.15],
            "ffa-lora": [0.13, 0.13, 0.16],
            "rolora": [0.0, 0.01, 0.02],
            "la-lora-nofilter": [0.20, 0.21, 0.25],
        },
        base,
    )
    block = report.analyze(res)["1"]
    c = block["comparisons"]["la_minus_dp_lora"]["final"]
    half = T975_2 * 0.02 / math.sqrt(3)
    assert (c["mean"], c["lo"], c["hi"], c["n"]) == pytest.approx((0.13, 0.13 - half, 0.13 + half, 3))
    assert block["comparisons"]["la_minus_dp_lora"]["last3"]["mean"] == pytest.approx(0.13)
    v = block["verdicts"]
    assert v["LA-LoRA ≥ DP-LoRA + 10 points"]["final"] == "inconclusive"  # [0.080, 0.180] straddles +10
    # la − ffa = [-0.02, 0.0, -0.01]: CI [-3.5, +1.5] points, below +3 -> the "best of" claim is contradicted
    assert v["LA-LoRA ≥ best of FFA-LoRA/RoLoRA + 3 points"]["final"] == "contradicted"
    assert v["binomial5 filter gain ≥ 0 (direction only)"]["final"] == "contradicted"
    assert block["methods"]["la-lora"]["final"] == pytest.approx((0.73, 0.02))  # 0.71, 0.75, 0.73
    res = fake_result({"la-lora": [0.15, 0.16, 0.17], "ffa-lora": [0.1, 0.1, 0.1], "rolora": [0.0, 0.0, 0.01]}, base)
    v = report.analyze(res)["1"]["verdicts"]
    assert v["LA-LoRA ≥ DP-LoRA + 10 points"]["final"] == "reproduced"
    assert v["LA-LoRA ≥ best of FFA-LoRA/RoLoRA + 3 points"]["final"] == "reproduced"
    assert "| LA-LoRA ≥ DP-LoRA + 10 points | reproduced | reproduced |" in report.tables(res)


def test_tuning_reads_the_validation_split_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake federation scores lr by the split its task evaluates: the validation split prefers 1.0, the test
    split 4.0. The chosen lr must be 1.0, and every tuning run must be on the validation split."""

    def fake_build(cfg: FederationConfig) -> Any:
        split = json.loads(cfg.task_options)["eval_split"]
        return SimpleNamespace(split=split, seed=cfg.seed, train=range(100), test=range(10 if split == "val" else 30))

    def fake_run(args: Any, task: Any, phase: str, method: str, eps: float, seed: int, lr: float) -> dict[str, Any]:
        best = 1.0 if task.split == "val" else 4.0
        acc = 0.8 - 0.1 * abs(math.log2(lr / best))
        return {
            "phase": phase,
            "method": method,
            "epsilon": eps,
            "seed": seed,
            "lr": lr,
            "split": task.split,
            "task_seed": task.seed,
            "accuracy": [0.5, acc, acc, acc],
            "max_epsilon": 1.0,
            "wall_s": 0.0,
            "cpu_s": 0.0,
        }

    monkeypatch.setattr(federated, "build_task", fake_build)
    monkeypatch.setattr(federated, "one_run", fake_run)
    out = tmp_path / "f.json"
    res = federated.main(
        ["--model", "tiny", "--methods", "dp-lora", "--lr-grid", "0.25", "0.5", "--seeds", "0", "1", "--out", str(out)]
    )
    tune = [r for r in res["runs"].values() if r["phase"] == "tune"]
    assert {(r["split"], r["task_seed"]) for r in tune} == {("val", 100)}
    assert sorted(r["lr"] for r in tune) == [0.25, 0.5, 1.0, 2.0]  # edge extension up, then an interior best
    assert res["lr_choice"]["dp-lora"]["lr"] == 1.0
    evals = [r for r in res["runs"].values() if r["phase"] == "eval"]
    assert {(r["split"], r["lr"]) for r in evals} == {("test", 1.0)} and sorted(r["seed"] for r in evals) == [0, 1]
    with pytest.raises(SystemExit):  # the tuning seed cannot be an evaluation seed
        federated.main(["--model", "tiny", "--seeds", "0", "100", "--out", str(out)])


@pytest.mark.slow
def test_federated_smoke_records_resume_and_replot(tmp_path: Path) -> None:
    out = tmp_path / "fed.json"
    argv = [
        "--model",
        "tiny",
        "--methods",
        "dp-lora",
        "la-lora",
        "--seeds",
        "0",
        "1",
        "--rounds",
        "2",
        "--local-steps",
        "2",
        "--n-train",
        "160",
        "--n-test",
        "64",
        "--seq-len",
        "16",
        "--frozen-layers",
        "1",
        "--num-clients",
        "3",
        "--batch-size",
        "8",
        "--val-size",
        "32",
        "--lr-grid",
        "0.5",
        "1.0",
        "--max-extensions",
        "0",
        "--probe-examples",
        "8",
        "--accountant",
        "prv",
        "--out",
        str(out),
        "--no-progress",
        "--threads",
        "1",
    ]
    res = federated.main(argv)
    runs = list(res["runs"].values())
    assert set(res["runs"]) == {federated.record_key(r) for r in runs}  # the runner's one key format
    assert [r["phase"] for r in runs].count("tune") == 4 and [r["phase"] for r in runs].count("eval") == 4
    for r in runs:
        assert (r["num_clients"], r["partition"], r["alpha"]) == (3, "dirichlet", 1.0) and len(r["accuracy"]) == 3
        assert r["n_eval"] == (32 if r["phase"] == "tune" else 64) and r["eval_split"] in ("val", "test")
        for when in ("init", "final"):
            assert sum(r["grad_share"][when]["per_example_share"].values()) == pytest.approx(1.0)
        assert r["grad_share"]["init"]["per_example_share"]["lora_A"] == 0.0  # B = 0 at init: no gradient for A
        assert r["epsilon_other"]["accountant"] == "rdp" and 0 < r["epsilon_other"]["max_epsilon"] < 10
    evals = [r for r in runs if r["phase"] == "eval"]
    sizes = {r["seed"]: json.dumps(r["partition_summary"]["sizes"]) for r in evals}
    assert sizes[0] != sizes[1]  # the seed changes the partition ...
    assert len({r["n_train"] for r in evals}) == 1  # ... not the split
    data = json.loads(out.read_text())
    assert data["versions"]["torch"] and data["analysis"]["1"]["comparisons"]["la_minus_dp_lora"]["final"]["n"] == 2
    assert out.with_suffix(".png").stat().st_size > 0
    again = federated.main(argv + ["--resume"])
    assert again["runs"] == json.loads(json.dumps(res["runs"]))
    with pytest.raises(SystemExit, match="different configuration"):
        federated.main(argv + ["--resume", "--batch-size", "4"])
    assert federated.main(["--replot", "--out", str(out)])["analysis"]["1"]["methods"]["la-lora"]["seeds"] == [0, 1]
