"""``noise_mechanism=("bandmf", {"bands": b})``: banded matrix-factorization noise (``docs/mechanisms.md``; the
mathematics: :mod:`.bandmf_math`). Its strategy is b coefficients optimized for the run's length at κ = 1, or the
ones the caller gives (the engine computes their κ and refuses unstable ones, :class:`~.strategy.BandedToeplitz`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .bandmf_math import optimal_coefficients
from .base import NoiseMechanism
from .strategy import BandedToeplitz

__all__ = ["BandMFMechanism"]


class BandMFMechanism(NoiseMechanism):
    """BandMF with ``bands`` bands: coefficients optimized for the run's length, or ``coefficients`` as given."""

    name = "bandmf"

    def __init__(self, bands: int = 4, coefficients: Sequence[float] | None = None) -> None:
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"bandmf: bands must be an integer >= 1, got {bands!r}")
        self.bands = bands
        self._given = None if coefficients is None else BandedToeplitz(tuple(coefficients))
        if self._given is not None and self._given.bands != bands:
            raise ValueError(f"bandmf: {self._given.bands} coefficients for {bands} bands")

    def strategy(self, *, steps: int | None, sample_rate: float, dataset_size: int) -> BandedToeplitz:
        if self._given is not None:
            return self._given
        if steps is None:
            raise ValueError(
                "noise_mechanism='bandmf' needs the run's length: pass steps= (or epochs=) to make_private; the "
                "coefficients are optimized for it"
            )
        if self.bands > steps:
            raise ValueError(f"bandmf: bands={self.bands} exceeds the run's {steps} steps (b <= T)")
        coefficients = optimal_coefficients(int(steps), self.bands)
        return BandedToeplitz(coefficients, {"objective": "prefix_sum", "steps": int(steps)})

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bands": self.bands}
