"""Numbers computed from stored runs: summary statistics, steps/ε to reach an accuracy, oracle cosines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "paired_ci",
    "crossing_step",
    "eps_at_accuracy",
    "fmt",
    "gated_gain_stats",
    "global_cos_stats",
    "mean_std",
    "steps_to_reach",
    "verdict",
]


def mean_std(xs: Sequence[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for one value) of the finite values."""
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def fmt(ms: tuple[float, float], digits: int = 3, pct: bool = False) -> str:
    m, s = ms
    if not math.isfinite(m):
        return "–"
    if pct:
        return f"{100 * m:.{max(digits - 2, 0)}f} ± {100 * s:.{max(digits - 2, 0)}f} %"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def steps_to_reach(curve: Sequence[Sequence[float]], target: float) -> int | None:
    """First evaluated step whose accuracy is >= target (None if never)."""
    return next((int(s) for s, a in curve if a >= target), None)


def crossing_step(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """First step at which the accuracy curve reaches ``target`` (linear interpolation between checkpoints)."""
    prev = None
    for s, a in curve:
        if a >= target:
            if prev is None or prev[1] >= target:
                return float(s)
            (s0, a0) = prev
            return float(s0 + (target - a0) / (a - a0) * (s - s0))
        prev = (s, a)
    return None


def eps_at_accuracy(eps_acc: Sequence[tuple[float, float]], acc: float) -> tuple[float | None, str]:
    """ε at which the baseline reaches ``acc``: interpolation in log ε on the (running-max) accuracy curve.

    Returns (ε, "") inside the measured range, or (None, "<min" / ">max") outside it.
    """
    pts = sorted(eps_acc)
    if len(pts) < 2:
        return None, "n/a"
    es = np.log([p[0] for p in pts])
    ac = np.maximum.accumulate([p[1] for p in pts])
    if acc <= ac[0]:
        return (float(pts[0][0]), "") if acc == ac[0] else (None, f"<{pts[0][0]:g}")
    if acc > ac[-1]:
        return None, f">{pts[-1][0]:g}"
    i = int(np.searchsorted(ac, acc))  # ac[i-1] < acc <= ac[i]
    if ac[i] == ac[i - 1]:
        return float(math.exp(es[i])), ""
    t = (acc - ac[i - 1]) / (ac[i] - ac[i - 1])
    return float(math.exp(es[i - 1] + t * (es[i] - es[i - 1]))), ""


def gated_gain_stats(per_step: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over all gated layer-steps: how many have cos(denoised, clean) > cos(noisy, clean)."""
    n = pos = 0
    gains: list[float] = []
    for e in per_step:
        cos = e.get("cos", {})
        for name in e.get("gated_names", []):
            if name in cos:
                a, b = cos[name]
                if math.isfinite(a) and math.isfinite(b):
                    n += 1
                    pos += int(b > a)
                    gains.append(b - a)
    return {"gated_layer_steps": n, "positive": pos, "share_positive": pos / n if n else float("nan"),
            "mean_gain": float(np.mean(gains)) if gains else float("nan")}  # fmt: skip


def global_cos_stats(per_step: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean over steps of the global cos(noisy, clean) and cos(denoised, clean), and the relative gain."""
    cg = np.array([e["cos_global"] for e in per_step if "cos_global" in e], dtype=float)
    if cg.size == 0:
        return {"cos_noisy": float("nan"), "cos_denoised": float("nan"), "rel_gain": float("nan")}
    a, b = float(np.nanmean(cg[:, 0])), float(np.nanmean(cg[:, 1]))
    return {"cos_noisy": a, "cos_denoised": b, "rel_gain": (b - a) / abs(a) if a else float("nan")}


def paired_ci(diffs: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """Mean of paired differences with a two-sided t-interval over seeds: ``{"mean", "lo", "hi", "sd", "n"}``
    (``lo``/``hi`` are NaN below two pairs)."""
    from scipy import stats

    a = np.asarray([d for d in diffs if d is not None and math.isfinite(d)], dtype=float)
    n = int(a.size)
    if n == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "sd": float("nan"), "n": 0}
    mean = float(a.mean())
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "sd": float("nan"), "n": 1}
    sd = float(a.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "sd": sd, "n": n}


def verdict(ci: dict[str, Any], claim_low: float, claim_high: float = float("inf")) -> str:
    """``"reproduced"`` when the CI lies inside the claimed range [low, high], ``"contradicted"`` when it lies
    entirely outside it, ``"inconclusive"`` otherwise (or without a CI)."""
    lo, hi = ci["lo"], ci["hi"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if lo >= claim_low and hi <= claim_high:
        return "reproduced"
    if hi < claim_low or lo > claim_high:
        return "contradicted"
    return "inconclusive"
