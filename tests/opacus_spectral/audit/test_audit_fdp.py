"""The f-DP one-run bound (``opacus_spectral.audit.fdp``, docs/math.md §5.7): against an independent implementation,
its recursion by hand, its monotonicity and limits, exact validity on a Gaussian mechanism, exceedance ≤ β on
simulated μ-GDP canaries, and its use through ``audit_scores`` / ``GradientCanaries``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus_spectral.audit import (
    GradientCanaries,
    audit_scores,
    gaussian_dp_epsilon,
    one_run_epsilon_lower_bound,
    one_run_fdp_epsilon_lower_bound,
    one_run_fdp_mass,
    one_run_gdp_lower_bound,
)
from scipy import stats
from torch import nn

from opacus_spectral import PrivacyEngine

# (m, k, v, δ) -> ε_lower at 95 % and 99 %, computed with jax-privacy 2.0.0 (`jax_privacy.auditing.
# _epsilon_one_run_fdp`, Google DeepMind's implementation of the same paper; brentq in ε with xtol 1e-6, its
# μ from dp_accounting's Gaussian calibration) — an independent oracle
ORACLE = [
    ((1000, 100, 90, 1e-5), 2.4564050672094146, 1.9820861531788676),
    ((2000, 400, 300, 1e-5), 1.3907819491792124, 1.1377301321331943),
    ((2000, 200, 170, 1e-5), 2.0465728262477856, 1.6961020017504873),
    ((10000, 400, 316, 1e-5), 1.430278367126153, 1.2217040786055822),
    ((2000, 800, 560, 1e-6), 1.3416595026652463, 1.0899126512136907),
    ((500, 50, 50, 1e-5), 4.44246226398465, 3.42813140413478),
    ((2000, 400, 287, 1e-5), 1.1428050742359246, 0.9224710935194632),
    ((200, 50, 30, 1e-4), 0.0, 0.0),
    ((20000, 4000, 2600, 1e-5), 0.7762160690294753, 0.6549209751378535),
]


def psi_inverse(x: float, mu: float) -> float:
    """G_μ's inverse blow-up, written with scipy.stats (the module uses scipy.special)."""
    return float(stats.norm.cdf(stats.norm.ppf(x) - mu))


@pytest.mark.parametrize(("case", "eps95", "eps99"), ORACLE)
def test_fdp_bound_matches_the_independent_implementation(case, eps95, eps99) -> None:
    m, k, v, delta = case
    assert one_run_fdp_epsilon_lower_bound(k, v, delta, 0.95, num_canaries=m) == pytest.approx(eps95, abs=1e-6)
    assert one_run_fdp_epsilon_lower_bound(k, v, delta, 0.99, num_canaries=m) == pytest.approx(eps99, abs=1e-6)


def test_fdp_is_tighter_than_snj_on_the_same_guesses() -> None:
    # the case docs/audit.md quotes for SNJ: 316 of 400 right among 10,000 canaries
    assert one_run_epsilon_lower_bound(400, 316, 1e-5, num_canaries=10_000) == pytest.approx(1.1100315, abs=1e-6)
    assert one_run_fdp_epsilon_lower_bound(400, 316, 1e-5, num_canaries=10_000) == pytest.approx(1.4302783, abs=1e-6)


def test_mass_recursion_by_hand() -> None:
    """k = 3 guesses, v = 2 right, m = 10: start at mass β on level 2, then levels 1 and 0 by (5.7)."""
    k, v, m, mu, beta = 3, 2, 10, 0.3, 0.05
    r, h = beta * 2 / m, beta * 1 / m
    h1 = max(h, psi_inverse(r, mu))  # level 1: 1 right, 2 wrong per unit of mass
    r1 = r + (1 / 2) * (h1 - h)
    h0 = max(h1, psi_inverse(r1, mu))  # level 0 adds only wrong guesses
    assert one_run_fdp_mass(k, v, m, mu, 1 - beta) == pytest.approx((r1 + h0) * m / k, rel=1e-12)
    # the mass p_i added at level i is Δh·m/(k−i): the total is β + p_1 + p_0
    assert (r1 + h0) * m / k == pytest.approx(beta + (h1 - h) * m / 2 + (h0 - h1) * m / 3, rel=1e-12)


def test_the_lower_bound_is_the_root_of_the_mass() -> None:
    for k, v, m in ((100, 90, 1000), (400, 300, 2000), (40, 40, 40)):
        mu = one_run_gdp_lower_bound(k, v, m)
        assert mu > 0
        assert one_run_fdp_mass(k, v, m, mu, 0.95) == pytest.approx(1.0, abs=1e-8)
        assert one_run_fdp_mass(k, v, m, mu * (1 - 1e-6), 0.95) > 1.0 > one_run_fdp_mass(k, v, m, mu * (1 + 1e-6), 0.95)
        assert one_run_fdp_epsilon_lower_bound(k, v, 1e-5, num_canaries=m) == gaussian_dp_epsilon(mu, 1e-5)


def test_monotone_in_mu_confidence_correct_guesses_and_canaries() -> None:
    k, v, m = 400, 300, 2000
    masses = [one_run_fdp_mass(k, v, m, mu, 0.95) for mu in np.linspace(0, 3, 61)]
    assert all(a >= b - 1e-15 for a, b in zip(masses, masses[1:], strict=False))  # larger μ: less to refute
    assert masses[0] > 1 > masses[-1]
    assert one_run_gdp_lower_bound(k, v, m, 0.99) < one_run_gdp_lower_bound(k, v, m, 0.95)
    bounds = [one_run_gdp_lower_bound(k, x, m) for x in range(220, 401, 20)]
    assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False))  # more right guesses prove more
    # the same (k, v) among more canaries proves less (each guess is a smaller share of the m coordinates)
    by_m = [one_run_gdp_lower_bound(100, 80, n) for n in (100, 200, 1000, 10_000)]
    assert all(a > b for a, b in zip(by_m, by_m[1:], strict=False))


def test_limits_large_mu_and_no_signal() -> None:
    # μ → ∞: ψ⁻¹ → 0, no constraint binds, the mass is the β it started with
    assert one_run_fdp_mass(400, 300, 2000, 40.0, 0.95) == pytest.approx(0.05, rel=1e-12)
    # chance level, nothing right, no guesses: nothing is refuted
    assert one_run_gdp_lower_bound(400, 200, 2000) == 0.0
    assert one_run_gdp_lower_bound(400, 0, 2000) == 0.0 and one_run_gdp_lower_bound(0, 0, 10) == 0.0
    assert one_run_fdp_epsilon_lower_bound(400, 200, 1e-5, num_canaries=2000) == 0.0


@pytest.mark.parametrize("k", [20, 100, 400, 2000])
def test_at_mu_zero_it_is_nearly_the_exact_binomial_test(k: int) -> None:
    """μ = 0 (output independent of the coins): W ~ Bin(k, ½) exactly. The f-DP test rejects only where the
    binomial tail is < β (valid), and its critical value is within 2 of the exact one; m does not matter."""
    rejected = [v for v in range(k + 1) if one_run_fdp_mass(k, v, k, 0.0, 0.95) > 1]
    v_min = rejected[0]
    assert rejected == list(range(v_min, k + 1))
    assert stats.binom.sf(v_min - 1, k, 0.5) < 0.05
    exact = int(stats.binom.isf(0.05, k, 0.5)) + 1  # the smallest v with P[Bin(k, ½) >= v] <= 0.05
    assert exact <= v_min <= exact + 2
    assert [v for v in range(k + 1) if one_run_fdp_mass(k, v, 10 * k, 0.0, 0.95) > 1] == rejected


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_exact_validity_for_the_gaussian_mechanism(mu: float) -> None:
    """Canary i released as μ·S_i + N(0, 1) (exactly μ-GDP); the auditor guesses the sign of every canary, so
    W ~ Bin(m, Φ(μ/2)) exactly. (5.7) holds on that distribution — with equality at i = 1, where the guess is
    the Neyman–Pearson test — and no v is refuted at β = P[W ≥ v] (the recursion's mass stays ≤ 1)."""
    m = 300
    p = float(stats.norm.cdf(mu / 2))
    pmf = stats.binom.pmf(np.arange(m + 1), m, p)
    j = np.arange(m + 1)

    def psi(x: float) -> float:  # Φ(Φ⁻¹(x) + μ): the most an event of probability x can have on the other side
        return float(stats.norm.cdf(stats.norm.ppf(x) + mu))

    slack = [np.sum((j * pmf)[i:]) / m - psi(np.sum(((m - j) * pmf)[i - 1 :]) / m) for i in range(1, m + 1)]
    assert max(slack) <= 1e-12 and abs(slack[0]) <= 1e-12
    assert np.sum(j * pmf) / m > float(stats.norm.cdf(stats.norm.ppf(1 - p) + 0.95 * mu))  # a smaller μ fails
    for v in range(int(m * p), m + 1):
        tail = float(stats.binom.sf(v - 1, m, p))
        if 1e-12 < tail < 1:
            assert one_run_fdp_mass(m, v, m, mu, 1 - tail) <= 1.0


@pytest.mark.parametrize("mu", [0.5, 1.0])
def test_exceedance_is_at_most_beta_on_simulated_gdp_canaries(mu: float) -> None:
    """2,000 μ-GDP canaries (scores μ·S_i + N(0, 1)), two-sided guesses on 5 % of each end: over 2,000 runs the
    claim μ is refuted in at most β of them, while μ/2 is refuted in most (the test is not vacuous)."""
    rng = np.random.default_rng(0)
    m, k, runs = 2000, 100, 2000
    coins = rng.random((runs, m)) < 0.5
    ranked = np.take_along_axis(coins, np.argsort(-(mu * coins + rng.standard_normal((runs, m))), axis=1), axis=1)
    correct = ranked[:, :k].sum(1) + (~ranked[:, -k:]).sum(1)
    refuted = np.mean([one_run_fdp_mass(2 * k, int(v), m, mu, 0.95) > 1 for v in correct])
    assert refuted <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)
    assert np.mean([one_run_fdp_mass(2 * k, int(v), m, mu / 2, 0.95) > 1 for v in correct]) > 0.7


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="num_canaries"):
        one_run_gdp_lower_bound(10, 9, 0)
    with pytest.raises(ValueError, match="smaller than num_guesses"):
        one_run_gdp_lower_bound(10, 9, 5)
    with pytest.raises(ValueError, match="num_correct"):
        one_run_fdp_mass(10, 11, 100, 1.0, 0.95)
    with pytest.raises(ValueError, match="confidence"):
        one_run_gdp_lower_bound(10, 9, 100, confidence=1.0)
    with pytest.raises(ValueError, match="mu"):
        one_run_fdp_mass(10, 9, 100, -1.0, 0.95)
    with pytest.raises(ValueError, match="no finite ε at δ = 0"):
        one_run_fdp_epsilon_lower_bound(10, 9, 0.0, num_canaries=100)


# ---------------------------------------------------------------------------------------------- the audit API
def test_audit_scores_with_the_fdp_bound() -> None:
    rng = np.random.default_rng(3)
    included = rng.random(2000) < 0.5
    scores = 1.0 * included + rng.standard_normal(2000)
    pairs = [(20, 20), (100, 100), (200, 200)]
    res = audit_scores(scores, included, delta=1e-5, guesses=pairs, bound="fdp")
    assert res.bound == "fdp" and res.candidates == 3
    # the best size, each tested at 1 − 0.05/3, as the ε of the refuted μ
    ranked = included[np.argsort(-scores, kind="stable")]
    mus = [
        one_run_gdp_lower_bound(2 * k, int(ranked[:k].sum() + (~ranked[-k:]).sum()), 2000, 1 - 0.05 / 3)
        for k, _ in pairs
    ]
    assert res.mu_lower == max(mus)
    assert res.epsilon_lower == gaussian_dp_epsilon(max(mus), 1e-5)
    snj = audit_scores(scores, included, delta=1e-5, guesses=pairs)
    assert snj.bound == "snj" and snj.mu_lower is None and snj.epsilon_lower < res.epsilon_lower
    with pytest.raises(ValueError, match="delta"):
        audit_scores(scores, included, guesses=pairs, bound="fdp")
    with pytest.raises(ValueError, match="bound must be one of"):
        audit_scores(scores, included, delta=1e-5, bound="gdp")


def test_gradient_canaries_fdp_needs_a_gdp_claim() -> None:
    model = nn.Linear(16, 4)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    with pytest.warns(UserWarning, match="noise_seed"):
        engine = PrivacyEngine(noise_seed=0)
    module, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=2.0,
        data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    every = GradientCanaries(opt, 40, module=module, seed=0)
    for x, y in list(dl)[:4]:
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    assert every.claimed_mu() == pytest.approx(math.sqrt(4) / 2.0, rel=1e-12)  # √(Σσ⁻²) = √4 / 2
    res = every.audit(delta=1e-5, guesses=[(5, 5)], bound="fdp")
    assert res.bound == "fdp" and res.mu_lower is not None
    every.remove()
    sub = GradientCanaries(opt, 40, module=module, seed=0, sample_rate=0.5)
    x, y = next(iter(dl))
    opt.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="sample_rate=1"):
        sub.audit(delta=1e-5, bound="fdp")
    with pytest.raises(ValueError, match="not μ-GDP"):
        sub.claimed_mu()
