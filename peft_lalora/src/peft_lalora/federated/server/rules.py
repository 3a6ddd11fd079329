"""The aggregation rules and their settings' checks, without torch: what the run's configuration
(:class:`~peft_lalora.federated.config.FederationConfig`) validates before anything is built, and what
:func:`~peft_lalora.federated.server.aggregate.fedavg` applies."""

from __future__ import annotations

import math

__all__ = ["NORM_POLICIES", "RULES", "trim_problem"]

RULES = ("mean", "trimmed_mean")
NORM_POLICIES = ("clip", "reject")


def trim_problem(trim_fraction: float, m: int) -> str | None:
    """Why a trimmed mean of ``m`` updates at ``trim_fraction`` trims nothing (``None`` if it trims one or more
    per end): the count Flower's ``trim_mean`` cuts is ``int(trim_fraction · m)``. Says how many clients, or
    which trim fraction, it needs."""
    if int(trim_fraction * m) >= 1:
        return None
    head = f"trimmed_mean with trim_fraction={trim_fraction:g} trims int({trim_fraction:g}·{m}) = 0 of {m} update(s)"
    need_m = math.ceil(1 / trim_fraction) if trim_fraction > 0 else None
    while need_m is not None and int(trim_fraction * need_m) < 1:
        need_m += 1
    fix = f"needs at least {need_m} clients per round" if need_m is not None else "trim_fraction must be > 0"
    if m >= 3:
        need_f = math.ceil(1e4 / m) / 1e4  # 1/m rounded up to 4 decimals (1/m·m itself can round below 1)
        while int(need_f * m) < 1:
            need_f = math.nextafter(need_f, 1.0)
        fix += f", or trim_fraction >= {need_f:g}"
    else:
        fix += " (a trimmed mean needs at least 3 updates)"
    return f"{head}: it would be a plain unweighted mean that one client moves at will; {fix}"
