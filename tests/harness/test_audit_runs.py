"""The audit run by the harness (``dp-bench audit``): the correct engine, with and without denoisers, stays below the
accountant's ε; deliberately broken engines are caught; the command's smoke run."""

from __future__ import annotations

import functools
import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------------- the audit
audit_cmd = pytest.importorskip("dp_bench.commands.audit")


@functools.cache
def _audit(method: str, *, m: int = 2000, steps: int = 25, mu: float = 0.5) -> tuple[float, float, float]:
    """(SNJ ε_lower, f-DP ε_lower, the canaries' claimed ε) of one seeded run (paired noise: ``noise_seed``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is ~10x faster on a busy machine
    try:
        return _run_audit(method, m=m, steps=steps, mu=mu)
    finally:
        torch.set_num_threads(threads)


def _run_audit(method: str, *, m: int, steps: int, mu: float) -> tuple[float, float, float]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2048, 64, generator=g), torch.randint(0, 10, (2048,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    run = audit_cmd.train(
        model,
        data,
        method=method,
        noise_multiplier=steps**0.5 / mu,
        batch=128,
        physical=128,
        steps=steps,
        lr=1e-3,
        seed=0,
        white_box=m,
    )
    can = run["canaries"]
    assert can.steps == steps and can.claimed_mu() == pytest.approx(mu, rel=1e-12)
    fdp = can.audit(delta=1e-5, bound="fdp").epsilon_lower
    return can.audit(delta=1e-5).epsilon_lower, fdp, can.claimed_epsilon(1e-5)


@pytest.mark.parametrize("method", ["none", "rmt", "lowpass", "ema", "ema+rmt"])
def test_correct_engine_stays_below_the_accountant(method: str) -> None:
    lower, lower_fdp, claimed = _audit(method)
    assert claimed == pytest.approx(1.993091404415122, abs=1e-9)  # μ = √25 / 10 = 0.5
    assert 0.0 <= lower < claimed and 0.0 <= lower_fdp < claimed


def test_correct_engine_with_doppler_stays_below_the_accountant() -> None:
    pytest.importorskip("opacus_spectral_doppler")
    lower, lower_fdp, claimed = _audit("doppler")
    assert lower < claimed and lower_fdp < claimed


@pytest.mark.parametrize("fault", ["sigma/4", "leak:3"])
def test_broken_engine_is_caught(fault: str) -> None:
    lower, lower_fdp, claimed = _audit(fault)
    assert lower > claimed and lower_fdp > claimed


def test_a_clean_leak_of_weight_w_is_the_noise_divided_by_one_plus_w() -> None:
    """noisy + w·clean = (1+w)·(clean + noise/(1+w)): the same ranking of the canaries as σ/(1+w), so the same
    audit — the canaries measure exactly the mechanism's signal-to-noise ratio."""
    assert _audit("leak:1") == pytest.approx(_audit("sigma/2"), abs=1e-9)
    assert _audit("leak:3") == pytest.approx(_audit("sigma/4"), abs=1e-9)


def test_halved_sigma_is_at_the_edge_of_the_snj_bound() -> None:
    """σ/2 doubles μ: the SNJ bound roughly doubles but stays below the claim at m = 2,000 (it is ≈ 2× loose for
    Gaussian noise, docs/audit.md)."""
    lower_ok, _, _ = _audit("none")
    lower, _, claimed = _audit("sigma/2")
    assert lower > 1.6 * lower_ok and 0.7 * claimed < lower < claimed


def test_the_fdp_bound_catches_halved_sigma_at_2000_canaries() -> None:
    """The same run: the f-DP test of the μ-GDP claim refutes it (σ/2 is caught), where SNJ's bound does not."""
    lower, lower_fdp, claimed = _audit("sigma/2")
    assert lower < claimed < lower_fdp


def test_fdp_validity_runs_stay_below_the_claim() -> None:
    """A few seeds of the benchmark's validity experiment (``dp-bench audit --experiment fdp-validity`` runs 50):
    a correct engine's f-DP bound stays below the claim on every seed, σ/2 is caught on every seed."""
    cfg = audit_cmd.Config(fv_canaries=2000, fv_train=1024)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(1024, 64, generator=g), torch.randint(0, 10, (1024,), generator=g)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [
            audit_cmd.validity_run(cfg, data, method, seed) for method in ("none", "rmt", "sigma/2") for seed in (1, 2)
        ]
    finally:
        torch.set_num_threads(threads)
    summary = audit_cmd.validity_summary(rows)
    assert summary["none"]["above_fdp"] == summary["rmt"]["above_fdp"] == 0
    assert summary["sigma/2"]["above_fdp"] == 2 and summary["sigma/2"]["kind"] == "broken"
    assert all(r["mu_accountant"] == pytest.approx(0.5, rel=1e-12) for r in rows)


# ---------------------------------------------------------------------------------------------- the command
def _write_idx(path: Path, a: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes())


def test_audit_command_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", 700), ("t10k", 100)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    monkeypatch.setenv("FASHION_MNIST_ROOT", str(tmp_path))
    out = tmp_path / "audit.json"
    res = audit_cmd.main(
        [
            "--methods",
            "none",
            "--faults",
            "sigma/4",
            "--canaries",
            "500",
            "--steps",
            "3",
            "--batch",
            "64",
            "--physical-batch",
            "64",
            "--bb-methods",
            "none",
            "--bb-steps",
            "2",
            "--bb-train",
            "200",
            "--bb-canaries",
            "40",
            "--bb-batch",
            "32",
            "--val-size",
            "100",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "audit.png"),
        ]
    )
    data = json.loads(out.read_text())
    rows = data["audit"]["white_box"]
    assert [r["method"] for r in rows] == ["none", "sigma/4"] and rows[1]["kind"] == "broken"
    assert all({"epsilon_lower", "epsilon_accountant"} <= set(r) for r in rows + data["audit"]["black_box"])
    assert all(r["epsilon_lower_fdp"] >= 0 and r["mu_accountant"] == pytest.approx(0.5, rel=1e-12) for r in rows)
    assert (tmp_path / "audit.png").stat().st_size > 1000 and res["audit"] == data["audit"]


def test_audit_fdp_validity_command_smoke(tmp_path: Path) -> None:
    out = tmp_path / "audit_fdp.json"
    res = audit_cmd.main(
        [
            "--experiment",
            "fdp-validity",
            "--fv-seeds",
            "2",
            "--fv-methods",
            "none",
            "--fv-faults",
            "sigma/4",
            "--fv-canaries",
            "500",
            "--fv-train",
            "256",
            "--fv-batch",
            "64",
            "--steps",
            "5",
            "--fv-out",
            str(out),
            "--fv-plot",
            str(tmp_path / "audit_fdp.png"),
        ]
    )
    data = json.loads(out.read_text())
    assert [(r["method"], r["seed"]) for r in data["fdp_validity"]["rows"]] == [
        ("none", 0),
        ("none", 1),
        ("sigma/4", 0),
        ("sigma/4", 1),
    ]
    assert data["fdp_validity"]["summary"]["none"]["runs"] == 2 and data["command"].startswith("dp-bench audit")
    assert (tmp_path / "audit_fdp.png").stat().st_size > 1000 and res["fdp_validity"] == data["fdp_validity"]
