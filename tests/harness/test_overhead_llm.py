"""``dp-bench overhead-llm`` end to end on the tiny random Llama: the JSON's structure, the LoRA shapes it
denoised, and every share computed from the medians it stores (no timing assertions)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# tiny Llama (hidden 32, 4 heads of 8, 2 kv heads -> k/v project to 16, MLP 64), 2 layers
QV_SHAPES = {"32x32": 6, "16x32": 2}  # r = 32: q A/B 32x32, v A 32x32, v B 16x32; per layer, x 2
ALL7_SHAPES = {"16x32": 12, "16x64": 2, "32x16": 6, "16x16": 4, "64x16": 4}  # r = 16, seven modules, x 2


def test_overhead_llm_runs_end_to_end_and_shares_come_from_the_medians(tmp_path: Path) -> None:
    from dp_bench import cli

    out = tmp_path / "ovl.json"
    res = cli.run(
        [
            "overhead-llm",
            "--model",
            "tiny",
            "--cases",
            "qv,all7",
            "--batch",
            "4",
            "--physical",
            "2",
            "--seq",
            "8",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--reps",
            "2",
            "--out",
            str(out),
        ]
    )
    stored = json.loads(out.read_text())
    assert stored == json.loads(json.dumps(res))
    assert stored["command"].startswith("dp-bench overhead-llm --model tiny")
    assert stored["config"]["batch"] == 4 and stored["config"]["seq"] == 8
    assert len(stored["loadavg_start"]) == 3 and len(stored["loadavg_end"]) == 3 and stored["threads"] >= 1
    assert set(stored["cases"]) == {"qv", "all7"}
    for case, shapes, n_params in (
        ("qv", QV_SHAPES, 2 * (2 * 32 * 32 + 32 * 32 + 16 * 32)),
        ("all7", ALL7_SHAPES, None),
    ):
        c = stored["cases"][case]
        assert c["matrix_shapes"] == shapes
        assert c["denoised_matrices"] == sum(shapes.values())
        if n_params is not None:
            assert c["trainable_params"] == n_params
        assert c["sigma"] == pytest.approx(1.0 / 4)  # noise multiplier 1, C = 1, batch 4
        assert c["tokens_per_step"] == 32 and c["physical_batches_per_step"] == 2
        assert c["steps_measured_each"] == 2
        for arm in ("raw_step_s_with", "raw_step_s_without", "raw_denoiser_s"):
            assert len(c[arm]) == 2 and all(t > 0 for t in c[arm])
        assert c["step_s_without"] == statistics.median(c["raw_step_s_without"]) > 0
        assert c["step_s_with"] == statistics.median(c["raw_step_s_with"]) > 0
        assert c["denoiser_s_in_step"] == statistics.median(c["raw_denoiser_s"]) > 0
        assert c["share_rmt_in_step"] == pytest.approx(c["denoiser_s_in_step"] / c["step_s_without"])
        assert c["overhead_ratio_step_difference"] == pytest.approx(
            (c["step_s_with"] - c["step_s_without"]) / c["step_s_without"]
        )
        assert c["meets_target_share"] == (c["share_rmt_in_step"] <= stored["target_share"])
        assert c["pipeline_s_with"] > 0 and c["pipeline_s_without"] > 0
        assert set(c["offline"]) == {"rmt", "rmt_paper"}
        for o in c["offline"].values():
            runs = {k: v for k, v in o.items() if k.startswith("threads_")}
            assert f"threads_{stored['threads']}" in runs
            for v in runs.values():
                assert v["spread"]["n"] == 2 and v["seconds"] == v["spread"]["median"] > 0
                assert v["share_of_step_without"] == pytest.approx(v["seconds"] / c["step_s_without"])
        mem = c["memory"]
        assert mem["denoised_grad_bytes"] == 4 * sum(
            int(a) * int(b) * k for key, k in shapes.items() for a, b in [key.split("x")]
        )
        assert mem["step_peak_bytes"] >= mem["step_peak_extra_bytes"] >= 0 and mem["step_peak_bytes"] > 0
        assert mem["denoiser_peak_extra_bytes_rmt_paper"] >= 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cases", "qv,bogus"], "unknown cases"),
        (["--batch", "4", "--physical", "8"], "--physical <= --batch"),
        (["--steps", "0"], "must be >= 1"),
        (["--seq", "1"], "next-token target"),
    ],
)
def test_overhead_llm_refuses_bad_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dp_bench.commands import overhead_llm

    with pytest.raises(SystemExit):
        overhead_llm.main(["--model", "tiny", *flags])
    assert message in capsys.readouterr().err
