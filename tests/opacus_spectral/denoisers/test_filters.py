"""Low-pass filters (opacus_spectral.denoisers.filters) and the "lowpass" denoiser's role axes."""

from __future__ import annotations

import math
import os

import pytest
import torch
from opacus_spectral.denoisers import filters as F
from opacus_spectral.denoisers.lowpass import LowPassDenoiser
from opacus_spectral.step.parameters import ParamInfo
from opacus_spectral.step.pipeline import PostNoisePipeline

from opacus_spectral import NoisyGradient

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))
F64 = torch.float64


def rnd(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(DEVICE, dtype)


def test_binomial5_taps_dc_nyquist_and_variance() -> None:
    impulse = torch.zeros(11, dtype=F64, device=DEVICE)
    impulse[5] = 1.0
    torch.testing.assert_close(F.binomial5(impulse)[3:8].cpu(), torch.tensor([1, 4, 6, 4, 1], dtype=F64) / 16)
    const = torch.full((3, 9), 2.5, dtype=F64, device=DEVICE)
    torch.testing.assert_close(F.binomial5(const, axis=1), const)  # DC gain 1, edges included
    nyq = torch.tensor([(-1.0) ** i for i in range(16)], dtype=F64, device=DEVICE)
    assert F.binomial5(nyq)[2:-2].abs().max().item() < 1e-15  # Nyquist killed (interior)
    assert sum(h * h for h in F.BINOMIAL5) == pytest.approx(70 / 256)  # variance factor 0.273
    # interior response to a cosine of frequency w is cos^4(w/2)
    w = 2 * math.pi * 3 / 32
    x = torch.cos(w * torch.arange(32, dtype=F64, device=DEVICE))
    torch.testing.assert_close(F.binomial5(x)[2:-2], math.cos(w / 2) ** 4 * x[2:-2])


def test_symmetric_padding_edges() -> None:
    x = torch.arange(6, dtype=F64, device=DEVICE)  # ext: 1 0 | 0 1 2 3 4 5 | 5 4
    y = F.binomial5(x)
    assert y[0].item() == pytest.approx((1 * 1 + 4 * 0 + 6 * 0 + 4 * 1 + 1 * 2) / 16)
    assert y[5].item() == pytest.approx((1 * 3 + 4 * 4 + 6 * 5 + 4 * 5 + 1 * 4) / 16)
    assert F.symmetric_indices(3, 4).tolist() == [2, 2, 1, 0, 0, 1, 2, 2, 1, 0, 0]  # cba|abc|cba
    torch.testing.assert_close(F.binomial5(torch.tensor([3.0], device=DEVICE)), torch.tensor([3.0], device=DEVICE))


def test_axis_and_batch() -> None:
    x = rnd(4, 7, 9)
    for axis in (0, 1, 2, -1):
        y = F.binomial5(x, axis=axis)
        ref = torch.stack([F.binomial5(s, axis=0) for s in x.movedim(axis, -1).reshape(-1, x.shape[axis])])
        torch.testing.assert_close(y.movedim(axis, -1).reshape(-1, x.shape[axis]), ref)


def test_gaussian_kernel() -> None:
    h = F.gaussian_kernel(1.5)
    assert h.numel() == 2 * math.ceil(6.0) + 1 and h.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(h, h.flip(0))
    assert h[6 + 1].item() / h[6].item() == pytest.approx(math.exp(-0.5 / 1.5**2))
    const = torch.full((20,), -1.0, dtype=F64, device=DEVICE)
    torch.testing.assert_close(F.gaussian(const, 1.5), const)
    with pytest.raises(ValueError):
        F.gaussian_kernel(0.0)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_laplacian_matches_frequency_response_and_solves_system(sigma: float) -> None:
    x = rnd(5, 12, 10, seed=1)
    y1 = F.laplacian_smooth(x, sigma, axes=-1)
    # frequency response 1/(1 + 4σ sin²(ω/2)), ω = 2πk/N
    ratio = torch.fft.fft(y1, dim=-1) / torch.fft.fft(x, dim=-1)
    k = torch.arange(10, dtype=F64, device=DEVICE)
    torch.testing.assert_close(
        ratio.real, (1 / (1 + 4 * sigma * torch.sin(math.pi * k / 10) ** 2)).expand_as(ratio.real)
    )
    assert ratio.imag.abs().max().item() < 1e-10
    # (I − σΔ) y = x with the circular second difference
    lap = y1.roll(1, -1) + y1.roll(-1, -1) - 2 * y1
    torch.testing.assert_close(y1 - sigma * lap, x)
    y2 = F.laplacian_smooth(x, sigma, axes=(1, 2))
    lap2 = sum(y2.roll(sh, d) for d in (1, 2) for sh in (1, -1)) - 4 * y2
    torch.testing.assert_close(y2 - sigma * lap2, x)
    resp = F.laplacian_response([12, 10], sigma)
    w1 = torch.sin(math.pi * torch.arange(12, dtype=F64) / 12) ** 2
    w2 = torch.sin(math.pi * torch.arange(10, dtype=F64) / 10) ** 2
    torch.testing.assert_close(resp, 1 / (1 + 4 * sigma * (w1[:, None] + w2[None, :])))
    assert F.laplacian_smooth(x, 0.0).sub(x).abs().max().item() < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_filters_keep_dtype(dtype: torch.dtype) -> None:
    x = rnd(6, 16, dtype=dtype)
    for y in (F.binomial5(x), F.gaussian(x, 1.0), F.laplacian_smooth(x, 1.0, (0, 1))):
        assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(F.binomial5(x).float(), F.binomial5(x.float()).to(dtype).float())


# --------------------------------------------------------------------------------------------------
# the denoiser


def rec(name: str, role: str, t: torch.Tensor) -> NoisyGradient:
    return NoisyGradient(name=name, role=role, tensor=t, sigma=0.1, step=0, layer=name.rsplit(".", 1)[0])


def lora_records() -> list[NoisyGradient]:
    return [
        rec("enc.0.q.lora_A", "lora_A", rnd(4, 32, seed=1, dtype=torch.float32)),  # (r, in)
        rec("enc.0.q.lora_B", "lora_B", rnd(24, 4, seed=2, dtype=torch.float32)),  # (out, r)
        rec("enc.1.q.lora_A", "lora_A", rnd(4, 32, seed=3, dtype=torch.float32)),
        rec("enc.0.dense.weight", "weight", rnd(24, 32, seed=4, dtype=torch.float32)),
        rec("enc.0.dense.bias", "bias", rnd(24, seed=5, dtype=torch.float32)),
        rec("conv.weight", "weight", rnd(8, 2, 3, 3, seed=6, dtype=torch.float32)),
    ]


def test_lowpass_axis_per_role() -> None:
    recs = lora_records()
    d = LowPassDenoiser()
    out = d(recs)
    a, b = recs[0].tensor, recs[1].tensor
    assert out[0] is not None and torch.equal(out[0], F.binomial5(a, axis=1))  # A: along input features
    assert not torch.allclose(out[0], F.binomial5(a, axis=0))
    assert out[1] is not None and torch.equal(out[1], F.binomial5(b, axis=0))  # B: along output features
    assert not torch.allclose(out[1], F.binomial5(b, axis=1))
    assert out[2] is not None and torch.equal(out[2], F.binomial5(recs[2].tensor, axis=1))
    assert out[3:] == [None, None, None]  # weight untouched by default, 1-D off by default
    assert d.stats == {"filtered": 3}
    # smoothing a pure-noise A along its input axis cuts its variance to ≈ 0.273 (interior)
    noise = rnd(64, 4096, seed=9, dtype=torch.float32)
    sm = LowPassDenoiser()([rec("x.lora_A", "lora_A", noise)])[0]
    assert sm is not None and sm[:, 2:-2].var().item() == pytest.approx(70 / 256, rel=0.03)


def test_lowpass_weight_axis_vectors_and_options() -> None:
    recs = lora_records()
    out = LowPassDenoiser(weight_axis=1, vectors=True)(recs)
    assert out[3] is not None and torch.equal(out[3], F.binomial5(recs[3].tensor, axis=1))
    assert out[4] is not None and torch.equal(out[4], F.binomial5(recs[4].tensor, axis=0))
    conv = recs[5].tensor
    assert out[5] is not None and torch.equal(out[5], F.binomial5(conv.reshape(8, -1), axis=1).reshape(conv.shape))
    lap = LowPassDenoiser(kernel="laplacian", laplacian_dims=2)(recs)
    assert lap[0] is not None and torch.allclose(lap[0], F.laplacian_smooth(recs[0].tensor, 1.0, (0, 1)))
    lap1 = LowPassDenoiser(kernel="laplacian", kernel_width=2.0)(recs)
    assert lap1[1] is not None and torch.allclose(lap1[1], F.laplacian_smooth(recs[1].tensor, 2.0, 0))
    gau = LowPassDenoiser(kernel="gaussian", kernel_width=0.8)(recs)
    assert gau[0] is not None and torch.allclose(gau[0], F.gaussian(recs[0].tensor, 0.8, axis=1))
    # params= and the roles with an axis select the records the pipeline hands it
    picked = LowPassDenoiser(params=["enc.1"], role_axes={"lora_B": None})
    infos = [ParamInfo(r.name, r.role, r.layer) for r in recs]
    out = PostNoisePipeline([picked]).run([r.tensor.clone() for r in recs], infos, sigma=recs[0].sigma)
    assert [not torch.equal(o, r.tensor) for o, r in zip(out, recs, strict=True)] == [False, False, True] + [False] * 3
    for bad in (
        {"kernel": "box"},
        {"laplacian_dims": 3},
        {"weight_axis": 2},
        {"kernel": "gaussian", "kernel_width": -1.0},
        {"kernel_width": 1.0},
        {"laplacian_dims": 2},
    ):
        with pytest.raises(ValueError):
            LowPassDenoiser(**bad)  # type: ignore[arg-type]


def test_lowpass_batched_equals_single_and_dtype() -> None:
    recs = [rec(f"l{i}.lora_A", "lora_A", rnd(4, 40, seed=i, dtype=torch.bfloat16)) for i in range(4)]
    out = LowPassDenoiser()(recs)
    for r, o in zip(recs, out, strict=True):
        assert o is not None and o.dtype == torch.bfloat16
        assert torch.equal(o, LowPassDenoiser()([r])[0])  # type: ignore[arg-type]
    empty = LowPassDenoiser()([rec("e.lora_A", "lora_A", torch.zeros(0, 8, device=DEVICE))])
    assert empty == [None]


def test_lowpass_sigma_zero_unchanged() -> None:
    r = rec("a.lora_A", "lora_A", rnd(4, 40, dtype=torch.float32))
    r.sigma = 0.0
    assert LowPassDenoiser()([r]) == [None]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"kernel": "laplacian", "laplacian_dims": 2},
        {"kernel": "gaussian", "kernel_width": 1.5, "weight_axis": 0, "vectors": True},
    ],
)
def test_lowpass_conformance_kit(kwargs: dict[str, object]) -> None:
    from opacus_spectral.plugins.testing import check_denoiser

    check_denoiser(lambda: LowPassDenoiser(**kwargs), device=DEVICE, steps=2)  # type: ignore[arg-type]
