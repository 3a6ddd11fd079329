"""From canary scores to a one-run lower bound: the auditor's guesses (``docs/math.md`` §5.3).

Algorithm 1 of Steinke, Nasr & Jagielski (2023): rank the m canaries by score, guess "included" for the
``k₊`` highest, "excluded" for the ``k₋`` lowest, abstain on the rest; ``r = k₊ + k₋`` guesses of which ``v``
are right give the bound — ``bound="snj"``: :func:`~opacus_spectral.audit.bound.one_run_epsilon_lower_bound`
(against (ε, δ)-DP), ``bound="fdp"``: :func:`~opacus_spectral.audit.fdp.one_run_fdp_epsilon_lower_bound` (against
μ-GDP, tighter for Gaussian noise; ``docs/math.md`` §5.7). The guess sizes must be fixed before the scores are seen;
trying several sizes and keeping the best is valid when each is tested at confidence ``1 − β/n`` (Bonferroni over
the ``n`` sizes), which :func:`audit_scores` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .bound import one_run_epsilon_lower_bound
from .claims import gaussian_dp_epsilon
from .fdp import one_run_gdp_lower_bound

__all__ = ["AuditResult", "audit_scores", "default_guesses"]

#: default guess sizes as fractions of m, each used on both ends (k₊ = k₋)
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
#: the bounds :func:`audit_scores` computes: Steinke–Nasr–Jagielski's (ε, δ) test, or the f-DP test of μ-GDP
BOUNDS = ("snj", "fdp")


@dataclass(frozen=True)
class AuditResult:
    """A one-run audit: the lower bound and the guesses it came from."""

    epsilon_lower: float  #: ε such that the algorithm is not (ε, δ)-DP, at this confidence
    num_canaries: int  #: m
    num_guesses: int  #: r = k₊ + k₋ of the best guess size
    num_correct: int  #: v
    positive_guesses: int  #: k₊
    negative_guesses: int  #: k₋
    delta: float
    confidence: float  #: overall confidence 1 − β (each of the ``candidates`` sizes was tested at 1 − β/n)
    candidates: int  #: number of guess sizes tried (the Bonferroni factor)
    bound: str = "snj"  #: ``"snj"`` (refutes (ε, δ)-DP) or ``"fdp"`` (refutes μ-GDP; ε is that μ's ε at δ)
    mu_lower: float | None = None  #: ``bound="fdp"``: the μ such that the algorithm is not μ-GDP

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_guesses(num_canaries: int, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[tuple[int, int]]:
    """Two-sided guess sizes ``(k, k)`` with ``k = round(f·m)`` for each fraction (at least 1, deduplicated)."""
    ks = {max(1, round(f * num_canaries)) for f in fractions}
    return [(k, k) for k in sorted(ks) if 2 * k <= num_canaries]


def _as_numpy(x: torch.Tensor | np.ndarray | Sequence[Any], dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def audit_scores(
    scores: torch.Tensor | np.ndarray | Sequence[float],
    included: torch.Tensor | np.ndarray | Sequence[bool],
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
    guesses: Sequence[tuple[int, int]] | None = None,
    bound: str = "snj",
) -> AuditResult:
    """The one-run lower bound from per-canary scores (higher = more likely included).

    Args:
        scores: one score per canary (finite).
        included: the canaries' true membership (the auditor's secret coin flips).
        delta: δ of the claims tested (the bound's 2mδ term uses m = ``len(scores)``); ``bound="fdp"`` turns
            μ into ε at this δ, which must then be > 0.
        confidence: overall 1 − β.
        guesses: ``(k₊, k₋)`` pairs fixed in advance (default: :func:`default_guesses`); each is tested at
            confidence ``1 − β/len(guesses)`` and the largest bound is returned.
        bound: ``"snj"`` (default; valid against any (ε, δ) claim) or ``"fdp"`` (against a μ-GDP claim only:
            gradient canaries present in every step; ``docs/audit.md``, "Which bound").
    """
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    if bound == "fdp" and not 0.0 < delta < 1.0:
        raise ValueError(
            f"bound='fdp' reports the refuted μ as an ε at delta, which must be in (0, 1), got {delta!r} "
            "(a μ-GDP algorithm has no finite ε at δ = 0)"
        )
    s = _as_numpy(scores, np.float64)
    inc = _as_numpy(included, bool)
    if s.ndim != 1 or inc.shape != s.shape:
        raise ValueError(f"scores and included must be 1-D of the same length, got {s.shape} and {inc.shape}")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    m = int(s.size)
    pairs = list(default_guesses(m) if guesses is None else guesses)
    if not pairs:
        raise ValueError(f"no guess sizes fit {m} canaries")
    for kp, kn in pairs:
        if kp < 0 or kn < 0 or kp + kn > m or kp + kn == 0:
            raise ValueError(f"guess sizes (k+={kp}, k-={kn}) do not fit {m} canaries")
    order = np.argsort(-s, kind="stable")  # ties broken by index: independent of the coin flips
    ranked = inc[order]
    hits_top = np.concatenate([[0], np.cumsum(ranked)])  # included among the k highest
    misses_bottom = np.concatenate([[0], np.cumsum(~ranked[::-1])])  # excluded among the k lowest
    level = 1.0 - (1.0 - confidence) / len(pairs)
    best: AuditResult | None = None
    for kp, kn in pairs:
        v = int(hits_top[kp] + misses_bottom[kn])
        if bound == "fdp":
            mu: float | None = one_run_gdp_lower_bound(kp + kn, v, m, level)
            eps = gaussian_dp_epsilon(mu, delta)
        else:
            mu, eps = None, one_run_epsilon_lower_bound(kp + kn, v, delta, level, num_canaries=m)
        if best is None or eps > best.epsilon_lower:
            best = AuditResult(eps, m, kp + kn, v, kp, kn, float(delta), float(confidence), len(pairs), bound, mu)
    assert best is not None
    return best
