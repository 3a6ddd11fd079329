"""Noise-error proxy of BandMF against DP-SGD at equal (ε, δ) (``docs/results/mechanisms.md``).

For a run of T steps at sampling rate q, the workload is SGD's prefix sums: A the T × T lower-triangular matrix of
ones, so (A x)_t = Σ_{s≤t} x_s is the noise in the parameters after step t (learning rate 1). With a b-banded
strategy M normalized to unit column norm (κ = 1) and coefficients optimized for A
(:func:`opacus_spectral.mechanisms.bandmf_math.optimal_coefficients`), the noise of the prefix sums is
σ_b · A M⁻¹ z (z i.i.d. N(0, 1), units of the clipping norm C, per coordinate), and its RMSE over the T prefix sums is

    RMSE_b = σ_b · ‖A M⁻¹‖_F / √T,

where σ_b is calibrated to (ε, δ) for BandMF's amplified accounting — DP-SGD with noise multiplier σ_b, rate
min(b·q, 1) and ⌈T/b⌉ steps (cyclic Poisson sampling; ``docs/mechanisms.md``) — by
:func:`opacus_spectral.accounting.calibration.noise_multiplier_for`. DP-SGD is b = 1 (M = I): RMSE_1 = σ_1 ‖A‖_F / √T
with σ_1 calibrated for (q, T). The proxy is RMSE_b / RMSE_1 = σ_b ‖A M⁻¹‖_F / (σ_1 ‖A‖_F) (< 1: BandMF adds less
noise to the running sum than DP-SGD at the same ε; b = 1 gives exactly 1). Cells with b > T or b·q > 1 are skipped.

``--momentum β`` measures the error on SGD-with-momentum's workload instead (A[t, s] = Σ_{u=s}^{t} β^{u−s}), and
``--rows last`` on its last row only (the noise in the final parameters); both change only where the error is
measured: the coefficients stay the prefix-sum ones the engine uses by default.

    dp-bench mf-proxy        # docs/results/mf_proxy.json + .png (≈ 6 min on 2 shared cores: the PRV calibrations)
    dp-bench mf-proxy --replot   # the tables and the plot from the JSON
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.accounting.calibration import noise_multiplier_for
from opacus_spectral.mechanisms.bandmf_math import error_column, optimal_coefficients, toeplitz_error

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS

#: the published proxy quoted in ``docs/mechanisms.md`` (best b, published accountants): (T, ε) -> ratio
PUBLISHED_BEST = {
    (100, 8.0): 0.53,
    (100, 1.0): 0.78,
    (300, 8.0): 0.49,
    (300, 1.0): 0.84,
    (1000, 8.0): 0.51,
    (1000, 1.0): 0.93,
}
PUBLISHED_B64_EPS1 = (1.24, 1.37)  #: b = 64 at ε = 1 over the published T


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


@dataclass
class Config:
    steps: str = opt("100,300,1000", "comma-separated run lengths T")
    epsilons: str = opt("1,3,8", "comma-separated ε")
    bands: str = opt("1,2,4,8,16,32,64", "comma-separated bands b (1 = DP-SGD)")
    sample_rate: float = opt(0.01, "DP-SGD's sampling rate q = B/N (BandMF samples its group at b·q)")
    delta: float = opt(1e-5, "δ")
    accountant: str = opt("prv", "accountant of the calibration", choices=("prv", "rdp"))
    tolerance: float = opt(0.001, "ε tolerance of the σ calibration (ε within it below the target)")
    momentum: float = opt(0.0, "the workload's momentum β (0: SGD's prefix sums); the coefficients stay prefix-sum")
    rows: str = opt(
        "all",
        "the workload's rows the error is taken over: all, or last (the final parameters)",
        choices=("all", "last"),
    )
    out: Path = opt(RESULTS / "mf_proxy.json", "result JSON")
    plot: Path = opt(RESULTS / "mf_proxy.png", "result plot (PNG)")
    replot: bool = opt(False, "only the tables and the plot from --out")

    def validate(self) -> None:
        try:
            steps, bands, eps = _ints(self.steps), _ints(self.bands), _floats(self.epsilons)
        except ValueError as err:
            raise ValueError(f"--steps, --bands, --epsilons must be comma-separated numbers ({err})") from None
        if not steps or min(steps) < 1 or not bands or min(bands) < 1 or not eps or min(eps) <= 0:
            raise ValueError("need steps >= 1, bands >= 1 and ε > 0 (each list non-empty)")
        if 1 not in bands:
            raise ValueError("--bands must include 1 (DP-SGD, the denominator of the proxy)")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"--sample-rate must be in (0, 1], got {self.sample_rate}")


def workload_error(coefficients: Sequence[float], steps: int, momentum: float = 0.0, rows: str = "all") -> float:
    """κ²‖A M⁻¹‖²_F on SGD's (momentum β) workload, over all its rows or the last, in O(T·b)
    (:func:`~opacus_spectral.mechanisms.bandmf_math.toeplitz_error`, ``error_column``)."""
    if rows == "all":
        return toeplitz_error(coefficients, steps, momentum)[0]
    e = error_column(coefficients, steps, momentum)  # the last row of A M⁻¹ is e reversed
    return math.fsum(c * c for c in coefficients) * float(e @ e)


def factorization_errors(
    steps: int, bands: Sequence[int], momentum: float = 0.0, rows: str = "all"
) -> dict[int, dict[str, Any]]:
    """Per b: the prefix-sum-optimized coefficients' ‖A M⁻¹‖_F (κ = 1) on the measured workload, and the time."""
    out: dict[int, dict[str, Any]] = {}
    for b in bands:
        t0 = time.perf_counter()
        coefs = optimal_coefficients(steps, b)
        out[b] = {
            "kappa": math.sqrt(sum(c * c for c in coefs)),
            "frobenius": math.sqrt(workload_error(coefs, steps, momentum, rows)),
            "rows": steps if rows == "all" else 1,
            "coefficients": list(coefs),
            "optimize_s": time.perf_counter() - t0,
        }
    return out


def proxy_cell(cfg: Config, steps: int, eps: float, errors: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One (T, ε): σ_b, RMSE_b and the ratio to DP-SGD per b, and the best b."""
    q = cfg.sample_rate
    rows: dict[str, dict[str, float]] = {}
    for b, e in errors.items():
        t0 = time.perf_counter()
        sigma = noise_multiplier_for(
            target_epsilon=eps,
            target_delta=cfg.delta,
            sample_rate=min(1.0, b * q),
            steps=math.ceil(steps / b),
            accountant=cfg.accountant,
            epsilon_tolerance=cfg.tolerance,
        )
        rows[str(b)] = {"sigma": sigma, "rmse": sigma * e["frobenius"] / math.sqrt(e["rows"])}
        rows[str(b)]["calibrate_s"] = time.perf_counter() - t0
    base = rows["1"]["rmse"]
    for r in rows.values():
        r["ratio"] = r["rmse"] / base
    best = min(rows, key=lambda k: rows[k]["ratio"])
    return {"bands": rows, "best_b": int(best), "best_ratio": rows[best]["ratio"]}


def compute(cfg: Config) -> dict[str, Any]:
    """Every (T, ε) cell of the config (b > T or b·q > 1 skipped)."""
    cells: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for steps in _ints(cfg.steps):
        bands = [b for b in _ints(cfg.bands) if b <= steps and b * cfg.sample_rate <= 1]
        t0 = time.perf_counter()
        errors = factorization_errors(steps, bands, cfg.momentum, cfg.rows)
        timing[f"optimize_T{steps}_s"] = time.perf_counter() - t0
        cells[str(steps)] = {
            # ‖A‖_F (√(T(T+1)/2) for the prefix sums): M = I
            "dpsgd_frobenius": math.sqrt(workload_error((1.0,), steps, cfg.momentum, cfg.rows)),
            "factorizations": {str(b): e for b, e in errors.items()},
            "epsilons": {},
        }
        for eps in _floats(cfg.epsilons):
            cells[str(steps)]["epsilons"][f"{eps:g}"] = proxy_cell(cfg, steps, eps, errors)
            print(f"T={steps} ε={eps:g}: {_row(cells[str(steps)]['epsilons'][f'{eps:g}'])}", flush=True)
        timing[f"total_T{steps}_s"] = time.perf_counter() - t0
    return {"cells": cells, "timing": timing}


def _row(cell: dict[str, Any]) -> str:
    return ", ".join(f"b={b} {r['ratio']:.3f}" for b, r in cell["bands"].items()) + f"; best b={cell['best_b']}"


def tables(result: dict[str, Any]) -> str:
    """Ratio RMSE_b / RMSE_DP-SGD per (T, ε) and b, the best b beside the published best ratio."""
    bands = sorted({int(b) for c in result["cells"].values() for e in c["epsilons"].values() for b in e["bands"]})
    head = "| T | ε | " + " | ".join(f"b={b}" for b in bands) + " | best (b) | published best |"
    lines = [head, "|" + "---|" * (len(bands) + 4)]
    for t, c in result["cells"].items():
        for eps, e in c["epsilons"].items():
            vals = [f"{e['bands'][str(b)]['ratio']:.3f}" if str(b) in e["bands"] else "–" for b in bands]
            pub = PUBLISHED_BEST.get((int(t), float(eps)))
            lines.append(
                f"| {t} | {eps} | {' | '.join(vals)} | {e['best_ratio']:.3f} ({e['best_b']}) | "
                f"{'–' if pub is None else f'{pub:.2f}'} |"
            )
    lo, hi = PUBLISHED_B64_EPS1
    lines.append(
        f"\nPublished at b = 64, ε = 1: {lo:.2f}–{hi:.2f}. Accountant: {result['config']['accountant']}, "
        f"q = {result['config']['sample_rate']:g}, δ = {result['config']['delta']:g}."
    )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per T: the ratio against b (log scale), one line per ε, the published best as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.8), squeeze=False, sharey=True)
    for ax, (t, c) in zip(axes[0], cells.items(), strict=True):
        for k, (eps, e) in enumerate(c["epsilons"].items()):
            bs = [int(b) for b in e["bands"]]
            line = ax.plot(bs, [r["ratio"] for r in e["bands"].values()], marker="o", label=f"ε = {eps}")[0]
            pub = PUBLISHED_BEST.get((int(t), float(eps)))
            if pub is not None:
                ax.axhline(pub, color=line.get_color(), ls=":", lw=1, label="published best" if k == 0 else None)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bands b")
        ax.set_title(f"T = {t}, q = {result['config']['sample_rate']:g}")
    beta, rows = result["config"].get("momentum", 0.0), result["config"].get("rows", "all")
    what = "prefix-sum" if (beta, rows) == (0.0, "all") else f"workload (β = {beta:g}, {rows} rows)"
    axes[0][0].set_ylabel(f"{what} RMSE, BandMF / DP-SGD")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench mf-proxy", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, cfg.plot)
    res = {**start("mf-proxy", cfg, argv), "torch": torch.__version__, "threads": torch.get_num_threads()}
    res["definition"] = (
        f"ratio = sigma_b * ||A M^-1||_F / (sigma_1 * ||A||_F), A = SGD workload (momentum {cfg.momentum:g}, "
        f"{cfg.rows} rows), M from prefix-sum-optimized coefficients, kappa = 1"
    )
    t0 = time.perf_counter()
    res.update(compute(cfg))
    res["wall_s"] = time.perf_counter() - t0
    return runner.write(res, REPORT, cfg.out, cfg.plot, indent=2)
