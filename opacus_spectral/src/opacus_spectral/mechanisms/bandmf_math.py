"""Banded matrix-factorization noise (BandMF, DP-FTRL), the pure mathematics (``docs/mechanisms.md``).

A lower-triangular T × T strategy matrix M; the noisy gradient released at step t is g_t + σC·(M⁻¹z)_t with z i.i.d.
N(0, I) per coordinate, so the noise of the running sum of updates largely cancels (DP-SGD is M = I). Here M is
banded Toeplitz with b bands, M[t, t−j] = c_j for 0 ≤ j < b (Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization", arXiv 2306.08153). Its inverse is streamed: x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j}) / c_0 (their
Algorithm 9), keeping b − 1 previous outputs.

* κ = the largest column norm of M = ‖c‖₂ (every full column holds c_0 … c_{b−1}); coefficients are normalized to
  κ = 1, so the privacy of a run with cyclic Poisson sampling is exactly DP-SGD's with the same noise multiplier,
  ⌈T/b⌉ steps and rate b·B/N (their Theorems 4–5; ``accounting`` in :mod:`.bandmf`).
* The coefficients minimize the workload's error κ²‖A M⁻¹‖²_F (A: SGD's prefix sums, optionally under momentum β),
  from the square-root factorization of the prefix sum (c_j = binom(2j, j)/4^j, Henzinger et al.) by L-BFGS, in
  O(T·b) time and O(T) memory (:func:`toeplitz_error`): M⁻¹ is the lower-triangular Toeplitz matrix of the impulse
  response d of 1/c(z), and so is A M⁻¹, with first column e = cumsum(d filtered by 1/(1 − βz)); hence
  ‖A M⁻¹‖²_F = Σ_k (T − k)·e_k². A learning-rate schedule η makes A M⁻¹ non-Toeplitz: that workload is optimized
  densely (T ≤ :data:`MAX_DENSE_STEPS`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.signal import lfilter

from .strategy import STABILITY_MARGIN, impulse_response, smallest_root

__all__ = [
    "column_norms",
    "error_column",
    "inverse_matrix",
    "minsep_sensitivity",
    "normalized",
    "optimal_coefficients",
    "sqrt_factorization",
    "strategy_matrix",
    "toeplitz_error",
    "workload",
    "workload_error",
]

#: T beyond this with a learning-rate schedule: the dense T × T optimization would need too much memory (refused)
MAX_DENSE_STEPS = 4096


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


def toeplitz_error(
    coefficients: Sequence[float] | np.ndarray, steps: int, momentum: float = 0.0
) -> tuple[float, np.ndarray]:
    """κ²‖A M⁻¹‖²_F = ‖c‖²·Σ_k (T − k)·e_k² and its gradient in c, O(T·b) (A: prefix sums after momentum β; e: the
    first column of A M⁻¹, module docstring). The gradient: ∂d/∂c_j = −z^j·d(z)² (from c(z)·d(z) = 1), so
    ∂F/∂c_j = −Σ_m r_m g_{m−j} with g = d filtered by 1/c(z) and r = ∂F/∂d, back-propagated through the filters."""
    c = np.asarray(coefficients, dtype=np.float64)
    d, e = _columns(c, steps, momentum)
    weights = np.arange(steps, 0, -1, dtype=np.float64)
    error, norm2 = float(weights @ (e * e)), float(c @ c)
    r = np.cumsum((2 * weights * e)[::-1])[::-1]  # ∂F/∂(smoothed)
    if momentum != 0:
        r = lfilter([1.0], [1.0, -momentum], r[::-1])[::-1]  # the momentum filter's adjoint
    g = lfilter([1.0], c, d)
    d_error = -np.array([r[j:] @ g[: steps - j] for j in range(c.size)])
    return norm2 * error, 2 * c * error + norm2 * d_error


def error_column(coefficients: Sequence[float] | np.ndarray, steps: int, momentum: float = 0.0) -> np.ndarray:
    """e: the first column of A M⁻¹ (lower-triangular Toeplitz; A: prefix sums after momentum β), O(T·b). Row t of
    A M⁻¹ is (e_t, …, e_0): the noise of the parameters after step t, at noise multiplier 1, is ‖(e_0 … e_t)‖."""
    return _columns(np.asarray(coefficients, dtype=np.float64), steps, momentum)[1]


def _columns(c: np.ndarray, steps: int, momentum: float) -> tuple[np.ndarray, np.ndarray]:
    """(d, e): M⁻¹'s first column (the impulse response of 1/c(z)) and A M⁻¹'s."""
    d = impulse_response(c, steps)
    smoothed = d if momentum == 0 else lfilter([1.0], [1.0, -momentum], d)
    return d, np.cumsum(smoothed)


def optimal_coefficients(
    steps: int,
    bands: int,
    momentum: float = 0.0,
    learning_rates: Sequence[float] | None = None,
    progress: Callable[[], None] | None = None,
) -> tuple[float, ...]:
    """The b coefficients (κ = 1, c_0 > 0) minimizing the workload's error for a run of ``steps`` steps: O(T·b) per
    iteration for prefix sums under momentum; a learning-rate schedule needs T ≤ :data:`MAX_DENSE_STEPS`.
    ``progress``: called once per optimizer iteration."""
    if not (isinstance(bands, int) and bands >= 1):
        raise ValueError(f"bands must be an integer >= 1, got {bands!r}")
    if not (isinstance(steps, int) and steps >= bands):
        raise ValueError(f"steps must be an integer >= bands, got {steps!r} (bands={bands})")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    lrs = None if learning_rates is None else tuple(float(x) for x in learning_rates)
    if lrs is not None and (len(lrs) != steps or not all(math.isfinite(x) for x in lrs)):
        raise ValueError(f"learning_rates must be {steps} finite numbers, one per step")
    if lrs is not None and len(set(lrs)) > 1:  # a constant rate scales A: the prefix sums' optimum
        if steps > MAX_DENSE_STEPS:
            raise ValueError(
                f"a learning-rate schedule makes the workload dense (T × T): at most {MAX_DENSE_STEPS} steps, got "
                f"{steps}; optimize for the prefix sums (no schedule) instead"
            )
        return _optimize_dense(steps, bands, float(momentum), lrs)
    return _optimize(steps, bands, float(momentum), progress)


#: a non-finite or unstable point: a large log-error L-BFGS backs away from (the error itself is ~ 10¹–10⁴⁰)
_OUTSIDE = 1e6


def _optimize(steps: int, bands: int, momentum: float, progress: Callable[[], None] | None = None) -> tuple[float, ...]:
    """L-BFGS over (c_1 … c_{b−1}) at c_0 = 1 of log κ²‖A M⁻¹‖²_F (:func:`toeplitz_error`) from the square-root
    factorization; a point whose inverse recurrence is unstable scores :data:`_OUTSIDE`. Never worse than the
    start; normalized to κ = 1."""
    if bands == 1:
        return (1.0,)
    start = sqrt_factorization(bands).numpy()

    def log_error(tail: np.ndarray) -> tuple[float, np.ndarray]:
        c = np.concatenate([[1.0], tail])
        if not np.isfinite(c).all() or smallest_root(c) <= 1 + STABILITY_MARGIN:  # the engine would refuse it
            return _OUTSIDE, np.zeros_like(tail)
        value, grad = toeplitz_error(c, steps, momentum)
        if not (math.isfinite(value) and np.isfinite(grad).all() and value > 0):
            return _OUTSIDE, np.zeros_like(tail)
        return math.log(value), grad[1:] / value

    callback = None if progress is None else (lambda _x: progress())
    options = {"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12}
    found = minimize(log_error, start[1:], jac=True, method="L-BFGS-B", options=options, callback=callback)
    best = np.concatenate([[1.0], found.x])
    if not log_error(found.x)[0] < log_error(start[1:])[0]:
        best = start
    return tuple(float(x) for x in best / np.linalg.norm(best))


@functools.lru_cache(maxsize=16)
def _optimize_dense(steps: int, bands: int, momentum: float, lrs: tuple[float, ...]) -> tuple[float, ...]:
    """A learning-rate schedule's workload, dense: L-BFGS from the square-root factorization; a run whose M⁻¹
    overflows is retried with 10× smaller steps. Never worse than the start, never non-finite."""
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
