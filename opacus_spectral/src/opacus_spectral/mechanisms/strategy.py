"""What a noise mechanism contributes, and what the engine computes from it (``docs/mechanisms.md``).

A mechanism is a *strategy* the engine can realize and account itself: a b-banded lower-triangular Toeplitz M with
M[t, t−j] = c_j (j < b). The engine draws z from its own generator, releases x_t = (M⁻¹z)_t by the stream
x_t = (z_t − Σ_{j≥1} c_j x_{t−j}) / c_0 (Algorithm 9 of arXiv 2306.08153), samples group t mod b by cyclic Poisson
sampling, and charges, from c alone:

* κ = the largest column norm of M = ‖c‖₂ (with b ≤ T every column is c or a prefix of it);
* DP-SGD with noise multiplier σ/κ at rate b·q, once every b steps (amplified BandMF, their Thm 1 and 4–5: columns
  b or more apart are orthogonal, so each group's ⌈T/b⌉ participations compose as DP-SGD's).

b = 1, c = (1,) is DP-SGD. Refused: non-finite coefficients, c_0 ≤ 0, and an inverse recurrence that is not stable
(a root of c(z) = Σ c_j z^j in the closed unit disk: the released noise would grow without bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.signal import lfilter

__all__ = ["Accounting", "BandedToeplitz", "RowNorms", "STABILITY_MARGIN"]

#: a root of c(z) with modulus at most 1 + this is refused (the roots are computed in float64)
STABILITY_MARGIN = 1e-9


@dataclass(frozen=True)
class Accounting:
    """DP-SGD's privacy with noise multiplier σ′ at sample rate q′, one accountant step every ``every`` DP steps (so
    ⌈T/every⌉ in all): what the engine charges, computed from a strategy (:meth:`BandedToeplitz.accounting`)."""

    noise_multiplier: float
    sample_rate: float
    every: int = 1

    def __post_init__(self) -> None:
        ok = (
            math.isfinite(self.noise_multiplier)
            and self.noise_multiplier >= 0
            and 0 < self.sample_rate <= 1
            and isinstance(self.every, int)
            and self.every >= 1
        )
        if not ok:
            raise ValueError(f"an accounting needs σ′ >= 0, a rate in (0, 1] and every >= 1, got {self}")

    def charge(self, step: int) -> int:
        """Accountant steps DP step ``step`` (0-based) adds: 1 at every ``every``-th step from the first, else 0."""
        return 1 if step % self.every == 0 else 0


@dataclass(frozen=True)
class BandedToeplitz:
    """A b-banded lower-triangular Toeplitz strategy M, M[t, t−j] = c_j; ``workload``: what the coefficients were
    optimized for (public, saved in the privacy record; informational)."""

    coefficients: tuple[float, ...]
    workload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = tuple(float(x) for x in self.coefficients)
        object.__setattr__(self, "coefficients", c)
        object.__setattr__(self, "workload", dict(self.workload))
        if not c or not all(math.isfinite(x) for x in c) or c[0] <= 0:
            raise ValueError(f"a banded Toeplitz strategy needs finite coefficients with c_0 > 0, got {c}")
        root = smallest_root(c)
        if root <= 1 + STABILITY_MARGIN:
            raise ValueError(
                f"the strategy's inverse recurrence x_t = (z_t − Σ c_j x_(t−j)) / c_0 is not stable for coefficients "
                f"{c}: c(z) = Σ c_j z^j has a root of modulus {root:.6g} <= 1, so the released noise grows without "
                "bound (every root must lie outside the closed unit disk)"
            )

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def kappa(self) -> float:
        """M's largest column norm, ‖c‖₂ (a column cut by the end of the run is a prefix of c); within 1e-12 of 1
        it is 1 (the float64 rounding of a normalization)."""
        kappa = math.sqrt(math.fsum(x * x for x in self.coefficients))
        return 1.0 if math.isclose(kappa, 1.0, rel_tol=1e-12, abs_tol=0.0) else kappa

    @property
    def correlated(self) -> bool:
        """Whether M is not diagonal (noise correlated across steps)."""
        return any(x != 0 for x in self.coefficients[1:])

    def accounting(self, noise_multiplier: float, sample_rate: float) -> Accounting:
        """Amplified BandMF: DP-SGD with σ/κ at rate b·q, charged once every b steps (b = 1: DP-SGD)."""
        return Accounting(float(noise_multiplier) / self.kappa, float(self.bands * sample_rate), self.bands)

    def impulse_response(self, steps: int) -> np.ndarray:
        """d_0 … d_{T−1}: the first column of M⁻¹ (:func:`impulse_response`)."""
        return impulse_response(self.coefficients, steps)

    def row_norms(self, steps: int) -> np.ndarray:
        """‖row_t(M⁻¹)‖₂ for t < T: √(Σ_{k≤t} d_k²) — the per-entry std of the released noise at step t in units of
        σC, O(T·b) time and O(T) memory (no T × T matrix)."""
        return np.sqrt(np.cumsum(self.impulse_response(steps) ** 2))


class RowNorms:
    """‖row_t(M⁻¹)‖ of a strategy for any step t, computed ahead (doubling) as a run goes past what was asked."""

    def __init__(self, strategy: BandedToeplitz, steps: int = 64) -> None:
        self.strategy = strategy
        self._norms = strategy.row_norms(max(1, steps))

    def __call__(self, t: int) -> float:
        if t >= len(self._norms):
            self._norms = self.strategy.row_norms(max(2 * len(self._norms), t + 1))
        return float(self._norms[t])


def impulse_response(coefficients: Sequence[float] | np.ndarray, steps: int) -> np.ndarray:
    """d_0 … d_{T−1}: the first column of M⁻¹ (lower-triangular Toeplitz), the response of 1/c(z), O(T·b)."""
    impulse = np.zeros(int(steps))
    impulse[:1] = 1.0
    return lfilter([1.0], np.asarray(coefficients, dtype=np.float64), impulse)


def smallest_root(coefficients: Sequence[float]) -> float:
    """The smallest modulus of a root of c(z) = Σ c_j z^j (∞ for a constant polynomial)."""
    roots = np.roots(np.asarray(coefficients, dtype=np.float64)[::-1])
    return float(np.abs(roots).min()) if roots.size else math.inf
