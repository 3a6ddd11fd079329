import pytest
import torch
from opacus_spectral.plugins.testing import check_denoiser
from opacus_spectral_disk import DiskDenoiser, DiskGradient
from torch import nn

import opacus_spectral
from opacus_spectral import NoisyGradient, PrivacyEngine


def test_registered_by_name_and_conformant():
    assert opacus_spectral.available_denoisers()["disk"].distribution == "opacus-spectral-disk"
    check_denoiser(lambda: DiskDenoiser(kappa=0.7), stateful=True, sigma_zero_identity=False)


def test_kalman_recursion_and_declared_noise():
    d = DiskDenoiser(kappa=0.5)
    g0, g1 = torch.tensor([[2.0, 4.0]]), torch.tensor([[0.0, 8.0]])
    torch.testing.assert_close(d([NoisyGradient("w", "weight", g0, 1.0, 0)])[0], g0)  # g_0 = g~_0
    torch.testing.assert_close(d([NoisyGradient("w", "weight", g1, 1.0, 1)])[0], 0.5 * g0 + 0.5 * g1)
    assert d.output_noise([None]) == [pytest.approx((0.25 + 0.25) ** 0.5)]
    gen = torch.Generator().manual_seed(0)
    d = DiskDenoiser(kappa=0.3)
    for t in range(10):
        rec = NoisyGradient("w", "weight", 0.2 * torch.randn(300, 300, generator=gen), 0.2, t)
        out = d([rec])[0]
        (gain,) = d.output_noise([rec])
        assert float(out.std()) == pytest.approx(0.2 * gain, rel=0.03)


def test_two_point_gradient_is_the_combination_of_per_example_gradients():
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    model = nn.Linear(5, 3)
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        allow_non_private=True,
        doctor=False,  # the test feeds its own batches (the loader only sets the accounting up)
    )
    two = DiskGradient(gsm, kappa=0.7, gamma=0.5)

    def loss():
        return nn.functional.mse_loss(gsm(x), y, reduction="mean")

    x_0 = [p.detach().clone() for p in model.parameters()]
    two.backward(loss)  # first step: plain
    opt.step()
    opt.zero_grad()
    x_t = [p.detach().clone() for p in model.parameters()]
    d = [a - b for a, b in zip(x_t, x_0, strict=True)]
    two.backward(loss)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), x_t, strict=True))  # restored exactly
    a = two.a

    def per_example(params):
        w, b = params
        out = []
        for i in range(8):
            wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
            li = nn.functional.mse_loss(x[i : i + 1] @ wi.T + bi, y[i : i + 1], reduction="sum") / (8 * 3)
            out.append(torch.autograd.grad(li, [wi, bi]))
        return out

    ahead = per_example([p + 0.5 * di for p, di in zip(x_t, d, strict=True)])
    here = per_example(x_t)
    for j, p in enumerate(model.parameters()):
        want = torch.stack([a * ahead[i][j] + (1 - a) * here[i][j] for i in range(8)]) * 8
        torch.testing.assert_close(p.grad_sample, want, rtol=1e-4, atol=1e-6)


def test_physical_batches_of_one_logical_step_extrapolate_along_the_same_move():
    """BatchMemoryManager calls backward once per physical batch at the same x_t: each call must extrapolate along
    d_t = x_t − x_{t−1}, not along the zero move between two physical batches."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    model = nn.Linear(5, 3)
    gsm, opt, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        allow_non_private=True,
        doctor=False,  # the test feeds its own batches (the loader only sets the accounting up)
    )
    two = DiskGradient(gsm, kappa=0.7, gamma=0.5)

    def loss(rows: slice):
        return lambda: nn.functional.mse_loss(gsm(x[rows]), y[rows])

    two.backward(loss(slice(None)))
    opt.step()
    opt.zero_grad()
    state = (two._prev, two._at)
    two.backward(loss(slice(0, 4)))  # the first physical batch of logical step 1
    opt.zero_grad()
    two.backward(loss(slice(4, 8)))  # the second one, same parameters
    second = [p.grad_sample.clone() for p in model.parameters()]
    opt.zero_grad()
    two._prev, two._at = state  # the second half as the first call of that step
    two.backward(loss(slice(4, 8)))
    for got, want in zip(second, (p.grad_sample for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want)
    opt.zero_grad()
    gsm(x[4:8]).sub(y[4:8]).pow(2).mean().backward()  # the plain gradient differs: the test can fail
    assert not torch.allclose(second[0], next(model.parameters()).grad_sample)


def test_ghost_clipping_is_refused():
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(4, 3), torch.randn(4, 2)), batch_size=4
        ),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    with pytest.raises(ValueError, match="per-sample gradients"):
        DiskGradient(out[0])
