"""Gradient canaries on BandMF runs (``docs/audit.md``, "BandMF runs"): cyclic participation (a canary of group g
only at the steps t ≡ g mod b), the claim from the mechanism's accounting at rate 1, the whitened score, and what is
refused. The validity experiment over 50 seeds per arm is ``dp-bench audit --experiment fdp-bandmf``."""

from __future__ import annotations

import math

import pytest
import torch
from opacus_spectral.audit import GradientCanaries
from opacus_spectral.audit.cyclic import cyclic_claimed_mu, whitened_scores
from opacus_spectral.mechanisms.bandmf_math import optimal_coefficients, strategy_matrix
from opacus_spectral.mechanisms.base import NoiseMechanism
from opacus_spectral.mechanisms.strategy import BandedToeplitz
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")

N, BATCH, C = 256, 32, 0.7


def _private(mechanism, nm: float, steps: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))  # 835 entries
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))
    return PrivacyEngine(accountant="rdp", noise_seed=1).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=nm,
        max_grad_norm=C,
        noise_mechanism=mechanism,
        steps=steps,
        post_hooks=[],
    )


def _steps(module, opt, dl, steps: int, zero_loss: bool) -> None:
    done = 0
    while done < steps:
        for x, y in dl:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(module(x), y)
            (loss * 0.0 if zero_loss else loss).backward()
            opt.step()
            done += 1
            if done == steps:
                return


@pytest.mark.parametrize("groups", ["first", "spread"])
def test_a_canary_takes_part_at_its_groups_steps_only(groups) -> None:
    """No noise, a zero clipped sum: the released value at canary i is 1 (its signal) exactly at the steps
    t ≡ group_i (mod 4) when it is included, 0 everywhere else."""
    with pytest.warns(RuntimeWarning, match="NOT differentially private"):
        module, opt, dl = _private(("bandmf", {"bands": 4}), nm=0.0)
    can = GradientCanaries(opt, 200, module=module, seed=3, groups=groups)
    assert can.bands == 4 and can.keep_steps
    assert can.groups.tolist() == ([0] * 200 if groups == "first" else [i % 4 for i in range(200)])
    _steps(module, opt, dl, 8, zero_loss=True)
    t = torch.arange(8)[:, None]
    expected = (can.included[None, :] & (t % 4 == can.groups[None, :])).double()
    torch.testing.assert_close(can.step_values(), expected, rtol=1e-6, atol=1e-7)
    assert can.claimed_mu() == math.inf  # no noise, no claim


def test_the_claim_and_the_default_score_of_a_noisy_bandmf_run() -> None:
    """σ = 2, b = 4, T = 8: the claim is μ = √⌈T/b⌉/σ = √2/2 (2 charged steps, not 8), its ε the μ-GDP one; the
    default score is the whitened one; a correct run is below the claim at this seed."""
    module, opt, dl = _private(("bandmf", {"bands": 4}), nm=2.0)
    can = GradientCanaries(opt, 300, module=module, seed=0)
    _steps(module, opt, dl, 8, zero_loss=False)
    assert can.claimed_mu() == pytest.approx(math.sqrt(2) / 2, rel=1e-12)
    assert can.mechanism.bands == 4  # the canaries read the run's own mechanism
    whitened = whitened_scores(can.step_values(), can.groups, can.mechanism.coefficients)
    torch.testing.assert_close(can.scores(), whitened)
    assert not torch.allclose(can.scores("sum"), whitened)
    result = can.audit(delta=1e-5, bound="fdp")
    assert 0 <= result.epsilon_lower < can.claimed_epsilon(1e-5)


def test_dp_sgd_canaries_are_unchanged() -> None:
    """On DP-SGD (no mechanism, or b = 1) the canaries take part in every step, score by the sum, claim √(Σσ⁻²)."""
    module, opt, dl = _private(("bandmf", {"bands": 1}), nm=2.0)
    can = GradientCanaries(opt, 100, module=module, seed=0)
    assert can.bands == 1 and not can.keep_steps
    _steps(module, opt, dl, 3, zero_loss=False)
    assert can.claimed_mu() == pytest.approx(math.sqrt(3) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="whitened"):
        can.scores("whitened")


def test_a_one_band_claim_uses_the_charged_sigma() -> None:
    """BandMF with one coefficient c_0 = 2 releases z/2 and is charged σ/2: the canaries claim μ = √T·2/σ (not √T/σ),
    and their ε is the accountant's at that σ′."""
    module, opt, dl = _private(("bandmf", {"bands": 1, "coefficients": [2.0]}), nm=2.0)
    can = GradientCanaries(opt, 100, module=module, seed=0)
    _steps(module, opt, dl, 3, zero_loss=False)
    assert can.claimed_mu() == pytest.approx(math.sqrt(3), rel=1e-12)
    module, opt, dl = _private(("bandmf", {"bands": 1}), nm=1.0)
    plain = GradientCanaries(opt, 100, module=module, seed=0)
    _steps(module, opt, dl, 3, zero_loss=False)
    assert can.claimed_epsilon(1e-5) == pytest.approx(plain.claimed_epsilon(1e-5), rel=1e-12)


def test_what_the_claim_would_not_cover_is_refused() -> None:
    module, opt, _ = _private(("bandmf", {"bands": 4}), nm=1.0)
    with pytest.raises(ValueError, match="sample_rate=1"):
        GradientCanaries(opt, 10, module=module, sample_rate=0.5)
    with pytest.raises(ValueError, match="groups"):
        GradientCanaries(opt, 10, module=module, groups="last")
    with pytest.raises(ValueError, match="keep_steps"):
        GradientCanaries(opt, 10, module=module, keep_steps=False)

    class Correlated(NoiseMechanism):  # the old contract's declaration: refused by make_private
        name = "correlated_elsewhere"
        correlated = True

    with pytest.raises(TypeError, match="defines correlated"):
        _private(Correlated(), nm=1.0)

    class Elsewhere(NoiseMechanism):  # any banded Toeplitz strategy: the canaries know its sampling and noise
        name = "elsewhere"

        def strategy(self, *, steps, sample_rate, dataset_size):
            return BandedToeplitz((0.8, 0.6))

    module, opt, _ = _private(Elsewhere(), nm=1.0)
    assert GradientCanaries(opt, 10, module=module).bands == 2


def test_whitened_score_is_the_log_likelihood_ratio() -> None:
    """⟨M x_g, M y⟩ − ½‖M x_g‖²: ½‖M x_g‖² at a noise-free included canary, −½‖M x_g‖² at an excluded one,
    (M x_g)_t for the correlated noise M⁻¹e_t (whitened back to one white entry)."""
    steps, c = 8, optimal_coefficients(8, 4)
    strategy = strategy_matrix(c, steps)
    groups = torch.tensor([0, 1, 2, 3, 1])
    values = torch.zeros(steps, 5, dtype=torch.float64)
    values[0::4, 0] = 1.0  # canary 0 (group 0) included, no noise
    values[:, 2] = torch.linalg.solve_triangular(strategy, torch.eye(steps, dtype=torch.float64), upper=False)[:, 5]
    scores = whitened_scores(values, groups, [2 * x for x in c])  # the claimed M: normalized
    pattern = torch.zeros(steps, 4, dtype=torch.float64)
    for g in range(4):
        pattern[g::4, g] = 1.0
    norms2 = (strategy @ pattern).square().sum(0)
    assert scores[0].item() == pytest.approx(0.5 * norms2[0].item(), rel=1e-12)
    assert norms2[0].item() == pytest.approx(2.0, rel=1e-12)  # two full columns of norm 1
    assert scores[1].item() == pytest.approx(-0.5 * norms2[1].item(), rel=1e-12) and norms2[1] < 2
    assert scores[2].item() == pytest.approx((strategy @ pattern[:, 2])[5].item() - 0.5 * norms2[2].item(), abs=1e-12)


def _band(bands: int) -> BandedToeplitz:
    return BandedToeplitz((1.0,) + (0.0,) * (bands - 1))


def test_claim_is_the_mechanisms_accounting_at_rate_one() -> None:
    """μ = √(Σ σ′⁻²) over the steps the BandMF accounting charges: ⌈T/b⌉ of them (7 of 25 at b = 4), not T."""
    assert cyclic_claimed_mu(_band(4), [2.0] * 25) == pytest.approx(math.sqrt(7) / 2, rel=1e-12)
    assert cyclic_claimed_mu(_band(1), [2.0] * 25) == pytest.approx(2.5, rel=1e-12)
    assert cyclic_claimed_mu(_band(4), [0.0] * 5) == math.inf  # no noise, no claim
    with pytest.raises(ValueError, match="one noise multiplier"):  # the engine refuses a changing σ under BandMF
        cyclic_claimed_mu(_band(4), [2.0, 2.0, 1.0, 2.0])
    assert cyclic_claimed_mu(_band(49), [2.0] * 49) == 0.5  # 49 · (1/49) ≠ 1 in floating point
