"""The mathematics of banded matrix-factorization noise (opacus_spectral.mechanisms.bandmf_math / stream): the
released noise has covariance M⁻¹M⁻ᵀ, b = 1 is DP-SGD, the sensitivity formula against brute force over every
b-separated participation pattern, κ = 1 after normalization, and the optimized coefficients' workload error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from opacus_spectral.mechanisms import bandmf_math
from opacus_spectral.mechanisms.bandmf_math import (
    column_norms,
    inverse_matrix,
    minsep_sensitivity,
    normalized,
    optimal_coefficients,
    sqrt_factorization,
    strategy_matrix,
    toeplitz_error,
    workload,
    workload_error,
)
from opacus_spectral.mechanisms.stream import BandStream


def test_one_band_is_dp_sgd_bit_for_bit():
    assert optimal_coefficients(10, 1) == (1.0,)
    z = torch.randn(5, 3)
    assert BandStream((1.0,)).advance("w", z) is z


@pytest.mark.parametrize("bands", [2, 3])
def test_the_released_noise_has_covariance_m_inverse_m_inverse_transposed(bands):
    """Zero gradients, 40,000 coordinates, 8 steps: the empirical cross-step covariance of the stream's output equals
    M⁻¹M⁻ᵀ within 0.03 (the std of each entry's estimate is ~ 1/√40000 · (1 + |Σ|) ≈ 0.005-0.01)."""
    steps, coords = 8, 40_000
    c = optimal_coefficients(steps, bands)
    stream = BandStream(c)
    g = torch.Generator().manual_seed(0)
    xs = torch.stack([stream.advance("p", torch.randn(coords, generator=g, dtype=torch.float64)) for _ in range(steps)])
    empirical = xs @ xs.T / coords
    inv = inverse_matrix(c, steps)
    torch.testing.assert_close(empirical, inv @ inv.T, atol=0.03, rtol=0)
    assert float((inv @ inv.T - torch.eye(steps, dtype=torch.float64)).abs().max()) > 0.1  # really correlated


@pytest.mark.parametrize("bands", [2, 4, 8])
def test_the_stream_is_m_inverse_times_z_over_many_wraps_of_its_buffers(bands):
    """40 steps (the ring of b − 1 buffers wraps many times): x = M⁻¹z to float64 rounding, per coordinate."""
    steps = 40
    c = optimal_coefficients(steps, bands)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(steps, 3, 5, generator=g, dtype=torch.float64)
    stream = BandStream(c)
    x = torch.stack([stream.advance("w", z[t]) for t in range(steps)])
    assert x.shape == z.shape
    torch.testing.assert_close(
        x.reshape(steps, -1), inverse_matrix(c, steps) @ z.reshape(steps, -1), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize(("steps", "bands"), [(9, 3), (12, 4), (10, 2)])
def test_minsep_sensitivity_is_the_column_sum_at_every_bth_step(steps, bands):
    """Brute force over every pattern whose participations are ≥ b apart: the worst is participation at 0, b, 2b, …
    (non-negative, non-increasing coefficients; arXiv 2405.13763 Thm 2), and for b-banded M it is κ·√⌈T/b⌉ = √⌈T/b⌉
    (columns b apart are orthogonal)."""
    c = torch.tensor(optimal_coefficients(steps, bands), dtype=torch.float64)
    assert bool((c >= 0).all()) and bool((c[:-1] >= c[1:]).all())
    m = strategy_matrix(c, steps)
    formula = float(m[:, list(range(0, steps, bands))].sum(dim=1).norm())
    assert minsep_sensitivity(c, steps, bands) == pytest.approx(formula, rel=1e-12)
    assert formula == pytest.approx(math.sqrt(math.ceil(steps / bands)), rel=1e-9)


def test_normalized_coefficients_have_unit_largest_column_norm():
    for bands in (1, 3, 8):
        c = optimal_coefficients(32, bands)
        assert float(column_norms(c, 32).max()) == pytest.approx(1.0, abs=1e-12)
        assert c[0] > 0
    with pytest.raises(ValueError, match="c_0"):
        normalized([0.0, 1.0])


def test_more_bands_lower_the_prefix_sum_error_and_the_optimum_beats_its_start():
    """Prefix sums over 64 steps (noise multiplier 1, unamplified): the RMSE ratio to DP-SGD falls with b."""
    work = workload(64)
    base = float(workload_error(torch.tensor([1.0], dtype=torch.float64), work))
    ratios = []
    for bands in (1, 2, 4, 8):
        c = torch.tensor(optimal_coefficients(64, bands), dtype=torch.float64)
        err = float(workload_error(c, work))
        assert err <= float(workload_error(normalized(sqrt_factorization(bands)), work)) * (1 + 1e-9)
        ratios.append(math.sqrt(err / base))
    assert ratios[0] == pytest.approx(1.0) and ratios == sorted(ratios, reverse=True) and ratios[-1] < 0.6


def test_the_workload_of_momentum_and_learning_rates():
    assert torch.equal(workload(4), torch.tril(torch.ones(4, 4, dtype=torch.float64)))
    a = workload(4, momentum=0.5, learning_rates=[1.0, 2.0, 1.0, 1.0])
    # gradient 0 after step 2: η_0 + η_1 β + η_2 β² = 1 + 2·0.5 + 0.25
    assert float(a[2, 0]) == pytest.approx(2.25) and float(a[0, 1]) == 0.0
    with pytest.raises(ValueError, match="momentum"):
        workload(4, momentum=1.0)
    with pytest.raises(ValueError, match="steps must be"):
        optimal_coefficients(2, 3)


def test_two_bands_over_a_long_run_converge_instead_of_overflowing():
    """At b = 2 the optimum's c_1/c_0 nears 1 as T grows; full L-BFGS steps crossed it, where M⁻¹ overflows (before:
    NaN coefficients at T = 600, all zeros at T = 1611). Now a finite, normalized optimum that beats its start."""
    steps = 600
    c = optimal_coefficients(steps, 2)
    work = workload(steps)
    assert math.isfinite(c[0]) and c[0] > 0 and math.isclose(math.hypot(*c), 1.0, rel_tol=1e-12)
    assert 0.8 < c[1] / c[0] < 1
    start = workload_error(normalized(sqrt_factorization(2)), work)
    assert float(workload_error(torch.tensor(c, dtype=torch.float64), work)) < 0.95 * float(start)


@pytest.mark.parametrize("steps", [50, 300])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_structured_error_and_its_gradient_are_the_dense_ones(steps, momentum):
    """Issue 50: κ²‖A M⁻¹‖²_F in O(T·b) (Σ_k (T − k)·e_k²) and its analytic gradient equal the dense T × T
    computation and autograd's gradient of it, at random stable coefficients of 2, 5 and 16 bands."""
    gen = torch.Generator().manual_seed(steps)
    for bands in (2, 5, 16):
        c = normalized(sqrt_factorization(bands) * (1 + 0.1 * torch.rand(bands, generator=gen, dtype=torch.float64)))
        dense_c = c.clone().requires_grad_()
        dense = workload_error(dense_c, workload(steps, momentum))
        dense.backward()
        value, grad = toeplitz_error(c.numpy(), steps, momentum)
        assert value == pytest.approx(float(dense.detach()), rel=1e-12)
        torch.testing.assert_close(torch.from_numpy(grad), dense_c.grad, rtol=1e-10, atol=0)


@pytest.mark.parametrize(
    ("steps", "momentum"), [(100, 0.0), (100, 0.9), pytest.param(600, 0.0, marks=pytest.mark.slow)]
)
def test_the_structured_optimum_is_the_dense_optimum(steps, momentum):
    """Issue 50: the O(T·b) optimizer reaches the dense T × T L-BFGS optimum (the optimizer before it, kept for
    learning-rate schedules) within 1e-6 relative objective."""
    work = workload(steps, momentum)
    for bands in (2, 4, 16):
        dense = bandmf_math._optimize_dense(steps, bands, momentum, (1.0,) * steps)
        ours = optimal_coefficients(steps, bands, momentum)
        error = [float(workload_error(torch.tensor(c, dtype=torch.float64), work)) for c in (ours, dense)]
        assert error[0] <= error[1] * (1 + 1e-6), (bands, error)


def test_a_long_horizon_is_optimized_without_any_dense_matrix():
    """T = 100,000 at b = 64 (the cap was 4,096): finite, unit-norm, stable coefficients below the start's error."""
    c = optimal_coefficients(100_000, 64)
    start = normalized(sqrt_factorization(64)).numpy()
    assert math.isclose(math.fsum(x * x for x in c), 1.0, rel_tol=1e-12) and c[0] > 0
    assert toeplitz_error(c, 100_000)[0] < 0.99 * toeplitz_error(start, 100_000)[0]
    from opacus_spectral.mechanisms.strategy import BandedToeplitz

    BandedToeplitz(c)  # stable (refused otherwise)
    steps = bandmf_math.MAX_DENSE_STEPS + 1
    with pytest.raises(ValueError, match="schedule makes the workload dense"):
        optimal_coefficients(steps, 4, learning_rates=([1.0, 0.5] * steps)[:steps])
    for bad in ([1.0] * (steps + 1), [float("nan")] * steps):  # one rate per step, each finite
        with pytest.raises(ValueError, match="finite numbers, one per step"):
            optimal_coefficients(steps, 4, learning_rates=bad)


def test_optimized_coefficients_are_kept_on_disk_and_a_bad_cache_file_is_recomputed(tmp_path, monkeypatch):
    """Issue 50: coefficients are public, so a second run (another process) reads them from the cache; a file that
    is not b stable unit-norm coefficients is ignored and rewritten; ``off`` keeps nothing."""
    from opacus_spectral.mechanisms import bandmf

    monkeypatch.setenv("OPACUS_SPECTRAL_CACHE", str(tmp_path))
    bandmf.prefix_sum_coefficients.cache_clear()
    first = bandmf.prefix_sum_coefficients(200, 4)
    (path,) = tmp_path.glob("bandmf-*-T200-b4.json")
    bandmf.prefix_sum_coefficients.cache_clear()  # a new process: only the disk remembers
    monkeypatch.setattr(bandmf, "optimal_coefficients", lambda *a, **k: pytest.fail("recomputed a cached optimum"))
    assert bandmf.prefix_sum_coefficients(200, 4) == first
    monkeypatch.undo()
    monkeypatch.setenv("OPACUS_SPECTRAL_CACHE", str(tmp_path))
    for bad in ("[0.6, 0.8, 0.0, 0.0]", "[1.0]", "not json", "[NaN, 0, 0, 0]"):  # unstable, short, junk, NaN
        path.write_text(bad)
        bandmf.prefix_sum_coefficients.cache_clear()
        assert bandmf.prefix_sum_coefficients(200, 4) == first and json.loads(path.read_text()) == list(first)
    monkeypatch.setenv("OPACUS_SPECTRAL_CACHE", "off")
    bandmf.prefix_sum_coefficients.cache_clear()
    assert bandmf.prefix_sum_coefficients(201, 4) and not list(tmp_path.glob("*T201*"))
