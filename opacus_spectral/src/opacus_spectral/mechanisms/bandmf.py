"""``noise_mechanism=("bandmf", {"bands": b})``: banded matrix-factorization noise with cyclic Poisson sampling and
exact amplified accounting (``docs/mechanisms.md``; the mathematics: :mod:`.bandmf_math`, the stream: :mod:`.stream`).

With the records split once into b fixed groups and step t Poisson-sampling group t mod b at rate p = b·B/N, a run
of T steps has exactly the privacy of DP-SGD with noise multiplier σ/κ (κ: M's largest column norm, 1 for the
optimized coefficients), ⌈T/b⌉ steps and rate p (Choquette-Choo et al., arXiv 2306.08153, Thm 1 and 4–5):
:class:`~.base.Accounting` ``(σ/κ, p, every=b)``. b = 1 is DP-SGD, bit for bit with the same ``noise_seed``. Refused:
b > T, p = b·B/N > 1, coefficients that are not finite or have c_0 <= 0.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .bandmf_math import inverse_matrix, optimal_coefficients
from .base import Accounting, NoiseMechanism
from .stream import BandStream

__all__ = ["BandMFMechanism"]


class BandMFMechanism(NoiseMechanism):
    """BandMF with ``bands`` bands; its coefficients are optimized for the run's length (and workload) at setup."""

    name = "bandmf"
    sampler = "cyclic_poisson"

    def __init__(self, bands: int = 4, coefficients: Sequence[float] | None = None) -> None:
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"bandmf: bands must be an integer >= 1, got {bands!r}")
        self.bands = bands
        self._given = None if coefficients is None else tuple(float(c) for c in coefficients)
        if self._given is not None and len(self._given) != bands:
            raise ValueError(f"bandmf: {len(self._given)} coefficients for {bands} bands")
        self.coefficients: tuple[float, ...] | None = None
        #: M's largest column norm ‖c‖₂: the given coefficients', else 1 (the optimized ones are normalized)
        self.kappa = 1.0 if self._given is None else _kappa(self._given)
        self.steps: int | None = None
        self._stream: BandStream | None = None
        self._row_norms: torch.Tensor | None = None
        self._t = 0  # the stream's step (0 after a reset: a resumed run's fresh stream)

    @property
    def correlated(self) -> bool:  # type: ignore[override]
        return self.bands > 1

    @property
    def sample_rate_factor(self) -> int:
        return self.bands

    def setup(self, *, steps: int | None, sample_rate: float, dataset_size: int, **workload: Any) -> None:
        if steps is None:
            raise ValueError(
                "noise_mechanism='bandmf' needs the run's length: pass steps= (or epochs=) to make_private; the "
                "coefficients are optimized for it"
            )
        if self.bands > steps:
            raise ValueError(f"bandmf: bands={self.bands} exceeds the run's {steps} steps (b <= T)")
        if self.bands * sample_rate > 1:
            raise ValueError(
                f"bandmf: the rate within a group, bands × B/N = {self.bands} × {sample_rate:.4g}, exceeds 1: use at "
                f"most {int(1 / sample_rate)} bands, or a smaller batch"
            )
        self.steps = int(steps)
        coefs = self._given or optimal_coefficients(self.steps, self.bands, **workload)
        if self._given is None and _kappa(coefs) != 1.0:
            raise AssertionError(f"bandmf: coefficients not normalized (kappa {_kappa(coefs)})")
        self.coefficients = tuple(coefs)
        self._stream = BandStream(self.coefficients)
        self._row_norms = inverse_matrix(self.coefficients, self.steps).norm(dim=1)

    def accounting(self, noise_multiplier: float, sample_rate: float) -> Accounting:
        """DP-SGD with σ/κ, rate b·q, one step every b (κ = 1 for the optimized coefficients)."""
        return Accounting(float(noise_multiplier) / self.kappa, float(self.bands * sample_rate), self.bands)

    def noise(self, key: Hashable, z: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            raise RuntimeError("bandmf: setup() was not called (make_private does it)")
        return self._stream.advance(key, z)

    def std_factor(self) -> float:
        """‖row_t(M⁻¹)‖ at the stream's current step (1/c_0 at its first)."""
        if self._row_norms is None or self.bands == 1:
            return 1.0
        return float(self._row_norms[min(self._t, len(self._row_norms) - 1)])

    def end_step(self) -> None:
        self._t += 1

    def buffer_bytes(self) -> int:
        """Memory the noise stream holds now: (b − 1) × the trainable tensors' bytes once every tensor has been
        through b − 1 steps (``docs/mechanisms.md``, "Cost")."""
        return 0 if self._stream is None else self._stream.memory_bytes()

    def reset(self) -> None:
        self._t = 0
        if self._stream is not None:
            self._stream.reset()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bands": self.bands, "steps": self.steps}


def _kappa(coefficients: Sequence[float]) -> float:
    """κ, the largest column norm of the b-banded Toeplitz M: ‖c‖₂ (a column cut by the end of the run is a prefix
    of c). Within 1e-12 of 1 it is 1 (the float64 rounding of a normalization). Refused: a coefficient that is not
    finite, or c_0 <= 0 (M would not be invertible by the stream)."""
    if not all(math.isfinite(c) for c in coefficients) or coefficients[0] <= 0:
        raise ValueError(f"bandmf: the coefficients must be finite with c_0 > 0, got {tuple(coefficients)}")
    kappa = math.sqrt(math.fsum(c * c for c in coefficients))
    return 1.0 if math.isclose(kappa, 1.0, rel_tol=1e-12, abs_tol=0.0) else kappa
