"""The privacy budget of a ``DPTrainer`` run: how many DP steps fit within ``target_epsilon``, and the callback
that stops training there and checks that the accountant counted every optimizer step (``docs/trainer.md``) — one
accountant step every b DP steps under BandMF with b bands (``docs/mechanisms.md``)."""

from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

from ..accounting.calibration import epsilon_from_history
from ..doctor.doctor import accounted_steps

__all__ = ["DPControl", "budget_steps", "epsilon_after", "spends_infinite_epsilon"]


def spends_infinite_epsilon(accountant: Any) -> bool:
    """Whether the accountant's history holds a step of noise multiplier 0 (no noise): ε is then infinite at every
    δ < 1."""
    return any(float(nm) == 0 and rate > 0 and steps > 0 for nm, rate, steps in accountant.history)


def epsilon_after(accountant: Any, more: int, *, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """ε at ``delta`` once ``more`` steps of (noise_multiplier, q) follow the accountant's history (the accountant
    is untouched)."""
    history = list(accountant.history)
    if more > 0:
        history.append((noise_multiplier, sample_rate, more))
    return epsilon_from_history(history, delta, accountant.mechanism())  # a step without noise: ∞


def budget_steps(
    accountant: Any,
    *,
    max_steps: int,
    target_epsilon: float | None,
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
) -> int | None:
    """The largest total number of DP steps within ``target_epsilon`` (None: all of ``max_steps`` fits)."""
    if target_epsilon is None:
        return None

    def eps(more: int) -> float:
        return epsilon_after(accountant, more, noise_multiplier=noise_multiplier, sample_rate=sample_rate, delta=delta)

    done = accounted_steps(accountant)
    remaining = max(max_steps - done, 0)
    if eps(remaining) <= target_epsilon:
        return None
    if eps(1) > target_epsilon:
        raise ValueError(
            f"the privacy budget is spent: one more step would exceed target_epsilon={target_epsilon} "
            f"(epsilon now {eps(0):.4g})"
        )
    lo, hi = 1, remaining  # eps(lo) <= target < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= target_epsilon else (lo, mid)
    return done + lo


class DPControl(TrainerCallback):
    """Stops training at the privacy budget and checks that the accountant counted every optimizer step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        counted = accounted_steps(t.privacy_engine.accountant) - t.prior_steps  # this run's (.privacy_record)
        every = t.accounted_every
        if counted != -(-state.global_step // every):
            charges = "" if every == 1 else f", which charge {-(-state.global_step // every)} (one every {every})"
            raise RuntimeError(
                f"the accountant counted {counted} DP steps but the Trainer took {state.global_step} optimizer steps"
                f"{charges}: some update was not privatized as accounted (was the optimizer stepped outside DPTrainer?)"
            )
        step = state.global_step
        if t.budget_steps is not None and step >= t.budget_steps:
            warnings.warn(
                f"stopping at step {step}: one more step would exceed target_epsilon={t.args.target_epsilon} "
                f"(epsilon now {t.get_epsilon():.4g})",
                RuntimeWarning,
                stacklevel=2,
            )
            control.should_training_stop = True
