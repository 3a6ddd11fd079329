"""The one-run audit (``opacus_spectral.audit``): the bound against an independent implementation and its closed
forms, the claims, the guesses, exact canary injection, and the audit itself — below the accountant's ε for the
correct engine with and without denoisers, above it for deliberately broken engines."""

from __future__ import annotations

import functools
import gzip
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus_spectral.audit import (
    GradientCanaries,
    InputCanaries,
    audit_scores,
    canary_epsilon,
    default_guesses,
    gaussian_dp_delta,
    gaussian_dp_epsilon,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from scipy import special, stats
from torch import nn

from opacus_spectral import PrivacyEngine

# (m, r, v, δ) -> ε_lower at 95 % and 99 %, computed with jax-privacy 2.0.0 (`jax_privacy.auditing.
# _epsilon_one_run`, Google DeepMind's implementation of the same paper; brentq, xtol 1e-6) — an independent oracle
ORACLE = [
    ((1000, 100, 100, 0.0), 3.492965346169885, 3.054876345864497),
    ((1000, 100, 100, 1e-5), 3.465376229385333, 2.9891929096038554),
    ((1000, 600, 600, 1e-5), 5.270399501773853, 4.803029174309113),
    ((1000, 100, 90, 1e-5), 1.6261436787042223, 1.4273118526978308),
    ((10000, 400, 316, 1e-5), 1.1100314899091248, 1.0069407329325428),
    ((5000, 2000, 1400, 1e-6), 0.7660700729648592, 0.7330889887516034),
    ((200, 50, 40, 1e-4), 0.7624819842567566, 0.5250122109374963),
]
ORACLE_P = [
    ((1000, 100, 90, 1e-5, 1.0), 0.0008412885614385309),
    ((10000, 400, 316, 1e-5, 0.5), 0.002302950045273787),
    ((200, 50, 40, 1e-4, 2.0), 0.9695975554078726),
]


# ---------------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize(("case", "eps95", "eps99"), ORACLE)
def test_bound_matches_the_independent_implementation(case, eps95, eps99) -> None:
    m, r, v, delta = case
    assert one_run_epsilon_lower_bound(r, v, delta, 0.95, num_canaries=m) == pytest.approx(eps95, abs=2e-6)
    assert one_run_epsilon_lower_bound(r, v, delta, 0.99, num_canaries=m) == pytest.approx(eps99, abs=2e-6)


@pytest.mark.parametrize(("case", "p"), ORACLE_P)
def test_p_value_matches_the_independent_implementation(case, p) -> None:
    m, r, v, delta, eps = case
    assert one_run_p_value(r, v, eps, delta, num_canaries=m) == pytest.approx(p, rel=1e-12)


def test_all_correct_guesses_at_delta_zero_have_a_closed_form() -> None:
    # P[Bin(r, q) >= r] = q^r = β  =>  ε = logit(β^(1/r)); r = 100, β = 0.05: 3.4929654...
    for r in (1, 10, 100, 1000):
        expected = float(special.logit(0.05 ** (1 / r)))
        assert one_run_epsilon_lower_bound(r, r) == pytest.approx(max(expected, 0.0), abs=1e-12)
    assert one_run_epsilon_lower_bound(100, 100) == pytest.approx(3.4929654311522933, abs=1e-12)


def test_delta_zero_bound_is_the_largest_epsilon_with_binomial_tail_below_beta() -> None:
    for r, v in ((50, 40), (400, 316), (1000, 560), (30, 30)):
        eps = one_run_epsilon_lower_bound(r, v, confidence=0.9)
        q = special.expit(eps)
        assert stats.binom.sf(v - 1, r, q) == pytest.approx(0.1, rel=1e-9)  # the tail equals β at the bound
        tail = [stats.binom.sf(v - 1, r, special.expit(e)) for e in (eps - 1e-6, eps + 1e-6)]
        assert tail[0] < 0.1 <= tail[1]


def test_delta_bound_is_the_root_and_the_p_value_is_monotone() -> None:
    for m, r, v, delta in ((1000, 100, 90, 1e-5), (10000, 400, 316, 1e-5), (200, 50, 40, 1e-4)):
        eps = one_run_epsilon_lower_bound(r, v, delta, num_canaries=m)
        assert one_run_p_value(r, v, eps, delta, num_canaries=m) == pytest.approx(0.05, abs=1e-9)
        grid = [one_run_p_value(r, v, e, delta, num_canaries=m) for e in np.linspace(0, 6, 121)]
        assert all(a <= b + 1e-15 for a, b in zip(grid, grid[1:], strict=False))
        # the 2mδ term: more canaries at the same (r, v) weaken the bound; δ = 0 ignores m
        assert one_run_epsilon_lower_bound(r, v, delta, num_canaries=10 * m) < eps
        assert one_run_epsilon_lower_bound(r, v, 0.0, num_canaries=10 * m) == one_run_epsilon_lower_bound(r, v)


def test_bound_edges_and_argument_errors() -> None:
    assert one_run_epsilon_lower_bound(100, 50) == 0.0  # chance level refutes nothing
    assert one_run_epsilon_lower_bound(100, 0) == 0.0 and one_run_epsilon_lower_bound(0, 0) == 0.0
    assert one_run_p_value(10, 0, 1.0) == 1.0
    with pytest.raises(ValueError, match="num_canaries"):
        one_run_epsilon_lower_bound(100, 90, 1e-5)
    with pytest.raises(ValueError, match="num_correct"):
        one_run_epsilon_lower_bound(10, 11)
    with pytest.raises(ValueError, match="confidence"):
        one_run_epsilon_lower_bound(10, 9, confidence=1.0)
    with pytest.raises(ValueError, match="smaller than num_guesses"):
        one_run_epsilon_lower_bound(10, 9, 1e-5, num_canaries=5)
    with pytest.raises(TypeError):
        one_run_epsilon_lower_bound(10.0, 9)  # type: ignore[arg-type]


def test_bound_is_valid_for_randomized_response() -> None:
    """An ε0-DP mechanism (randomized response: each guess right with probability e^ε0/(1+e^ε0)) is refuted at
    ε0 in at most β of the runs."""
    rng = np.random.default_rng(0)
    eps0, r, runs = 1.0, 200, 4000
    v = rng.binomial(r, special.expit(eps0), size=runs)
    refuted = np.mean([one_run_epsilon_lower_bound(r, int(x)) > eps0 for x in v])
    assert refuted <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)
    assert refuted > 0.02  # and the test is not vacuous: the bound is nearly exact at δ = 0


# ---------------------------------------------------------------------------------------------- claims
def test_gaussian_dp_epsilon_inverts_the_exact_delta_curve() -> None:
    assert gaussian_dp_delta(1.0, 0.0) == pytest.approx(2 * stats.norm.cdf(0.5) - 1, rel=1e-12)
    for mu, delta in ((0.5, 1e-5), (1.0, 1e-5), (2.0, 1e-6), (0.1, 1e-3)):
        eps = gaussian_dp_epsilon(mu, delta)
        assert gaussian_dp_delta(mu, eps) == pytest.approx(delta, rel=1e-8)
    assert gaussian_dp_epsilon(0.5, 1e-5) == pytest.approx(1.993091404415122, abs=1e-9)
    assert gaussian_dp_epsilon(1e-3, 0.5) == 0.0


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # Opacus' PRV at sample rate 1
def test_canary_claims_match_opacus_accountants() -> None:
    from opacus.accountants import PRVAccountant

    # rate 1: T Gaussian steps = μ-GDP with μ = √(Σσ⁻²); Opacus' PRV accountant agrees to its own precision
    assert canary_epsilon([2.0] * 4, 1.0, 1e-5) == pytest.approx(gaussian_dp_epsilon(1.0, 1e-5), rel=1e-12)
    prv = PRVAccountant()
    prv.history = [(2.0, 1.0, 4)]
    assert canary_epsilon([2.0] * 4, 1.0, 1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=2e-2)
    prv.history = [(1.1, 0.05, 30), (0.9, 0.05, 10)]
    assert canary_epsilon([1.1] * 30 + [0.9] * 10, 0.05, 1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=1e-9)
    assert canary_epsilon([1.0, 0.0], 1.0, 1e-5) == math.inf


# ---------------------------------------------------------------------------------------------- guesses
def test_audit_scores_counts_top_and_bottom_guesses_with_bonferroni() -> None:
    scores = np.array([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([1, 1, 0, 1, 0, 1, 0, 0, 1, 0], dtype=bool)
    res = audit_scores(scores, included, guesses=[(2, 2)])
    assert (res.num_guesses, res.num_correct, res.candidates) == (4, 3, 1)  # top 2 both in; bottom 2: one out
    res = audit_scores(scores, included, guesses=[(1, 0), (3, 1)], confidence=0.9)
    assert res.candidates == 2
    best = max(one_run_epsilon_lower_bound(1, 1, 0.0, 0.95), one_run_epsilon_lower_bound(4, 3, 0.0, 0.95))
    assert res.epsilon_lower == best  # each size tested at 1 − 0.1/2
    assert default_guesses(1000) == [(10, 10), (20, 20), (50, 50), (100, 100), (200, 200)]
    with pytest.raises(ValueError, match="do not fit"):
        audit_scores(scores, included, guesses=[(6, 5)])


def test_perfectly_separated_scores_give_the_all_correct_bound() -> None:
    included = np.random.default_rng(1).random(1000) < 0.5
    res = audit_scores(included.astype(float), included, delta=1e-5, guesses=[(100, 100)])
    assert res.num_correct == 200
    assert res.epsilon_lower == one_run_epsilon_lower_bound(200, 200, 1e-5, num_canaries=1000)


# ---------------------------------------------------------------------------------------------- canaries
def _private(model: nn.Module, n: int = 256, batch: int = 64, nm: float = 1.0, **kw):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    kw.setdefault("post_hooks", [])
    return PrivacyEngine(accountant="prv").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=nm,
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        max_grad_norm=0.7,
        **kw,
    )


def test_gradient_canaries_are_injected_exactly_into_the_clipped_sum() -> None:
    """No noise and a zero clipped sum: the released gradient is exactly the included canaries, C/B each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with pytest.warns(RuntimeWarning, match="NOT differentially private"):  # noise 0 without the opt-in warns
        module, opt, dl = _private(model, nm=0.0, poisson_sampling=False)
    can = GradientCanaries(opt, 300, module=module, seed=3)
    for x, y in list(dl)[:3]:
        opt.zero_grad()
        (nn.functional.cross_entropy(module(x), y) * 0.0).backward()
        opt.step()
        released = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
        assert int((released != 0).sum()) == int(can.included.sum())
        assert torch.allclose(released[released != 0], torch.tensor(0.7 / 64))
    assert can.steps == 3 and len({c for c in can.coordinates}) == 300
    assert torch.allclose(can.scores(), 3.0 * can.included.double(), rtol=1e-6)  # in units of one canary's signal
    assert can.audit(guesses=[(50, 50)]).num_correct == 100
    assert can.claimed_epsilon(1e-5) == math.inf  # no noise, no claim
    can.remove()
    assert "add_noise" not in opt.__dict__


def test_subsampled_canaries_take_part_at_their_rate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    with pytest.warns(RuntimeWarning, match="NOT differentially private"):
        module, opt, dl = _private(model, nm=0.0, poisson_sampling=False)
    can = GradientCanaries(opt, 1000, module=module, sample_rate=0.25, seed=0, params="0.weight")
    assert {name for name, _ in can.coordinates} == {"0.weight"}
    for x, y in list(dl)[:4]:
        opt.zero_grad()
        (nn.functional.cross_entropy(module(x), y) * 0.0).backward()
        opt.step()
    z = torch.stack(can._steps)[:, can.included]
    assert set(z.unique().tolist()) <= {0.0, 1.0}
    assert float(z.mean()) == pytest.approx(0.25, abs=0.03)
    assert not bool(torch.stack(can._steps)[:, ~can.included].any())
    assert can.scores("likelihood_ratio").shape == (1000,)


def test_gradient_canaries_refuse_what_they_cannot_audit() -> None:
    model = nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 4))
    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.zeros(8).long())
    module, opt, _ = PrivacyEngine(accountant="prv").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        data_loader=torch.utils.data.DataLoader(data, batch_size=4),
        max_grad_norm=[1.0] * 4,
        clipping="per_layer",
    )
    with pytest.raises(NotImplementedError, match="flat clipping"):
        GradientCanaries(opt, 10)
    module, opt, _ = _private(nn.Linear(16, 4))
    with pytest.raises(ValueError, match="num_canaries"):
        GradientCanaries(opt, 10_000)
    with pytest.raises(ValueError, match="module"):
        GradientCanaries(opt, 5, params="weight")


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


def test_input_canaries_mislabel_and_score_by_loss() -> None:
    x = torch.arange(400, dtype=torch.float32)[:, None]
    y = torch.arange(400) % 5
    can = InputCanaries.mislabeled(x, y, 5, seed=0)
    assert bool((can.labels != y).all()) and 150 < int(can.included.sum()) < 250
    assert len(can.dataset()) == int(can.included.sum())

    class Memorizer(nn.Module):  # logits that put the included canaries' wrong labels first
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(400, 5))
            with torch.no_grad():
                self.table[torch.arange(400)[can.included], can.labels[can.included]] = 5.0

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return self.table[inp[:, 0].long()]

    model = Memorizer().train()
    res = can.audit(model, guesses=[(50, 0)])
    assert res.num_correct == 50 and model.training
    assert res.epsilon_lower == one_run_epsilon_lower_bound(50, 50)


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
