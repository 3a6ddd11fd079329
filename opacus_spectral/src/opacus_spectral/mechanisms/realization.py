"""The engine's realization of a strategy for one run (``docs/mechanisms.md``): its noise stream, the per-step std of
what it releases, its sampler's groups and the accounting it charges — all computed here from the
:class:`~.strategy.BandedToeplitz` the mechanism answered, nothing taken from the mechanism itself.

Every ``make_private`` builds a fresh realization, so one mechanism object given to two runs never shares a stream.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

import torch

from ..errors import PastHorizonWarning
from .base import NoiseMechanism, check_contract
from .strategy import Accounting, BandedToeplitz, RowNorms
from .stream import BandStream

__all__ = ["Realization", "realize"]


class Realization:
    """One run's strategy, realized: ``noise(key, z)`` streams x_t = (M⁻¹z)_t per tensor; ``std_factor()`` is
    ‖row_t(M⁻¹)‖ at the stream's step; ``accounting(σ, q)`` what the engine charges (σ/κ, b·q, every b)."""

    def __init__(self, mechanism: NoiseMechanism, strategy: BandedToeplitz, steps: int | None) -> None:
        if not isinstance(strategy, BandedToeplitz):
            raise TypeError(
                f"noise mechanism {mechanism.name!r}.strategy() returned {type(strategy).__name__}, not a "
                "BandedToeplitz: the engine realizes and accounts banded Toeplitz strategies only"
            )
        self.name = mechanism.name
        self.settings = mechanism.describe()
        self.strategy = strategy
        self.steps = steps
        self._stream = BandStream(strategy.coefficients)
        self.row_norm = RowNorms(strategy, steps or 1)  #: ‖row_t(M⁻¹)‖ for any t (the run may go past its length)
        self._t = 0  # the stream's step (0 after a reset: a resumed run's fresh stream)
        self._taken = 0  #: steps this realization has taken (not reset: the horizon warning's count)

    @property
    def bands(self) -> int:
        return self.strategy.bands

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self.strategy.coefficients

    @property
    def kappa(self) -> float:
        return self.strategy.kappa

    @property
    def correlated(self) -> bool:
        return self.strategy.correlated

    @property
    def sample_rate_factor(self) -> int:
        """How much the sampler's within-group rate exceeds the loader's rate B/N (cyclic Poisson: the bands)."""
        return self.strategy.bands

    @property
    def sampler(self) -> str:
        return "poisson" if self.bands == 1 else "cyclic_poisson"

    def accounting(self, noise_multiplier: float, sample_rate: float) -> Accounting:
        return self.strategy.accounting(noise_multiplier, sample_rate)

    def noise(self, key: Hashable, z: torch.Tensor) -> torch.Tensor:
        """The noise released for tensor ``key`` this step, from the engine's i.i.d. draw ``z``."""
        return self._stream.advance(key, z)

    def std_factor(self) -> float:
        """‖row_t(M⁻¹)‖ at the stream's current step (1/c_0 at its first)."""
        return self.row_norm(self._t)

    @property
    def stream_step(self) -> int:
        return self._t

    def end_step(self) -> None:
        self._t += 1
        self._taken += 1
        horizon = self.strategy.workload.get("steps")
        if horizon is not None and self._taken == horizon + 1:  # once, at the first step past it
            warnings.warn(
                f"noise mechanism {self.name!r}: this run has taken {self._taken} steps, past the {horizon} its "
                "coefficients were optimized for (make_private's steps= / epochs=, DPTrainer's max_steps). The noise "
                "and ε stay exact; the coefficients are optimal only for the shorter run — pass the run's length.",
                PastHorizonWarning,
                stacklevel=2,
            )

    def reset(self) -> None:
        """A resumed run: a fresh stream (its buffers are never saved)."""
        self._t = 0
        self._stream.reset()

    def buffer_bytes(self) -> int:
        """Memory the noise stream holds now: (b − 1) × the trainable tensors' bytes once every tensor has been
        through b − 1 steps (``docs/mechanisms.md``, "Cost")."""
        return self._stream.memory_bytes()

    def state(self) -> dict[str, Any]:
        """The public facts a checkpoint keeps: the settings, the run length realized for, the coefficients and κ."""
        return {**self.settings, "steps": self.steps, "coefficients": list(self.coefficients), "kappa": self.kappa}


def realize(mechanism: Any, *, steps: int | None, sample_rate: float, dataset_size: int) -> Realization:
    """Ask ``mechanism`` (checked against the contract) for its strategy and realize it; the engine's refusals:
    b > T, and a within-group rate b·q > 1."""
    mechanism = check_contract(mechanism)
    strategy = mechanism.strategy(steps=steps, sample_rate=sample_rate, dataset_size=dataset_size)
    if isinstance(strategy, BandedToeplitz):
        if steps and strategy.bands > steps:  # (a run of 0 steps is refused by its caller)
            raise ValueError(f"{mechanism.name}: {strategy.bands} bands exceed the run's {steps} steps (b <= T)")
        if strategy.bands * sample_rate > 1:
            raise ValueError(
                f"{mechanism.name}: the rate within a group, bands × B/N = {strategy.bands} × {sample_rate:.4g}, "
                f"exceeds 1: use at most {int(1 / sample_rate)} bands, or a smaller batch"
            )
    return Realization(mechanism, strategy, steps)
