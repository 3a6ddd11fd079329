"""Banded matrix-factorization noise (BandMF, DP-FTRL), the pure mathematics (``docs/mechanisms.md``).

A lower-triangular T × T strategy matrix M; the noisy gradient released at step t is g_t + σC·(M⁻¹z)_t with z i.i.d.
N(0, I) per coordinate, so the noise of the running sum of updates largely cancels (DP-SGD is M = I). Here M is
banded Toeplitz with b bands, M[t, t−j] = c_j for 0 ≤ j < b (Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization", arXiv 2306.08153). Its inverse is streamed: x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j}) / c_0 (their
Algorithm 9), keeping b − 1 previous outputs.

* κ = the largest column norm of M = ‖c‖₂ (every full column holds c_0 … c_{b−1}); coefficients are normalized to
  κ = 1, so the privacy of a run with cyclic Poisson sampling is exactly DP-SGD's with the same noise multiplier,
  ⌈T/b⌉ steps and rate b·B/N (their Theorems 4–5; ``accounting`` in :mod:`.bandmf`).
* The coefficients minimize the workload's error ‖A M⁻¹‖²_F at κ = 1 (A: SGD's prefix sums, or the map from gradients
  to parameter updates under momentum and a learning-rate schedule), in float64, from the square-root factorization
  of the prefix sum (c_j = binom(2j, j)/4^j, Henzinger et al.) by L-BFGS; cached per (T, b, workload).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "column_norms",
    "inverse_matrix",
    "minsep_sensitivity",
    "normalized",
    "optimal_coefficients",
    "sqrt_factorization",
    "strategy_matrix",
    "workload",
    "workload_error",
]

MAX_STEPS = 4096  #: T beyond this: the dense T × T optimization would need too much memory (refused)


def strategy_matrix(coefficients: Sequence[float] | torch.Tensor, steps: int) -> torch.Tensor:
    """The T × T banded lower-triangular Toeplitz M with M[t, t−j] = c_j (float64)."""
    c = torch.as_tensor(coefficients, dtype=torch.float64)
    m = torch.zeros(steps, steps, dtype=torch.float64)
    for j in range(min(len(c), steps)):
        m = m + torch.diag(c[j].expand(steps - j), -j)
    return m


def inverse_matrix(coefficients: Sequence[float] | torch.Tensor, steps: int) -> torch.Tensor:
    """M⁻¹ (lower-triangular Toeplitz, float64): the map from i.i.d. noise z to the released noise x."""
    eye = torch.eye(steps, dtype=torch.float64)
    return torch.linalg.solve_triangular(strategy_matrix(coefficients, steps), eye, upper=False)


def column_norms(coefficients: Sequence[float] | torch.Tensor, steps: int) -> torch.Tensor:
    """The L2 norm of each column of M (the last b − 1 are truncated)."""
    return strategy_matrix(coefficients, steps).norm(dim=0)


def normalized(coefficients: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The coefficients scaled to κ = ‖c‖₂ = 1 with c_0 > 0."""
    c = torch.as_tensor(coefficients, dtype=torch.float64)
    if c.numel() == 0 or not bool(torch.isfinite(c).all()) or float(c[0]) == 0:
        raise ValueError(f"BandMF coefficients need c_0 != 0 and finite values, got {c.tolist()}")
    return c * (math.copysign(1.0, float(c[0])) / float(c.norm()))


def workload(steps: int, momentum: float = 0.0, learning_rates: Sequence[float] | None = None) -> torch.Tensor:
    """A[t, s]: how much gradient s moves the parameters after step t — Σ_{u=s}^{t} η_u β^{u−s} (SGD with momentum β
    and learning rates η; β = 0 and η = 1: the prefix sums)."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    eta = torch.ones(steps, dtype=torch.float64) if learning_rates is None else torch.as_tensor(learning_rates)
    if eta.shape != (steps,) or not bool(torch.isfinite(eta).all()):
        raise ValueError(f"learning_rates must be {steps} finite numbers, one per step")
    u, s = torch.meshgrid(torch.arange(steps), torch.arange(steps), indexing="ij")
    decay = torch.where(u >= s, torch.tensor(momentum, dtype=torch.float64) ** (u - s).clamp(min=0), 0.0)
    return torch.cumsum(eta.double().unsqueeze(1) * decay, dim=0)  # row t sums u = s..t


def workload_error(coefficients: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """‖A M⁻¹‖²_F · κ² — the total squared noise of the workload at noise multiplier 1 (differentiable). A may be
    any rows × T (e.g. its last row only)."""
    steps = work.shape[1]
    m = strategy_matrix(coefficients, steps)
    solved = torch.linalg.solve_triangular(m, work, upper=False, left=False)  # A M⁻¹
    return (coefficients**2).sum() * (solved**2).sum()


def sqrt_factorization(bands: int) -> torch.Tensor:
    """c_j = binom(2j, j) / 4^j: the first b coefficients of (1 − x)^(−1/2), the square root of the prefix sum."""
    return torch.tensor([math.comb(2 * j, j) / 4**j for j in range(bands)], dtype=torch.float64)


def optimal_coefficients(
    steps: int, bands: int, momentum: float = 0.0, learning_rates: Sequence[float] | None = None
) -> tuple[float, ...]:
    """The b coefficients (κ = 1, c_0 > 0) minimizing the workload's error for a run of ``steps`` steps."""
    if not (isinstance(bands, int) and bands >= 1):
        raise ValueError(f"bands must be an integer >= 1, got {bands!r}")
    if not (isinstance(steps, int) and bands <= steps <= MAX_STEPS):
        raise ValueError(f"steps must be an integer in [bands, {MAX_STEPS}], got {steps!r} (bands={bands})")
    lrs = None if learning_rates is None else tuple(float(x) for x in learning_rates)
    return _optimize(steps, bands, float(momentum), lrs)


@functools.lru_cache(maxsize=64)
def _optimize(steps: int, bands: int, momentum: float, lrs: tuple[float, ...] | None) -> tuple[float, ...]:
    """L-BFGS from the square-root factorization; a run whose M⁻¹ overflows (L-BFGS stepped to a strategy with an
    unstable inverse, e.g. c_1 > c_0 at b = 2 over long runs) is retried with 10× smaller steps. Never worse than
    the start, never non-finite."""
    if bands == 1:
        return (1.0,)
    work, start = workload(steps, momentum, lrs), normalized(sqrt_factorization(bands))
    best, best_error = start, float(workload_error(start, work))
    for lr in (1.0, 0.1, 0.01):
        try:
            found = _lbfgs(start, work, lr)
        except _Diverged:
            continue
        error = float(workload_error(found, work))
        if math.isfinite(error) and error < best_error:
            best, best_error = found, error
        break
    return tuple(float(x) for x in best)


class _Diverged(ArithmeticError):
    """The workload error stopped being finite during L-BFGS."""


def _lbfgs(start: torch.Tensor, work: torch.Tensor, lr: float) -> torch.Tensor:
    """Minimize κ²‖A M⁻¹‖²_F over the coefficients from ``start`` (scale-invariant); normalized result."""
    c = start.clone().requires_grad_()
    opt = torch.optim.LBFGS([c], lr=lr, max_iter=300, tolerance_grad=1e-12, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = workload_error(c, work)  # invariant to the scale of c: κ² ‖A M⁻¹‖²
        if not torch.isfinite(loss):
            raise _Diverged
        loss.backward()
        return loss

    opt.step(closure)
    return normalized(c.detach())


def minsep_sensitivity(coefficients: Sequence[float] | torch.Tensor, steps: int, separation: int) -> float:
    """The largest ‖M u‖₂ over participation patterns u ∈ {0,1}^T whose ones are ≥ ``separation`` steps apart,
    by brute force over every pattern (a test oracle: exponential in T/separation)."""
    m = strategy_matrix(coefficients, steps)
    best = 0.0

    def walk(start: int, picked: list[int]) -> None:
        nonlocal best
        if picked:
            best = max(best, float(m[:, picked].sum(dim=1).norm()))
        for t in range(start, steps):
            walk(t + separation, [*picked, t])

    walk(0, [])
    return best
