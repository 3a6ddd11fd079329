"""The one timed-steps helper of dp-bench's performance commands (``overhead``, ``overhead-llm``, ``isolation-cost``,
``grid --measure-speed``): wall-clock seconds of a step, the device synced around it, untimed warm-up steps first,
and several arms (e.g. with and without a denoiser) interleaved in ABBA order so that a linear drift of the
machine's speed cancels between them; and the spread that the results record."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["median_time", "spread", "sync", "timed", "timed_steps"]

A = TypeVar("A", bound=Hashable)


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[float, Any]:
    """``(seconds, fn())``, the device synced before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def timed_steps(
    step: Callable[[int, A], Any],
    rounds: int,
    *,
    arms: Sequence[A] = (None,),  # type: ignore[assignment]
    warmup: int = 0,
    device: torch.device | None = None,
    on_start: Callable[[], None] | None = None,
    after: Callable[[int, A, float], None] | None = None,
) -> dict[A, list[float]]:
    """Seconds of ``step(i, arm)`` per arm (``i``: the step's index, warm-up steps included).

    First ``warmup`` untimed steps (the arms in turn), then ``on_start()``, then ``rounds`` rounds of one step per
    arm, every other round in reverse order (two arms: A B B A A B ...). ``after(i, arm, seconds)`` runs after each
    timed step, outside the timing.
    """
    for i in range(warmup):
        step(i, arms[i % len(arms)])
    if on_start is not None:
        on_start()
    times: dict[A, list[float]] = {arm: [] for arm in arms}
    i = warmup
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            seconds = timed(lambda i=i, arm=arm: step(i, arm), device)[0]
            times[arm].append(seconds)
            if after is not None:
                after(i, arm, seconds)
            i += 1
    return times


def median_time(fn: Callable[[], Any], reps: int, device: torch.device | None = None) -> float:
    """Median seconds of ``reps`` calls of ``fn()``."""
    return statistics.median(timed_steps(lambda i, arm: fn(), reps, device=device)[None])


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median with quartiles, min, max and count of a list of timings."""
    if not xs:
        return {"median": math.nan, "q1": math.nan, "q3": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}
