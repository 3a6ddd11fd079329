"""Certified spectrum screens (opacus_spectral.denoisers.rmt.screen, docs/math.md §1.12): exactness of every decision.

Device: ``OPACUS_SPECTRAL_TEST_DEVICE`` (default ``cpu``; ``cuda`` on a GPU machine).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from opacus_spectral.denoisers.rmt import PAPER_SETTING, DenoiseResult, rmt_denoise
from opacus_spectral.denoisers.rmt import screen as K

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))
F64 = torch.float64


def paper_denoise(g: torch.Tensor, sigma: torch.Tensor | float, **kw: object) -> DenoiseResult:
    """``rmt_denoise`` in paper A's setting (κ gate, noisy-norm rescale) unless a test overrides it: these tests pin
    paper A's formulas; the defaults are ``RMTSettings``'s
    (``tests/opacus_spectral/denoisers/test_rmt_settings.py``)."""
    return rmt_denoise(g, sigma, **{**PAPER_SETTING, **kw})  # type: ignore[arg-type]


def noise_with_spikes(
    bsz: int, m: int, n: int, spikes: list[float], seed: int, dtype: torch.dtype = F64
) -> torch.Tensor:
    """Z (i.i.d. N(0, 1)) plus orthonormal spikes with the given singular values."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(bsz, m, n, generator=gen, dtype=F64)
    if spikes:
        k = len(spikes)
        u = torch.linalg.qr(torch.randn(bsz, m, k, generator=gen, dtype=F64))[0]
        v = torch.linalg.qr(torch.randn(bsz, n, k, generator=gen, dtype=F64))[0]
        g += (u * torch.tensor(spikes, dtype=F64)) @ v.mT
    return g.to(DEVICE, dtype)


def gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------------------------------
# the exact Cholesky certificate


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rel_gap", [1e-3, -1e-3, 0.2])
def test_cholesky_certificate_is_the_exact_top_eigenvalue_test(rel_gap: float, transposed: bool) -> None:
    """``ok ⟺ λ₁(XXᵀ) < c``, with c 0.1 % (or 20 %) above / below λ₁; also on a transposed view (column-major)."""
    x = noise_with_spikes(3, 150, 90, [], seed=1).mT if transposed else noise_with_spikes(3, 90, 150, [], seed=1)
    lam1 = torch.linalg.eigvalsh(x @ x.mT)[:, -1]
    ok = K.cholesky_certificate(x, lam1 * (1 + rel_gap), panel=32)
    assert ok.tolist() == [rel_gap > 0] * 3


def test_cholesky_certificate_with_deflation_counts_eigenvalues() -> None:
    """With W = the top-k eigenpairs, ``ok ⟺ λ_{k+1} < c`` (Weyl): the completeness proof of the spike set."""
    x = noise_with_spikes(2, 80, 120, [60.0, 50.0, 40.0], seed=2)
    w, u = torch.linalg.eigh(x @ x.mT)
    level = 0.5 * (w[:, -3] + w[:, -4])  # between the third and the fourth eigenvalue
    for k, expect in ((3, True), (2, False), (0, False)):
        lowrank = u[:, :, w.shape[1] - k :] * w[:, w.shape[1] - k :].sqrt()[:, None, :] if k else None
        assert K.cholesky_certificate(x, level, lowrank, panel=24).tolist() == [expect] * 2
    nan = x.clone()
    nan[1, 4, 5] = float("nan")
    assert K.cholesky_certificate(nan, torch.full((2,), 1e9, dtype=F64, device=DEVICE)).tolist() == [True, False]


# --------------------------------------------------------------------------------------------------
# block Lanczos


def test_block_lanczos_is_an_orthonormal_krylov_basis_with_exact_projection() -> None:
    x = noise_with_spikes(2, 120, 200, [80.0], seed=3)
    lz = K.BlockLanczos(x, 8, 64, gen())
    lz.extend(5)
    assert lz.steps == 5 and lz.degree == 4
    q = lz.q[:, :, : lz.dim + lz.block]
    eye = torch.eye(q.shape[2], dtype=F64, device=DEVICE)
    torch.testing.assert_close(q.mT @ q, eye.expand_as(q.mT @ q), atol=1e-12, rtol=0)
    a = x @ x.mT
    qd = q[:, :, : lz.dim]
    t = lz.t[:, : lz.dim, : lz.dim]
    torch.testing.assert_close(0.5 * (t + t.mT), qd.mT @ a @ qd, atol=1e-9 * float(a.norm()), rtol=0)
    r = lz.ritz()
    y = lz.vectors(r.coef)
    true_res = torch.linalg.vector_norm(a @ y - y * r.theta[:, None, :], dim=1)
    torch.testing.assert_close(r.residual, true_res, atol=1e-8 * float(a.norm()), rtol=1e-6)
    lam = torch.linalg.eigvalsh(a)
    d = r.theta.shape[1]
    assert (r.theta <= lam[:, -d:] * (1 + 1e-12)).all()  # interlacing: Ritz values never exceed eigenvalues
    # the cap: at most half the small side
    assert K.BlockLanczos(x, 8, 10_000, gen()).max_dim == 56


def test_block_lanczos_survives_an_exactly_low_rank_matrix() -> None:
    """Breakdown (the Krylov space becomes invariant): Ritz values stay the true eigenvalues, none larger."""
    gen_ = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, 2, generator=gen_, dtype=F64) @ torch.randn(1, 2, 100, generator=gen_, dtype=F64)
    x = x.to(DEVICE)
    lz = K.BlockLanczos(x, 4, 32, gen())
    lz.extend(6)
    lam = torch.linalg.eigvalsh(x @ x.mT)[0]
    theta = lz.ritz().theta[0]
    assert float(theta.max()) <= float(lam.max()) * (1 + 1e-10)
    torch.testing.assert_close(theta[-2:], lam[-2:], rtol=1e-10, atol=0)
    assert (theta[:-2].abs() < 1e-8 * float(lam.max())).all()
    zero = torch.zeros(1, 40, 60, dtype=F64, device=DEVICE)
    scr = K.krylov_gate(_extended(zero, 4), torch.ones(1, dtype=F64, device=DEVICE), 1e-12)
    assert scr.shut.tolist() == [True] and scr.open.tolist() == [False]


def _extended(x: torch.Tensor, steps: int, block: int = 8) -> K.BlockLanczos:
    lz = K.BlockLanczos(x, block, 10_000, gen())
    lz.extend(steps)
    return lz


# --------------------------------------------------------------------------------------------------
# the Krylov gate


def test_chi2_small_ball_bounds_the_failure_probability() -> None:
    """``P(χ²_b < g²) ≤ δ`` (and not absurdly loose): the regularized lower incomplete gamma at g²/2."""
    for b, delta in ((8, 1e-12), (16, 1e-12), (16, 1e-6), (32, 1e-9)):
        g2 = K.chi2_small_ball(b, delta)
        p = float(torch.special.gammainc(torch.tensor(b / 2, dtype=F64), torch.tensor(g2 / 2, dtype=F64)))
        assert delta / 10 < p <= delta  # the bound drops e^{-g²/2} ≤ 1 only
    with pytest.raises(ValueError):
        K.chi2_small_ball(16, 0.0)


@pytest.mark.parametrize("above", [1.001, 1.01, 1.05, 1.5])
def test_krylov_gate_never_shuts_a_gate_that_is_open(above: float) -> None:
    """λ₁ just above τ² (0.1 % … 50 %): the screen says open or undecided, never shut — at every checkpoint."""
    m, n = 256, 384
    x = noise_with_spikes(4, m, n, [], seed=5)
    lam1 = torch.linalg.eigvalsh(x @ x.mT)[:, -1]
    tau2 = lam1 / above
    lz = K.BlockLanczos(x, 16, 10_000, gen())
    for _ in range(12):
        lz.extend(1)
        scr = K.krylov_gate(lz, tau2, 1e-12)
        assert not scr.shut.any()
        assert not (scr.open & scr.shut).any()
    if above >= 1.05:  # a clear case is decided: open, with the top Ritz value a lower bound of λ₁
        assert scr.open.all() and (scr.top <= lam1 * (1 + 1e-12)).all()


def test_krylov_screen_decides_pure_noise_as_shut_and_borderline_as_undecided() -> None:
    """Square noise at κ = 1.02 (λ₁ ≈ 0.96 τ²): shut within the predicted steps; λ₁ at 0.999 τ²: undecided."""
    m = 640
    x = noise_with_spikes(2, m, m, [], seed=6, dtype=torch.float32)
    tau2 = torch.full((2,), (1.02 * 2 * math.sqrt(m)) ** 2, device=DEVICE)
    opened, undecided, lz = K.krylov_screen(x, tau2, block=16, max_steps=40, false_shut=1e-12, generator=gen())
    assert opened.tolist() == [False] * 2 and undecided.tolist() == [False] * 2
    assert 12 <= lz.steps <= 20  # §1.12.3: 12–20 steps for square noise at κ = 1.02
    lam1 = torch.linalg.eigvalsh((x @ x.mT).double())[:, -1].float()
    opened, undecided, lz = K.krylov_screen(x, lam1 / 0.999, block=16, max_steps=40, false_shut=1e-12, generator=gen())
    assert undecided.tolist() == [True] * 2 and not opened.any()
    assert lz.steps < 12  # given up early: the certificate could never hold within the margin
    # a small matrix: the space (half the small side) is too small for the certificate → undecided, re-checked
    small = noise_with_spikes(1, 128, 128, [], seed=6)
    _, undecided, _ = K.krylov_screen(
        small,
        torch.full((1,), (1.02 * 2 * math.sqrt(128)) ** 2, dtype=F64, device=DEVICE),
        block=16,
        max_steps=40,
        false_shut=1e-12,
        generator=gen(),
    )
    assert undecided.tolist() == [True]


def test_krylov_steps_needed_matches_the_certificate() -> None:
    """The predicted step count is the first at which the shut certificate holds (same θ₁)."""
    tau2 = torch.tensor([1.0], dtype=F64)
    omega = torch.tensor([600.0], dtype=F64)
    g2 = K.chi2_small_ball(16, 1e-12)
    for top in (0.5, 0.9, 0.96, 0.99):
        need = int(K.krylov_steps_needed(torch.tensor([top], dtype=F64), tau2, omega, g2, 0.0).item())
        a = torch.tensor([top], dtype=F64)

        def holds(steps: int, a: torch.Tensor = a) -> bool:
            x = 2.0 / a - 1.0
            log_rho = omega.log() - math.log(g2) - 2.0 * K._log_chebyshev(steps - 1, x)
            return bool(torch.nn.functional.softplus(log_rho) < (1.0 / a).log())

        assert holds(need) and not holds(need - 1)
    assert math.isinf(K.krylov_steps_needed(torch.tensor([1.0], dtype=F64), tau2, omega, g2, 0.0).item())


# --------------------------------------------------------------------------------------------------
# spikes: every eigenpair above the level


@pytest.mark.parametrize("spikes", [[90.0], [120.0, 110.0, 100.0, 90.0], [60.0] * 3])
def test_eigenpairs_above_equal_eigh_above_the_level(spikes: list[float]) -> None:
    m, n = 240, 320
    x = noise_with_spikes(2, m, n, spikes, seed=7)
    level = torch.full((2,), (math.sqrt(m) + math.sqrt(n)) ** 2, dtype=F64, device=DEVICE)
    theta, vec, fallback = K.eigenpairs_above(x, K.BlockLanczos(x, 8, 10_000, gen()), level, tol=1e-10, max_steps=60)
    w, u = torch.linalg.eigh(x @ x.mT)
    for b in range(2):
        ref = w[b][w[b] > level[b]]
        got = theta[b][theta[b] > 0]
        assert got.numel() == ref.numel()  # exactly the same spike set (marginal bulk eigenvalues included)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
        p_ref = u[b][:, -ref.numel() :] @ u[b][:, -ref.numel() :].mT
        p_got = vec[b][:, -got.numel() :] @ vec[b][:, -got.numel() :].mT
        assert float((p_got - p_ref).norm()) < 1e-8
    assert not fallback.any()


def test_eigenpairs_above_falls_back_to_eigh_at_the_cap() -> None:
    x = noise_with_spikes(2, 64, 90, [60.0, 55.0], seed=8)
    level = torch.full((2,), (8.0 + math.sqrt(90)) ** 2, dtype=F64, device=DEVICE)
    theta, _, fallback = K.eigenpairs_above(x, K.BlockLanczos(x, 4, 8, gen()), level, tol=1e-14, max_steps=2)
    assert fallback.all()
    w = torch.linalg.eigvalsh(x @ x.mT)
    for b in range(2):
        torch.testing.assert_close(theta[b][theta[b] > 0], w[b][w[b] > level[b]], rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------------
# rmt_denoise through the screens


@pytest.mark.parametrize("rel_gap", [1e-3, -1e-3])
def test_krylov_screen_gate_is_exact_near_the_threshold(rel_gap: float) -> None:
    """σ set so that λ~₁ is 0.1 % above / below κ·edge: the Krylov screen (with its exact re-check) decides like
    the full SVD, and the result agrees with it to 1e-10 in float64."""
    g = noise_with_spikes(4, 130, 180, [], seed=21)
    top = torch.linalg.svdvals(g)[:, 0]
    sig = top / ((1 + rel_gap) * 1.02 * (math.sqrt(130) + math.sqrt(180)))
    full = paper_denoise(g, sig, method="full", compute_dtype=F64)
    kry = paper_denoise(g, sig, method="truncated", screen="krylov", compute_dtype=F64)
    assert full.gated.tolist() == [rel_gap > 0] * 4
    assert torch.equal(kry.gated, full.gated)
    assert kry.work is not None
    if rel_gap < 0:  # 0.1 % below: no certificate can say shut within the margin — every one re-checked exactly
        assert kry.work["undecided"] == 4
    err = ((kry.tensor - full.tensor).flatten(1).norm(dim=1) / full.tensor.flatten(1).norm(dim=1)).max()
    assert float(err) < 1e-10


@pytest.mark.parametrize("screen", ["krylov", "cholesky"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_screens_equal_the_full_svd_on_spiked_and_pure_noise(screen: str, dtype: torch.dtype) -> None:
    """Mixed batch (pure noise, weak and strong spikes, transposed shape): the same gates as the SVD, results
    within 1e-8 (float64) / 1e-4 (float32, the Gram path's tolerance; docs/math.md §1.12.6)."""
    s = 0.05
    for m, n in ((160, 224), (224, 160)):
        thr = (m * n) ** 0.25
        g = (
            torch.cat(
                [
                    noise_with_spikes(1, m, n, [], seed=9),
                    noise_with_spikes(1, m, n, [1.5 * thr], seed=10),
                    noise_with_spikes(1, m, n, [3 * thr, 2.5 * thr, 2 * thr, 1.6 * thr], seed=11),
                ]
            )
            * s
        )
        g = g.to(dtype)
        full = paper_denoise(g.double(), s, method="full", compute_dtype=F64)
        got = paper_denoise(g, s, method="truncated", screen=screen)
        assert torch.equal(got.gated, full.gated) and got.gated.tolist() == [False, True, True]
        assert torch.equal(got.tensor[0], g[0])  # shut: bitwise unchanged
        err = ((got.tensor.double() - full.tensor).flatten(1).norm(dim=1) / full.tensor.flatten(1).norm(dim=1)).max()
        assert float(err) < (1e-8 if dtype == F64 else 1e-4), float(err)


def test_inplace_projection_writes_into_the_input_and_keeps_residual_options() -> None:
    """All gated and in place: the result lands in the caller's memory; residual/norm options as the SVD path."""
    s = 0.1
    g = noise_with_spikes(2, 100, 140, [4 * (100 * 140) ** 0.25], seed=12) * s
    for kw in ({}, {"residual": 0.5}, {"residual": "james_stein"}, {"norm_correction": "clean_estimate"}):
        ref = paper_denoise(g, s, method="full", compute_dtype=F64, **kw).tensor  # type: ignore[arg-type]
        buf = g.clone()
        ptr = buf.data_ptr()
        res = paper_denoise(buf, s, method="truncated", compute_dtype=F64, inplace=True, **kw)  # type: ignore[arg-type]
        assert res.tensor.data_ptr() == ptr and torch.equal(buf, res.tensor)
        assert float((buf - ref).norm() / ref.norm()) < 1e-8
