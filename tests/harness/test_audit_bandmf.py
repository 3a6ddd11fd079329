"""The f-DP one-run audit of BandMF runs (``dp-bench audit --experiment fdp-bandmf``, ``docs/audit.md`` "BandMF"):
b = 1 is DP-SGD's audit bit for bit; the whitened score and the canaries' claim; a correct b = 4 run stays below
the claim and κ = 2 claimed as 1 is caught; the command's smoke run and its replot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

audit_cmd = pytest.importorskip("dp_bench.commands.audit")
from dp_bench.commands import audit_bandmf as bandmf_cmd  # noqa: E402

CFG = audit_cmd.Config(fv_canaries=2000, fv_train=1024)


@pytest.fixture(scope="module")
def data() -> torch.utils.data.TensorDataset:
    return audit_cmd.validity_data(CFG)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is much faster on a busy machine
    yield
    torch.set_num_threads(threads)


def test_one_band_is_the_dp_sgd_audit_bit_for_bit(data) -> None:
    """b = 1: the same noise, batches, canaries and score as the validity experiment's DP-SGD run of the seed."""
    dpsgd = audit_cmd.validity_run(CFG, data, "none", 3)
    banded = bandmf_cmd.bandmf_run(CFG, data, "bandmf:1", 3)
    same = ("epsilon_lower_fdp", "epsilon_lower_snj", "fdp_correct", "fdp_guesses", "epsilon_accountant")
    assert {k: banded[k] for k in same} == {k: dpsgd[k] for k in same}
    assert banded["mu_accountant"] == dpsgd["mu_accountant"] == pytest.approx(0.5, rel=1e-12)
    assert banded["epsilon_lower_fdp"] > 0  # a bound that could differ


def test_arms_and_their_lengths() -> None:
    assert bandmf_cmd.arm_steps(25, 4) == 28 and bandmf_cmd.arm_steps(25, 1) == 25
    assert bandmf_cmd.parse_arm("bandmf:4:kappa=2") == (4, 2.0)
    with pytest.raises(ValueError, match="bandmf:<bands>"):
        bandmf_cmd.parse_arm("bandmf:four")


def test_correct_bandmf_stays_below_and_unnormalized_coefficients_are_caught(data) -> None:
    """A few seeds of the experiment (it runs 50): b = 4 below the claim, κ = 2 claimed as 1 above it."""
    rows = [bandmf_cmd.bandmf_run(CFG, data, arm, s) for arm in ("bandmf:4", "bandmf:4:kappa=2") for s in (1, 2)]
    summary = audit_cmd.validity_summary(rows)
    assert summary["bandmf:4"]["above_fdp"] == 0 and summary["bandmf:4:kappa=2"]["above_fdp"] == 2
    assert [r["kappa"] for r in rows] == pytest.approx([1, 1, 2, 2], rel=1e-9)  # given coefficients kept as they are
    assert all(r["steps"] == 28 and r["mu_accountant"] == pytest.approx(0.5, rel=1e-12) for r in rows)
    correct, broken = rows[:2], rows[2:]
    assert all(r["epsilon_data"] < r["epsilon_accountant"] for r in correct)  # the data's rate b·q < the canaries' 1
    # the engine computes κ itself: the broken arm's data are charged σ/2, not σ (the misaccounting is the harness's)
    assert all(b["epsilon_data"] > c["epsilon_data"] for b, c in zip(broken, correct, strict=True))


def test_fdp_bandmf_command_smoke_and_replot(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "audit_fdp_bandmf.json", tmp_path / "audit_fdp_bandmf.png"
    flags = ["--experiment", "fdp-bandmf", "--bm-out", str(out), "--bm-plot", str(png)]
    small = ["--fv-seeds", "2", "--fv-canaries", "200", "--fv-train", "256", "--fv-batch", "32", "--steps", "5"]
    res = audit_cmd.main([*flags, *small, "--bm-arms", "bandmf:1", "bandmf:2:kappa=2"])
    data = json.loads(out.read_text())
    assert [(r["method"], r["seed"], r["steps"]) for r in data["fdp_bandmf"]["rows"]] == [
        ("bandmf:1", 0, 5),
        ("bandmf:1", 1, 5),
        ("bandmf:2:kappa=2", 0, 6),
        ("bandmf:2:kappa=2", 1, 6),
    ]
    assert data["fdp_bandmf"]["summary"]["bandmf:2:kappa=2"]["kind"] == "broken"
    assert png.stat().st_size > 1000 and res["fdp_bandmf"] == data["fdp_bandmf"]
    before = out.read_bytes()
    capsys.readouterr()
    audit_cmd.main(["--replot", *flags])
    assert "| bandmf:2:kappa=2 | broken | 2 |" in capsys.readouterr().out and out.read_bytes() == before
