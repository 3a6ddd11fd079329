"""The noise multiplier for a privacy budget — the one calibration every caller uses — and its inverse, the ε a
history of steps spends.

``noise_multiplier_for(target_epsilon=..., target_delta=..., sample_rate=..., steps=...)`` is the smallest
noise multiplier σ whose ``steps`` Poisson-sampled steps of rate q spend at most (ε, δ) under ``accountant``
(Opacus' ``get_noise_multiplier``, which searches σ by bisection to within ``epsilon_tolerance``). DPTrainer,
the federated client and the harness call it; ``PrivacyEngine.make_private_with_epsilon`` reaches the same
Opacus function.

The search is a pure function of its arguments and costs seconds (each bisection step is a full accountant
evaluation; the RDP accountant's fractional orders dominate), so its result is kept per argument tuple: a federated
simulation's server and clients calibrate the same partitions, and a grid the same cells, once.

``epsilon_from_history(history, delta, accountant)`` is ε at δ of a fresh Opacus accountant given ``history``
(``[(noise_multiplier, sample_rate, steps), ...]``, the accountants' own format): the same call on the same history
as ``accountant.get_epsilon(delta)``, so the same float, kept per (history, δ, accountant) for the same reason — a grid
ends many runs on identical histories, and a budget search asks the same ε more than once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

__all__ = ["epsilon_from_history", "noise_multiplier_for"]


def noise_multiplier_for(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """σ such that ``steps`` steps at sample rate q give ε ≤ ``target_epsilon`` at δ = ``target_delta``.

    Raises:
        ValueError: ε not a positive finite number, δ outside (0, 1), q outside (0, 1] or steps < 1.
    """
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(
            f"target_epsilon must be a positive finite number, got {target_epsilon!r} (a run without privacy takes "
            "noise_multiplier=0 instead of a budget)"
        )
    if not 0 < target_delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    args = (float(target_epsilon), float(target_delta), float(sample_rate), int(steps), accountant)
    return _search(*args, float(epsilon_tolerance))


@functools.lru_cache(maxsize=1024)
def _search(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str, tolerance: float
) -> float:
    """Opacus' bisection for σ (validated arguments; one evaluation per distinct argument tuple)."""
    from opacus.accountants.utils import get_noise_multiplier  # noqa: PLC0415 - heavy import

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=tolerance,
        )
    )


def epsilon_from_history(history: Iterable[Sequence[float]], delta: float, accountant: str = "prv") -> float:
    """ε at ``delta`` spent by ``history`` under Opacus' ``accountant`` (``"prv"``, ``"rdp"`` or ``"gdp"``).

    An empty history spends nothing (0.0); a step without noise (noise multiplier 0 at a positive rate) has no finite
    guarantee (∞).

    Raises:
        ValueError: δ outside (0, 1), an unknown accountant, or an entry that is not
            (σ ≥ 0, 0 < q ≤ 1, whole steps ≥ 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in ("prv", "rdp", "gdp"):
        raise ValueError(f"accountant must be 'prv', 'rdp' or 'gdp', got {accountant!r}")
    hist = tuple((float(s), float(q), float(n)) for s, q, n in history)
    for s, q, n in hist:  # steps must be a whole number: truncating 2.5 to 2 would under-count ε
        if not (s >= 0 and 0 < q <= 1 and n >= 1 and n.is_integer()):
            raise ValueError(
                f"history entries are (noise_multiplier >= 0, 0 < sample_rate <= 1, whole steps >= 1), got {(s, q, n)}"
            )
    hist = tuple((s, q, int(n)) for s, q, n in hist)
    if not hist:
        return 0.0
    if any(s == 0 for s, _, _ in hist):
        return math.inf
    return _epsilon(hist, float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """A fresh Opacus accountant's ε on ``history`` (validated arguments; one evaluation per distinct tuple)."""
    from opacus.accountants import create_accountant  # noqa: PLC0415 - heavy import

    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta))
