"""The Tracy–Widom gate: the largest singular value of pure noise at a stated false-alarm rate.

``docs/math.md`` §1.7: for ``s·Z`` (m × n, i.i.d. N(0, 1)) the centred and scaled largest eigenvalue of ``ZᵀZ``
follows the GOE Tracy–Widom law (Johnstone 2001), so a matrix whose top singular value exceeds
:func:`tracy_widom_threshold` is noise with probability ``false_alarm``.
"""

from __future__ import annotations

import math
import statistics
from typing import Literal

from torch import Tensor

__all__ = ["TW1_LOG10_ALPHA", "TW1_QUANTILES", "tracy_widom_quantile", "tracy_widom_threshold"]

# Tracy–Widom (β = 1) upper quantiles.
# TW1_QUANTILES[i] = q with P(TW1 > q) = 10 ** TW1_LOG10_ALPHA[i], alpha from 10^-0.3 (≈0.5) to 1e-8 in
# steps of 0.1 decade. Computed for this project (scipy 1.17, float64) from the Ferrari–Spohn (2005)
# Fredholm-determinant formula F1(s) = det(I − K_s) on L²(0, ∞), K_s(x, y) = Ai(x + y + s), by Bornemann's
# (2010) Nyström method (100-point Gauss–Legendre on [0, 14]); quantiles by Brent root finding to 1e-13.
# They agree with the published values (Johnstone 2001 Table 1; Bejan 2005; docs/math.md §1.7): 0.90 → 0.4501,
# 0.95 → 0.9793, 0.99 → 2.0234. tests/opacus_spectral/denoisers/test_spectral.py recomputes a few entries when scipy is
# available.
TW1_LOG10_ALPHA: tuple[float, ...] = tuple(-k / 10 for k in range(3, 81))
TW1_QUANTILES: tuple[float, ...] = (
    -1.272311,
    -0.940013,
    -0.653229,
    -0.397017,
    -0.162997,
    0.054049,
    0.257609,
    0.450143,
    0.633460,
    0.808927,
    0.977611,
    1.140359,
    1.297857,
    1.450669,
    1.599266,
    1.744044,
    1.885342,
    2.023449,
    2.158619,
    2.291072,
    2.421001,
    2.548578,
    2.673956,
    2.797272,
    2.918648,
    3.038195,
    3.156014,
    3.272196,
    3.386825,
    3.499976,
    3.611721,
    3.722124,
    3.831245,
    3.939139,
    4.045857,
    4.151447,
    4.255955,
    4.359420,
    4.461883,
    4.563380,
    4.663945,
    4.763610,
    4.862406,
    4.960362,
    5.057503,
    5.153857,
    5.249447,
    5.344296,
    5.438426,
    5.531858,
    5.624611,
    5.716704,
    5.808155,
    5.898982,
    5.989200,
    6.078824,
    6.167871,
    6.256354,
    6.344287,
    6.431683,
    6.518555,
    6.604914,
    6.690772,
    6.776141,
    6.861031,
    6.945452,
    7.029415,
    7.112929,
    7.196003,
    7.278646,
    7.360868,
    7.442675,
    7.524076,
    7.605080,
    7.685693,
    7.765922,
    7.845776,
    7.925260,
)


def tracy_widom_quantile(false_alarm: float) -> float:
    """Upper quantile ``q`` of the GOE Tracy–Widom law: ``P(TW1 > q) = false_alarm``.

    Linear interpolation of the table above in ``log10(false_alarm)`` (grid 0.1 decade; the
    interpolation error is below 1e-3 in ``q``). Valid for ``1e-8 <= false_alarm <= 0.5``.
    """
    a = float(false_alarm)
    if not (1e-8 <= a <= 10 ** TW1_LOG10_ALPHA[0] + 1e-12):
        raise ValueError(f"false_alarm must be in [1e-8, 0.5], got {false_alarm!r}")
    x = math.log10(a)
    grid = TW1_LOG10_ALPHA
    if x >= grid[0]:
        return TW1_QUANTILES[0]
    # grid is decreasing in steps of 0.1
    pos = (grid[0] - x) / 0.1
    i = min(int(pos), len(grid) - 2)
    frac = pos - i
    return TW1_QUANTILES[i] + frac * (TW1_QUANTILES[i + 1] - TW1_QUANTILES[i])


def tracy_widom_threshold(
    sigma: Tensor | float,
    m: int,
    n: int,
    false_alarm: float,
    centering: Literal["johnstone", "ma"] = "johnstone",
) -> Tensor | float:
    """Largest-singular-value threshold with false-alarm rate ``false_alarm`` on pure noise ``s·Z``
    (``docs/math.md`` §1.7).

    Johnstone (2001), Theorem 1.1: for ``Z`` (N × p) with i.i.d. N(0,1) entries and ``l₁`` the largest
    eigenvalue of ``ZᵀZ``, ``(l₁ − μ)/σ → TW1`` with ``μ = (√(N−1) + √p)²`` and
    ``σ = (√(N−1) + √p)(1/√(N−1) + 1/√p)^{1/3}``. Here ``N = max(m, n)``, ``p = min(m, n)``, and the
    threshold is ``s·sqrt(μ + σ·q)`` with ``P(TW1 > q) = false_alarm``. ``centering="ma"`` uses
    Ma (2012)'s second-order-accurate ``N − ½``, ``p − ½`` in both formulas; Johnstone's centering is
    conservative for thin shapes (measured 768×8: 3.3 % false alarms at a requested 5 %; Ma: 4.6 %).
    For a 1 × N matrix the law of ``l₁ = ‖z‖²`` is χ²_N; its Wilson–Hilferty quantile is used instead.
    """
    big, small = max(m, n), min(m, n)
    if small < 1:
        raise ValueError(f"Tracy–Widom gate needs a non-empty matrix, got {m}×{n}")
    if small == 1:
        # a vector: l₁ = ‖z‖² ~ χ²_N exactly; Wilson–Hilferty quantile (TW is not meant for p = 1)
        z = statistics.NormalDist().inv_cdf(1.0 - false_alarm)
        c = 2.0 / (9.0 * big)
        return sigma * math.sqrt(big * (1.0 - c + z * math.sqrt(c)) ** 3)
    if centering == "johnstone":
        a, b = big - 1.0, float(small)
    elif centering == "ma":
        a, b = big - 0.5, small - 0.5
    else:
        raise ValueError(f"centering must be 'johnstone' or 'ma', got {centering!r}")
    ra, rb = math.sqrt(a), math.sqrt(b)
    mu = (ra + rb) ** 2
    scale = (ra + rb) * (1.0 / ra + 1.0 / rb) ** (1.0 / 3.0)
    level = mu + scale * tracy_widom_quantile(false_alarm)
    return sigma * math.sqrt(max(level, 0.0))
