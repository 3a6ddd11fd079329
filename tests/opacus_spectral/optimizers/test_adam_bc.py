"""DP-AdamBC (opacus_spectral.optimizers.adam_bc): without noise it is Adam; it removes exactly the noise variance
Φ̄_t from v̂_t (constant Φ: Φ itself; varying Φ: Adam's weighted average); the engine hands it each step's Φ_t —
(σC/B)² under DP-SGD, divided by c_0² at BandMF's first step — and what it cannot correct is refused."""

from __future__ import annotations

import pytest
import torch
from opacus_spectral.mechanisms.install import mechanism_of
from opacus_spectral.optimizers import DPAdamBC
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")


def _steps(opt: torch.optim.Optimizer, p: nn.Parameter, grads, phis=None) -> None:
    for i, g in enumerate(grads):
        p.grad = g.clone()
        if phis is not None:
            opt.noise_variance = phis[i]
        opt.step()


def test_without_noise_it_is_adam():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(20)]
    a = nn.Parameter(torch.ones(50, dtype=torch.float64))
    b = nn.Parameter(torch.ones(50, dtype=torch.float64))
    _steps(torch.optim.Adam([a], lr=0.01, eps=0.0), a, grads)
    _steps(DPAdamBC([b], lr=0.01, gamma=1e-300), b, grads, [0.0] * 20)
    assert torch.allclose(a, b, rtol=1e-12, atol=0)


def test_it_removes_the_noise_variance_from_the_second_moment():
    """Gradient g + noise of variance Φ: v̂ − Φ̄ estimates g² (here within 2 %), where v̂ alone is g² + Φ."""
    n, steps, phi = 20_000, 1_500, 4.0
    gen = torch.Generator().manual_seed(1)
    clean = torch.full((n,), 0.5, dtype=torch.float64)
    p = nn.Parameter(torch.zeros(n, dtype=torch.float64))
    opt = DPAdamBC([p], lr=0.0, gamma=1e-12, betas=(0.9, 0.99))
    grads = [clean + phi**0.5 * torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(steps)]
    _steps(opt, p, grads, [phi] * steps)
    state, bias = opt.state[p], 1 - 0.99**steps
    v_hat, phi_bar = state["exp_avg_sq"] / bias, state["noise_avg"] / bias
    assert phi_bar == pytest.approx(phi, rel=1e-12)
    assert float(v_hat.mean()) == pytest.approx(0.25 + phi, rel=0.02)
    assert float((v_hat - phi_bar).mean()) == pytest.approx(0.25, rel=0.02)


def test_a_varying_variance_is_averaged_with_the_second_moments_weights():
    p = nn.Parameter(torch.zeros(3))
    opt = DPAdamBC([p], gamma=1e-8, betas=(0.9, 0.8))
    phis = [1.0, 4.0, 0.5, 2.0]
    _steps(opt, p, [torch.ones(3)] * 4, phis)
    t = len(phis)
    expected = sum(0.2 * 0.8 ** (t - k) * phis[k - 1] for k in range(1, t + 1))
    assert opt.state[p]["noise_avg"] == pytest.approx(expected, rel=1e-12)


def _private(optimizer_fn, mechanism=None, steps=4, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    engine = PrivacyEngine(accountant="rdp", noise_seed=3)
    extra = {} if mechanism is None else {"noise_mechanism": mechanism, "steps": steps}
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
    out = engine.make_private(
        module=model,
        optimizer=optimizer_fn(model.parameters()),
        data_loader=DataLoader(data, batch_size=32),
        noise_multiplier=1.3,
        max_grad_norm=0.7,
        **extra,
        **kw,
    )
    return engine, model, *out


def _one_step(gsm, opt, dl, criterion=None):
    xb, yb = next(iter(dl))
    opt.zero_grad()
    (criterion or nn.functional.cross_entropy)(gsm(xb), yb).backward()
    opt.step()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("mechanism", [None, ("bandmf", {"bands": 2})])
def test_the_engine_hands_it_the_variance_of_the_noise_it_added(mechanism, mode):
    extra = {"grad_sample_mode": mode, **({"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {})}
    out = _private(lambda ps: DPAdamBC(ps, lr=1e-3, gamma=1e-8, betas=(0.9, 0.999)), mechanism, **extra)
    engine, model, gsm, opt = out[:4]
    criterion, dl = (out[4], out[5]) if mode == "ghost" else (None, out[4])
    _one_step(gsm, opt, dl, criterion)
    phi = (1.3 * 0.7 / 32) ** 2  # (σC/B)²
    if mechanism is not None:
        phi /= mechanism_of(opt).coefficients[0] ** 2  # ‖row_1(M⁻¹)‖ = 1/c_0
    first = opt.original_optimizer.state[next(model.parameters())]
    assert first["noise_avg"] / (1 - 0.999) == pytest.approx(phi, rel=1e-9)


def test_what_it_cannot_correct_is_refused():
    with pytest.raises(TypeError, match="gamma"):
        DPAdamBC([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        DPAdamBC([nn.Parameter(torch.zeros(2))], lr=0.1, gamma=0.0)
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="needs the DP noise variance"):
        DPAdamBC([p], lr=0.1, gamma=1e-8).step()
    with pytest.raises(ValueError, match="post_hooks"):
        _private(lambda ps: DPAdamBC(ps, gamma=1e-8), post_hooks=["rmt"])
