"""The noise model travels with the records: a linear temporal filter (``ema``) declares the exact std of its
output and the pipeline hands it on; a spatial filter marks its output colored; a spectral denoiser skips
what is not isotropic with a known std. Plus the ``ema`` denoiser itself and ``rmt``'s norm and residual
policies and its warnings."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from engine_helpers import Recorder
from opacus_spectral.denoisers import EMADenoiser, RMTDenoiser
from opacus_spectral.denoisers.rmt import rmt_denoise
from opacus_spectral.denoisers.rmt.spectral import shrink_singular_values
from opacus_spectral.plugins.testing import check_denoiser
from opacus_spectral.step.parameters import ParamInfo
from opacus_spectral.step.pipeline import PostNoisePipeline
from torch import nn

from opacus_spectral import NoisyGradient, PrivacyEngine

NM, C, B = 1.0, 1.0, 32


def _pure_noise_engine(post_hooks, width=64, layers=4, steps=12):
    """A stack of square Linear layers trained on loss × 0: every p.grad is pure DP noise of std nm·C/B."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    data = torch.utils.data.TensorDataset(torch.randn(B * steps, width), torch.zeros(B * steps, width))
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=B),
        noise_multiplier=NM,
        max_grad_norm=C,
        poisson_sampling=False,
        post_hooks=post_hooks,
        noise_generator=torch.Generator().manual_seed(1),
    )
    for x, y in dl:
        opt.zero_grad()
        nn.functional.mse_loss(gsm(x) * 0.0, y).backward()
        opt.step()
    return engine


def test_ema_declares_the_exact_std_of_its_output_through_the_engine():
    after = Recorder()
    _pure_noise_engine([("ema", {"beta": 0.9}), after])
    s = NM * C / B
    for t, step in enumerate(after.seen, 1):
        declared = {r["sigma"] for r in step}
        assert len(declared) == 1
        sigma_out = declared.pop()
        # closed form for constant s: s·sqrt((1−β)(1−β^{2t})/(1+β))/(1−β^t)
        expected = s * math.sqrt(0.1 * (1 - 0.9 ** (2 * t)) / 1.9) / (1 - 0.9**t)
        assert sigma_out == pytest.approx(expected, rel=1e-9)
        measured = float(torch.cat([r["tensor"].flatten() for r in step]).std())
        assert measured == pytest.approx(sigma_out, rel=0.05), f"step {t}"
    assert sigma_out < 0.35 * s  # after 12 steps (settled: s·sqrt(0.1/1.9) ≈ 0.23 s)


def test_rmt_after_ema_keeps_its_nominal_false_gate_rate_on_pure_noise():
    tw = ("rmt", {"gate": "tracy_widom", "false_alarm": 0.1, "warn_after": 0})
    engine = _pure_noise_engine([("ema", {"beta": 0.9}), tw], layers=8, steps=30)
    gated = sum(int(d.denoisers["rmt"]["gated"]) for d in engine.post_hooks.diagnostics.history)
    considered = sum(d.denoisers["rmt"]["matrices"] for d in engine.post_hooks.diagnostics.history)
    assert considered == 8 * 30
    rate = gated / considered
    assert 0.02 <= rate <= 0.25, rate  # nominal 10 % (Johnstone's centering is slightly conservative)
    # with the raw, undeclared noise level the gate would never open: it is ~4x the EMA's actual noise
    engine = _pure_noise_engine([("ema", {"beta": 0.9}), _Undeclared(), tw], layers=8, steps=5)
    assert all(d.denoisers["rmt"]["skipped_noise"] == 8 for d in engine.post_hooks.diagnostics.history)


class _Undeclared:
    """A pass-through callable that does not declare its output noise."""

    name = "undeclared"

    def __call__(self, grads):
        return None


def test_lowpass_marks_colored_and_rmt_skips_and_counts():
    recs = [NoisyGradient(f"l{i}.lora_A", "lora_A", torch.randn(4, 32), 0.1, 0, f"l{i}") for i in range(2)]
    recs.append(NoisyGradient("dense.weight", "weight", torch.randn(40, 48), 0.1, 0, "dense"))
    infos = [ParamInfo(r.name, r.role, r.layer) for r in recs]
    seen = Recorder()
    pipe = PostNoisePipeline([opacus_lowpass(), seen, RMTDenoiser(warn_after=0)])
    pipe.run([r.tensor for r in recs], infos, 0.1)
    assert [r["sigma"] for r in seen.seen[0]] == [0.1, 0.1, 0.1]
    kinds = [r.noise for r in seen.raw[0]]
    assert kinds == ["colored", "colored", "isotropic"]  # lowpass filtered A (not the plain weight)
    rmt = pipe.diagnostics.last.denoisers["rmt"]
    assert rmt["skipped_noise"] == 2 and rmt["matrices"] == 1


def opacus_lowpass():
    from opacus_spectral.denoisers import LowPassDenoiser

    return LowPassDenoiser()


def test_ema_matches_the_recursion_and_skips_steps_without_a_gradient():
    ema = EMADenoiser(beta=0.5)
    g = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 0.0]]), torch.tensor([[5.0, 4.0]])]
    out_a = ema([NoisyGradient("a", "weight", g[0], 1.0, 0)])[0]
    torch.testing.assert_close(out_a, g[0])  # bias-corrected first step: the input itself
    out = ema([NoisyGradient("a", "weight", g[1], 1.0, 1), NoisyGradient("b", "weight", g[2], 1.0, 1)])
    m = 0.5 * (0.5 * g[0]) + 0.5 * g[1]  # raw average after two steps, corrected by 1 − 0.25
    torch.testing.assert_close(out[0], m / 0.75)
    torch.testing.assert_close(out[1], g[2])  # "b" was absent at step 0: its own counter starts now
    assert ema.t == {"a": 2, "b": 1}
    gains = ema.output_noise([None, None])
    assert gains[0] == pytest.approx(math.sqrt(0.25 * 0.25 + 0.25) / 0.75) and gains[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beta"):
        EMADenoiser(beta=1.0)


def test_ema_passes_the_conformance_kit():
    check_denoiser(lambda: EMADenoiser(beta=0.8), stateful=True, sigma_zero_identity=False)


# --------------------------------------------------------------------------------------------- rmt policies
def _spiked(m=64, n=96, rank=2, strength=3.0, s=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, rank, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=torch.float64))
    lam = strength * s * (m * n) ** 0.25 * torch.arange(rank, 0, -1, dtype=torch.float64)
    clean = u @ torch.diag(lam) @ v.T
    return clean, clean + s * torch.randn(m, n, generator=g, dtype=torch.float64), s


def test_norm_correction_policies():
    clean, y, s = _spiked()
    m, n = y.shape
    kappa = {"gate": "kappa", "compute_dtype": torch.float64}
    noisy = rmt_denoise(y, s, norm_correction="noisy", **kappa).tensor
    assert float(noisy.norm()) == pytest.approx(float(y.norm()), rel=1e-9)
    est = rmt_denoise(y, s, norm_correction="clean_estimate", **kappa).tensor
    assert float(est.norm()) == pytest.approx(math.sqrt(float(y.norm()) ** 2 - m * n * s * s), rel=1e-9)
    assert float(est.norm()) == pytest.approx(float(clean.norm()), rel=0.05)  # the estimate is unbiased
    none = rmt_denoise(y, s, norm_correction=False, **kappa).tensor
    assert float(none.norm()) < float(est.norm())
    noisy = rmt_denoise(y, s, norm_correction="noisy").tensor
    assert torch.equal(rmt_denoise(y, s, norm_correction=True).tensor, noisy)
    assert torch.equal(rmt_denoise(y, s).tensor, rmt_denoise(y, s, norm_correction="clean_estimate").tensor)
    with pytest.raises(ValueError, match="norm_correction"):
        RMTDenoiser(norm_correction="clean")


@pytest.mark.parametrize("method", ["gram", "truncated", "full"])
def test_residual_keeps_the_sub_threshold_part_scaled(method):
    clean, y, s = _spiked(m=48, n=200)
    kw = dict(gate="kappa", norm_correction="none", compute_dtype=torch.float64, method=method)
    paper = rmt_denoise(y, s, residual=0.0, **kw).tensor
    deflate = rmt_denoise(y, s, residual=1.0, **kw).tensor
    half = rmt_denoise(y, s, residual=0.5, **kw).tensor
    # reference with numpy: ρY + Σ_spikes (η − ρλ~) u vᵀ
    u, sv, vh = np.linalg.svd(y.numpy(), full_matrices=False)
    etas = shrink_singular_values(torch.as_tensor(sv), torch.tensor(s, dtype=torch.float64), 48, 200).numpy()
    spikes = etas > 0
    for rho, got in ((0.0, paper), (1.0, deflate), (0.5, half)):
        ref = rho * y.numpy() + (u[:, spikes] * (etas[spikes] - rho * sv[spikes])) @ vh[spikes]
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-9)
    assert torch.linalg.matrix_rank(paper) == int(spikes.sum()) and torch.linalg.matrix_rank(deflate) == 48
    js = rmt_denoise(y, s, residual="james_stein", **kw).tensor  # pure-noise residual: ρ estimated ≈ 0
    assert float((js - paper).norm()) < 0.2 * float((deflate - paper).norm())
    with pytest.raises(ValueError, match="residual"):
        RMTDenoiser(residual=1.5)


def test_rmt_warns_once_when_it_never_gates_and_when_gates_are_marginal():
    rng = torch.Generator().manual_seed(0)
    d = RMTDenoiser(warn_after=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):  # pure noise, square: the κ gate never opens
            d([NoisyGradient("w", "weight", torch.randn(64, 64, generator=rng), 1.0, step)])
    assert sum("gated no matrix in its first 3 steps" in str(w.message) for w in caught) == 1
    d = RMTDenoiser(warn_after=4, gate="kappa", kappa=0.98)  # a gate just below the edge: pure noise crosses it, barely
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            d([NoisyGradient(f"w{i}", "weight", torch.randn(16, 256, generator=rng), 1.0, step) for i in range(20)])
    assert int(d._run_gated) > 0
    assert sum("marginal" in str(w.message) for w in caught) == 1
