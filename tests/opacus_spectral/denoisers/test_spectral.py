"""Pure RMT math (opacus_spectral.denoisers.rmt.spectral): closed-form oracle, fast paths, gates, spiked-model
properties.

Device: ``OPACUS_SPECTRAL_TEST_DEVICE`` (default ``cpu``; ``cuda`` on a GPU machine).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus_spectral.denoisers.rmt import PAPER_SETTING, DenoiseResult, rmt_denoise
from opacus_spectral.denoisers.rmt import spectral as S

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))
F64 = torch.float64
HYP = settings(max_examples=25, deadline=None, derandomize=True)


def paper_denoise(g: torch.Tensor, sigma: torch.Tensor | float, **kw: object) -> DenoiseResult:
    """``rmt_denoise`` in paper A's setting (κ gate, noisy-norm rescale) unless a test overrides it: these tests pin
    paper A's formulas; the defaults are ``RMTSettings``'s
    (``tests/opacus_spectral/denoisers/test_rmt_settings.py``)."""
    return rmt_denoise(g, sigma, **{**PAPER_SETTING, **kw})  # type: ignore[arg-type]


def gavish_donoho(obs: torch.Tensor, s: float, m: int, n: int) -> torch.Tensor:
    """notes/math.md "Test oracle": Frobenius-optimal shrinker in normalized units (Gavish–Donoho)."""
    big = max(m, n)
    beta = min(m, n) / big
    y = obs / (s * math.sqrt(big))
    val = s * math.sqrt(big) * ((y**2 - beta - 1) ** 2 - 4 * beta).clamp_min(0).sqrt() / y
    return torch.where(y >= 1 + math.sqrt(beta), val, torch.zeros_like(val))


def oracle_denoise(g: torch.Tensor, s: float, kappa: float = 1.02, norm_correction: bool = True) -> torch.Tensor:
    """Independent reference: float64 full SVD + Gavish–Donoho + gate + norm correction, one matrix at a time."""
    outs = []
    for mat in g.double():
        m, n = mat.shape
        u, sv, vh = torch.linalg.svd(mat, full_matrices=False)
        if sv[0] <= kappa * s * (math.sqrt(m) + math.sqrt(n)):
            outs.append(mat)
            continue
        den = u @ torch.diag(gavish_donoho(sv, s, m, n)) @ vh
        if norm_correction:
            den = den * (mat.norm() / den.norm())
        outs.append(den)
    return torch.stack(outs)


def spiked(
    bsz: int, m: int, n: int, rank: int, strength: float, s: float, seed: int = 0, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r signal X with singular values strength·[1..2]·s(mn)^{1/4} (BBP threshold units); G = X + sZ."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(bsz, m, rank, generator=gen, dtype=F64))[0]
    v = torch.linalg.qr(torch.randn(bsz, n, rank, generator=gen, dtype=F64))[0]
    lam = strength * s * (m * n) ** 0.25 * torch.linspace(1.0, 2.0, rank, dtype=F64)
    x = u @ torch.diag_embed(lam.expand(bsz, rank)) @ v.transpose(1, 2)
    g = x + s * torch.randn(bsz, m, n, generator=gen, dtype=F64)
    return x.to(DEVICE, dtype), g.to(DEVICE, dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(((a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1).clamp_min(1e-300)).max())


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double().flatten(1), b.double().flatten(1), dim=1)


# --------------------------------------------------------------------------------------------------
# closed forms


@pytest.mark.parametrize("shape", [(8, 768), (768, 16), (16, 384), (100, 300), (384, 384), (3072, 768), (1, 50)])
@pytest.mark.parametrize("s", [1e-4, 0.01, 3.0])
def test_shrinker_equals_gavish_donoho(shape: tuple[int, int], s: float) -> None:
    m, n = shape
    edge = s * (math.sqrt(m) + math.sqrt(n))
    obs = torch.linspace(0.01, 5.0, 4001, dtype=F64) * edge
    ours = S.shrink_singular_values(obs, torch.tensor(s, dtype=F64), m, n)
    ref = gavish_donoho(obs, s, m, n)
    assert torch.equal(ours == 0, ref == 0)  # same support: exactly the values above the edge
    assert (ours[obs < edge] == 0).all() and (ours[obs > edge * 1.0001] > 0).all()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12 * edge)
    ours32 = S.shrink_singular_values(obs.float(), torch.tensor(s), m, n)
    torch.testing.assert_close(ours32.double(), ref, rtol=1e-4, atol=1e-4 * edge)


@pytest.mark.parametrize("shape", [(8, 768), (64, 64), (768, 3072)])
def test_inversion_inverts_the_inflation(shape: tuple[int, int]) -> None:
    m, n = shape
    s = 0.3
    lam = torch.linspace(1.001, 20.0, 500, dtype=F64) * S.bbp_threshold(s, m, n)
    inflated = ((lam + s * s * n / lam) * (lam + s * s * m / lam)).sqrt()
    assert (inflated >= S.bulk_edge(s, m, n) * (1 - 1e-12)).all()
    torch.testing.assert_close(S.invert_inflation(inflated, torch.tensor(s, dtype=F64), m, n), lam, rtol=1e-9, atol=0)
    # at the BBP threshold the inflated value is exactly the bulk edge, and the shrinkage vanishes there
    at = torch.tensor([S.bbp_threshold(s, m, n)], dtype=F64)
    edge_val = ((at + s * s * n / at) * (at + s * s * m / at)).sqrt()
    torch.testing.assert_close(edge_val, torch.tensor([S.bulk_edge(s, m, n)], dtype=F64))
    assert S.optimal_shrinkage(at, torch.tensor(s, dtype=F64), m, n).item() == 0.0


def test_tracy_widom_table_matches_published_quantiles() -> None:
    # Johnstone (2001) Table 1 / Bejan (2005): TW1 0.90, 0.95, 0.99 quantiles
    assert S.tracy_widom_quantile(0.10) == pytest.approx(0.4501, abs=2e-4)
    assert S.tracy_widom_quantile(0.05) == pytest.approx(0.9793, abs=2e-4)
    assert S.tracy_widom_quantile(0.01) == pytest.approx(2.0234, abs=2e-4)
    assert S.tracy_widom_quantile(0.5) == pytest.approx(-1.2686, abs=5e-3)
    qs = torch.tensor(S.TW1_QUANTILES)
    assert (qs.diff() > 0).all()
    # interpolation between grid points is monotone and lands between the neighbours
    assert S.TW1_QUANTILES[7] < S.tracy_widom_quantile(10**-1.05) < S.TW1_QUANTILES[8]
    for bad in (0.0, 0.6, 1e-9):
        with pytest.raises(ValueError):
            S.tracy_widom_quantile(bad)


def test_tracy_widom_table_recomputed_from_fredholm_determinant() -> None:
    """F1(s) = det(I − K_s), K_s(x,y) = Ai(x+y+s) on L²(0,∞) (Ferrari–Spohn), Nyström (Bornemann)."""
    np = pytest.importorskip("numpy")
    special = pytest.importorskip("scipy.special")
    x, w = np.polynomial.legendre.leggauss(80)
    x, w = (x + 1) * 7.0, w * 7.0
    sw = np.sqrt(w)
    for i in (0, 7, 17, 27, 47, 77):
        q = S.TW1_QUANTILES[i]
        kern = special.airy(x[:, None] + x[None, :] + q)[0]
        f1 = np.linalg.det(np.eye(len(x)) - sw[:, None] * kern * sw[None, :])
        alpha = 10 ** S.TW1_LOG10_ALPHA[i]
        assert 1 - f1 == pytest.approx(alpha, rel=2e-5)


def test_tracy_widom_threshold_formula() -> None:
    # Johnstone: mu = (sqrt(N-1)+sqrt(p))^2, sigma = (sqrt(N-1)+sqrt(p))(1/sqrt(N-1)+1/sqrt(p))^(1/3)
    big, p, s, q = 768, 8, 0.5, S.tracy_widom_quantile(0.01)
    mu = (math.sqrt(767) + math.sqrt(8)) ** 2
    sc = (math.sqrt(767) + math.sqrt(8)) * (1 / math.sqrt(767) + 1 / math.sqrt(8)) ** (1 / 3)
    assert S.tracy_widom_threshold(s, p, big, 0.01) == pytest.approx(s * math.sqrt(mu + sc * q), rel=1e-12)
    assert S.tracy_widom_threshold(s, big, p, 0.01) == S.tracy_widom_threshold(s, p, big, 0.01)
    mu_ma = (math.sqrt(767.5) + math.sqrt(7.5)) ** 2
    sc_ma = (math.sqrt(767.5) + math.sqrt(7.5)) * (1 / math.sqrt(767.5) + 1 / math.sqrt(7.5)) ** (1 / 3)
    got = S.tracy_widom_threshold(s, big, p, 0.01, centering="ma")
    assert got == pytest.approx(s * math.sqrt(mu_ma + sc_ma * q), rel=1e-12)
    with pytest.raises(ValueError):
        S.tracy_widom_threshold(s, 0, 10, 0.01)
    with pytest.raises(ValueError):
        S.tracy_widom_threshold(s, 3, 10, 0.9)


def test_tracy_widom_threshold_for_vectors_is_chi_quantile() -> None:
    """1 × N: l₁ = ‖z‖² ~ χ²_N; the threshold's false-alarm rate matches (scipy as the reference)."""
    stats = pytest.importorskip("scipy.stats")
    for big, alpha in ((384, 0.01), (50, 0.1)):
        thr = S.tracy_widom_threshold(1.0, 1, big, alpha)
        assert stats.chi2.sf(thr**2, big) == pytest.approx(alpha, rel=0.05)


def test_tracy_widom_gate_false_alarm_rate_on_thin_pure_noise() -> None:
    """768×8 pure noise, 400 draws: requested 10 % → observed near it; κ = 1.02 would give ~1 %."""
    gen = torch.Generator().manual_seed(1234)
    z = torch.randn(400, 768, 8, generator=gen).to(DEVICE)
    tw = paper_denoise(z, 1.0, gate="tracy_widom", false_alarm=0.10)
    ma = paper_denoise(z, 1.0, gate="tracy_widom", false_alarm=0.10, tw_centering="ma")
    kap = paper_denoise(z, 1.0, gate="kappa", kappa=1.02)
    rate_tw, rate_ma, rate_k = (r.gated.double().mean().item() for r in (tw, ma, kap))
    assert 0.04 <= rate_tw <= 0.14, rate_tw  # Johnstone: conservative on thin shapes (~7 %)
    assert 0.06 <= rate_ma <= 0.14, rate_ma  # Ma (2012): closer (~9 %)
    assert rate_k < 0.03, rate_k  # the κ gate's rate is far outside the TW band
    strict = paper_denoise(z, 1.0, gate="tracy_widom", false_alarm=1e-3)
    assert strict.gated.sum().item() <= 3


# --------------------------------------------------------------------------------------------------
# batched paths vs the oracle


_ORACLE: dict[tuple[int, int, float], tuple[torch.Tensor, torch.Tensor]] = {}
SHAPES = [(8, 768), (768, 16), (16, 384), (64, 200), (100, 300), (300, 100), (96, 96), (384, 384)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["gram", "truncated", "full", "auto"])
def test_paths_equal_closed_form_oracle(shape: tuple[int, int], method: str) -> None:
    m, n = shape
    for s, rank, strength in ((0.01, 3, 2.0), (2.5, 1, 4.0)):
        _, g = spiked(2, m, n, rank, strength, s, seed=m + n + rank)
        key = (m, n, s)
        if key not in _ORACLE:  # the float64 per-matrix oracle is the slow part: once per case
            _ORACLE[key] = (oracle_denoise(g, s), oracle_denoise(g, s, norm_correction=False))
        ref, ref_raw = _ORACLE[key]
        res = paper_denoise(g, s, method=method, compute_dtype=F64)
        assert res.gated.all()
        assert res.tensor.dtype == F64
        assert rel(res.tensor, ref) < 1e-6
        raw = paper_denoise(g, s, method=method, compute_dtype=F64, norm_correction=False)
        assert rel(raw.tensor, ref_raw) < 1e-6


@pytest.mark.parametrize("method", ["gram", "truncated", "full"])
def test_float32_compute_close_to_oracle(method: str) -> None:
    _, g = spiked(4, 96, 160, 2, 3.0, 0.05, seed=3)
    res = paper_denoise(g.float(), 0.05, method=method)
    assert res.tensor.dtype == torch.float32
    assert rel(res.tensor, oracle_denoise(g, 0.05)) < 2e-4


def test_truncated_path_grows_block_and_falls_back() -> None:
    # 12 spikes > oversample (4): the block must grow; still equal to the oracle
    _, g = spiked(2, 150, 260, 12, 3.0, 0.02, seed=5)
    res = paper_denoise(g, 0.02, method="truncated", compute_dtype=F64, oversample=4)
    assert rel(res.tensor, oracle_denoise(g, 0.02)) < 1e-6
    # 40 spikes on a 70-row matrix: more than half the small side → full fallback, still exact
    _, g2 = spiked(2, 70, 90, 40, 3.0, 0.02, seed=6)
    res2 = paper_denoise(g2, 0.02, method="truncated", compute_dtype=F64, oversample=8)
    assert rel(res2.tensor, oracle_denoise(g2, 0.02)) < 1e-6


def test_truncated_gate_first_skips_pure_noise_without_copy() -> None:
    gen = torch.Generator().manual_seed(0)
    g = (0.01 * torch.randn(6, 200, 200, generator=gen)).to(DEVICE)
    res = paper_denoise(g, 0.01, method="truncated")
    assert res.tensor is g and not res.gated.any() and (res.top == 0).all()
    full = paper_denoise(g, 0.01, method="full")
    assert not full.gated.any()


def test_mixed_batch_per_matrix_sigma_and_gate() -> None:
    _, g = spiked(4, 80, 120, 2, 4.0, 0.1, seed=9)
    sig = torch.tensor([0.1, 5.0, 0.0, 0.1], dtype=F64)  # 5.0: edge far above the spikes → gate closed
    for method in ("gram", "truncated", "full"):
        res = paper_denoise(g, sig.to(DEVICE), method=method, compute_dtype=F64)
        assert res.gated.tolist() == [True, False, False, True]
        assert torch.equal(res.tensor[1], g[1]) and torch.equal(res.tensor[2], g[2])
        assert rel(res.tensor[[0, 3]], oracle_denoise(g[[0, 3]], 0.1)) < 1e-6


def test_tracy_widom_gate_paths_agree() -> None:
    _, g = spiked(3, 100, 140, 2, 3.0, 0.2, seed=11)
    outs = [
        paper_denoise(g, 0.2, gate="tracy_widom", false_alarm=1e-3, method=mth, compute_dtype=F64)
        for mth in ("gram", "truncated", "full")
    ]
    for o in outs[1:]:
        assert torch.equal(o.gated, outs[0].gated)
        assert rel(o.tensor, outs[0].tensor) < 1e-6


# --------------------------------------------------------------------------------------------------
# spiked-model properties


@HYP
@given(
    m=st.integers(16, 72),
    n=st.integers(16, 72),
    rank=st.integers(1, 3),
    strength=st.floats(3.0, 6.0),
    log_s=st.floats(-4, 1),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["gram", "truncated"]),
)
def test_spiked_model_properties(
    m: int, n: int, rank: int, strength: float, log_s: float, seed: int, method: str
) -> None:
    s = 10**log_s
    x, g = spiked(2, m, n, rank, strength, s, seed=seed, dtype=torch.float32)
    res = paper_denoise(g, s, method=method)
    assert res.gated.all()
    assert (cos(res.tensor, x) > cos(g, x)).all()  # closer to the signal than the noisy gradient
    torch.testing.assert_close(res.tensor.flatten(1).norm(dim=1), g.flatten(1).norm(dim=1), rtol=1e-5, atol=0)
    raw = paper_denoise(g, s, method=method, norm_correction=False)
    assert (raw.tensor.flatten(1).norm(dim=1) < g.flatten(1).norm(dim=1)).all()  # shrinkage only shrinks


@HYP
@given(
    m=st.integers(8, 64),
    n=st.integers(8, 64),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["gram", "truncated", "full"]),
)
def test_below_gate_and_sigma_zero_unchanged(m: int, n: int, seed: int, method: str) -> None:
    x, g = spiked(2, m, n, 1, 0.5, 0.1, seed=seed, dtype=torch.float32)  # signal below the BBP threshold
    # claim a noise level 1.5× the true one: the top singular value sits well inside the claimed bulk
    res = paper_denoise(g, 0.15, method=method)
    assert not res.gated.any() and torch.equal(res.tensor, g)
    zero = paper_denoise(g, 0.0, method=method)
    assert not zero.gated.any() and torch.equal(zero.tensor, g)


# --------------------------------------------------------------------------------------------------
# dtypes, degenerate input, determinism


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["gram", "truncated"])
def test_dtype_in_dtype_out(dtype: torch.dtype, method: str) -> None:
    _, g = spiked(2, 40, 90, 1, 5.0, 0.5, seed=2)
    g = g.to(dtype)
    res = paper_denoise(g, 0.5, method=method)
    assert res.tensor.dtype == dtype and res.tensor.shape == g.shape
    assert res.gated.all() and not torch.equal(res.tensor, g)
    assert rel(res.tensor, oracle_denoise(g.double(), 0.5)) < (
        2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    )


def test_nonfinite_matrix_left_unchanged() -> None:
    _, g = spiked(3, 30, 50, 1, 5.0, 0.2, seed=4, dtype=torch.float32)
    g[1, 3, 7] = float("nan")
    g[2, 0, 0] = float("inf")
    for method in ("gram", "truncated", "full"):
        res = paper_denoise(g, 0.2, method=method)
        assert res.finite.tolist() == [True, False, False]
        assert res.gated.tolist() == [True, False, False]
        assert torch.equal(res.tensor[1:].isnan(), g[1:].isnan())
        assert torch.equal(torch.nan_to_num(res.tensor[1:]), torch.nan_to_num(g[1:]))
        assert torch.isfinite(res.tensor[0]).all()


def test_empty_and_bad_input() -> None:
    e = torch.zeros(0, 5, 7, device=DEVICE)
    assert paper_denoise(e, 1.0).tensor is e
    z = torch.zeros(2, 0, 7, device=DEVICE)
    assert paper_denoise(z, 1.0).tensor is z
    with pytest.raises(ValueError):
        paper_denoise(torch.zeros(3, device=DEVICE), 1.0)
    with pytest.raises(TypeError):
        paper_denoise(torch.zeros(3, 3, dtype=torch.int64, device=DEVICE), 1.0)
    with pytest.raises(ValueError):
        paper_denoise(torch.zeros(2, 3, 3, device=DEVICE), torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError):
        paper_denoise(torch.ones(2, 3, 3, device=DEVICE), 1.0, gate="nope")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["gram", "truncated", "full"])
def test_deterministic_bitwise(method: str) -> None:
    _, g = spiked(3, 70, 110, 3, 2.5, 0.3, seed=8, dtype=torch.float32)
    a = paper_denoise(g, 0.3, method=method)
    b = paper_denoise(g.clone(), 0.3, method=method)
    assert a.gated.all() and torch.equal(a.tensor, b.tensor)


def test_unbatched_matrix() -> None:
    _, g = spiked(1, 20, 300, 1, 5.0, 0.1, seed=1)
    res = paper_denoise(g[0], 0.1, compute_dtype=F64)
    assert res.tensor.shape == (20, 300)
    assert rel(res.tensor.unsqueeze(0), oracle_denoise(g, 0.1)) < 1e-6


@pytest.mark.parametrize("rel_gap", [1e-3, -1e-3])
def test_cholesky_gate_is_exact_near_the_threshold(rel_gap: float) -> None:
    """Set sigma so that λ~₁ sits 0.1 % above / below κ·edge: the SVD-free screen decides like the full SVD."""
    gen = torch.Generator().manual_seed(21)
    g = torch.randn(4, 90, 130, generator=gen, dtype=F64).to(DEVICE)
    top = torch.linalg.svdvals(g)[:, 0]
    sig = top / ((1 + rel_gap) * 1.02 * (math.sqrt(90) + math.sqrt(130)))
    full = paper_denoise(g, sig, method="full", compute_dtype=F64)
    trunc = paper_denoise(g, sig, method="truncated", compute_dtype=F64)
    assert full.gated.tolist() == [rel_gap > 0] * 4
    assert torch.equal(trunc.gated, full.gated)
    assert rel(trunc.tensor, full.tensor) < 1e-6
