"""Noise mechanisms: what ``make_private(..., noise_mechanism=...)`` adds to the clipped sum, how the records are
sampled for it, and how its privacy is accounted (``docs/mechanisms.md``).

A mechanism transforms the i.i.d. Gaussian draw z ~ N(0, (σC)²) that Opacus makes for each tensor at each step
(:meth:`NoiseMechanism.noise`), declares its sampler (``"poisson"`` or ``"cyclic_poisson"``), the per-entry std of
the noise it releases at the current step relative to σC (:meth:`NoiseMechanism.std_factor`, what the denoisers are
calibrated with), and its accounting as the one exact form the library computes (:class:`Accounting`: DP-SGD with noise
multiplier σ′ and sample rate q′, charged once every ``every`` DP steps). A mechanism never supplies a free-form ε.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SAMPLERS", "Accounting", "GaussianMechanism", "NoiseMechanism"]

SAMPLERS = ("poisson", "cyclic_poisson")


@dataclass(frozen=True)
class Accounting:
    """DP-SGD's privacy with noise multiplier σ′ at sample rate q′, one accountant step every ``every`` DP steps (so
    ⌈T/every⌉ in all): the one accounting a mechanism may declare."""

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
            raise ValueError(
                f"a mechanism's accounting needs a noise multiplier >= 0, a sample rate in (0, 1] and every >= 1, "
                f"got {self}"
            )

    def charge(self, step: int) -> int:
        """Accountant steps DP step ``step`` (0-based) adds: 1 at every ``every``-th step from the first, else 0."""
        return 1 if step % self.every == 0 else 0


class NoiseMechanism:
    """The base: i.i.d. Gaussian noise, Poisson sampling, DP-SGD's accounting (subclasses change what they need)."""

    name = "gaussian"
    sampler = "poisson"
    #: whether the noise is correlated across steps (denoisers that assume independent noise refuse it)
    correlated = False

    def setup(self, *, steps: int | None, sample_rate: float, dataset_size: int, **workload: Any) -> None:
        """Called by ``make_private`` once the run's length and the loader's rate are known."""

    def accounting(self, noise_multiplier: float, sample_rate: float) -> Accounting:
        return Accounting(float(noise_multiplier), float(sample_rate), 1)

    def noise(self, key: Hashable, z: torch.Tensor) -> torch.Tensor:
        """The noise released for tensor ``key`` this step, from Opacus' i.i.d. draw ``z``."""
        return z

    def std_factor(self) -> float:
        """Per-entry std of the noise released at the current step, in units of σC."""
        return 1.0

    def end_step(self) -> None:
        """Called once after every DP step's noise (every tensor's) was drawn."""

    @property
    def sample_rate_factor(self) -> int:
        """How much the sampler's within-group rate exceeds the loader's rate B/N (cyclic Poisson: the bands)."""
        return 1

    def reset(self) -> None:
        """A resumed run: forget any state derived from earlier noise (it is never saved)."""

    def describe(self) -> dict[str, Any]:
        """What the privacy record and the DP state save about the mechanism (public: no noise state)."""
        return {"name": self.name}


class GaussianMechanism(NoiseMechanism):
    """DP-SGD as Opacus does it (the default): i.i.d. N(0, (σC)²) per step, Poisson sampling."""
