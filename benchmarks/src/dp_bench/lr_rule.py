"""The learning-rate rule of the paired grids: the best validation score among the values tried, and the grid's
edge extension (a best value at an end of what was tried extends the grid outward by a factor 2, a bounded
number of times) — the rule ``dp-bench grid`` applies, as one pure function."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["lr_edge_step"]


def lr_edge_step(
    tried: Mapping[float, float],
    base: Sequence[float],
    max_extensions: int = 3,
) -> tuple[float, list[float]]:
    """``(best, next_to_try)`` from ``tried`` (lr -> validation score, higher is better).

    ``best`` has the highest score (ties: the smaller lr; a non-finite score ranks last). When ``best`` is the
    smallest (largest) value tried, ``next_to_try`` is ``[best / 2]`` (``[best * 2]``), unless ``max_extensions``
    values outside ``base`` were already tried or fewer than two values were; otherwise it is empty and ``best`` is
    the choice.
    """
    if not tried:
        raise ValueError("no learning rate was tried")
    best = max(tried, key=lambda lr: (tried[lr] if math.isfinite(tried[lr]) else -math.inf, -lr))
    lo, hi = min(tried), max(tried)
    extensions = sum(1 for lr in tried if lr < min(base) or lr > max(base))
    if extensions >= max_extensions or len(tried) < 2:
        return best, []
    if best == lo:
        return best, [lo / 2]
    if best == hi:
        return best, [hi * 2]
    return best, []
