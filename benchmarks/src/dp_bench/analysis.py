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
    "fmt_p",
    "gated_gain_stats",
    "global_cos_stats",
    "holm",
    "holm_family",
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


def fmt_p(ci: dict[str, Any] | None, key: str = "p_holm") -> str:
    """A p-value of a :func:`paired_ci` result for a table: two significant digits, ``–`` when absent (no
    interval, or an analysis stored before p-values were recorded)."""
    p = (ci or {}).get(key)
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.1e}" if p < 1e-3 else f"{p:.2g}"


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
    return {
        "gated_layer_steps": n,
        "positive": pos,
        "share_positive": pos / n if n else float("nan"),
        "mean_gain": float(np.mean(gains)) if gains else float("nan"),
    }


def global_cos_stats(per_step: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean over steps of the global cos(noisy, clean) and cos(denoised, clean), and the relative gain."""
    cg = np.array([e["cos_global"] for e in per_step if "cos_global" in e], dtype=float)
    if cg.size == 0:
        return {"cos_noisy": float("nan"), "cos_denoised": float("nan"), "rel_gain": float("nan")}
    a, b = float(np.nanmean(cg[:, 0])), float(np.nanmean(cg[:, 1]))
    return {"cos_noisy": a, "cos_denoised": b, "rel_gain": (b - a) / abs(a) if a else float("nan")}


def paired_ci(diffs: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """Mean of paired differences with a two-sided t-interval over seeds and the two-sided paired t-test p-value
    (H0: mean 0; scipy's t distribution): ``{"mean", "lo", "hi", "sd", "n", "p"}`` (``lo``/``hi``/``p`` are NaN
    below two pairs; with zero spread ``p`` is 1 for a zero mean and 0 otherwise)."""
    from scipy import stats

    a = np.asarray([d for d in diffs if d is not None and math.isfinite(d)], dtype=float)
    n = int(a.size)
    nan = float("nan")
    if n == 0:
        return {"mean": nan, "lo": nan, "hi": nan, "sd": nan, "n": 0, "p": nan}
    mean = float(a.mean())
    if n < 2:
        return {"mean": mean, "lo": nan, "hi": nan, "sd": nan, "n": 1, "p": nan}
    sd = float(a.std(ddof=1))
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1)) if se > 0 else float(mean == 0)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "sd": sd, "n": n, "p": p}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error control): with the m finite p-values sorted ascending,
    the i-th (from 0) becomes ``max over j <= i of min(1, (m - j) p_(j))``. NaN entries stay NaN and do not count
    in m. Reject at level α where the adjusted value is <= α."""
    ps = [float(p) for p in pvalues]
    order = sorted((i for i, p in enumerate(ps) if math.isfinite(p)), key=lambda i: ps[i])
    m = len(order)
    out = [float("nan")] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


def holm_family(cis: Sequence[dict[str, Any]]) -> None:
    """Holm-adjust the ``"p"`` of a family of :func:`paired_ci` results in place, as ``"p_holm"``."""
    for ci, adj in zip(cis, holm([ci.get("p", float("nan")) for ci in cis]), strict=True):
        ci["p_holm"] = adj


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
