"""The one-run audit (``opacus_spectral.audit``): the bound against an independent implementation and its closed
forms, the claims, the guesses, exact canary injection, and the audit itself — below the accountant's ε for the
correct engine with and without denoisers, above it for deliberately broken engines."""

from __future__ import annotations

import math

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
    named = dict(model.named_parameters())  # gather reads each canary's own coordinate, in the canaries' order
    marked = [torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) for p in can.parameters]
    assert can.gather(marked).tolist() == [float(i) for _, i in can.coordinates]
    assert all(named[n] is p for n, p in zip(can.param_names, can.parameters, strict=True))
    with pytest.raises(ValueError, match="one tensor per canary parameter"):
        can.gather(marked[:-1])
    with pytest.raises(ValueError, match="shape"):  # the right number of entries read in the wrong layout
        can.gather([m.t() if m.dim() == 2 else m for m in marked])
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
