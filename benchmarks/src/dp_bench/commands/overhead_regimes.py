"""Regime (c) of ``dp-bench overhead``, and the switchable denoiser its regimes share: synthetic spiked gradients, one
large layer (timed with :func:`dp_bench.timing.timed_steps`).

* ``synthetic``: ``rmt_denoise`` on one m × n matrix ``s·Z`` (gate shut) or ``s·Z + Σ_{i≤k} λ_i u_i v_iᵀ`` with
  k random orthonormal spikes at ``λ_i`` from 1.5× to 3× the BBP threshold ``s(mn)^{1/4}`` (gate open), every
  configuration timed in turn, the order reversed every repetition (ABBA), medians with quartiles; for
  reference also the shut matrix through the exact Cholesky screen (``screen="cholesky"``).
* ``big``: DP steps of a model whose only weight is one ``d × d`` Linear layer (d = 4096 by default), inputs in
  an 8-dimensional subspace so that the clean gradient has rank ≤ 8; steps with the gate shut (noise
  multiplier 1) and open (a noise multiplier set so that the top clean singular value is about twice the
  threshold) interleaved, and steps without the denoiser: the worst gate-open step over the median shut step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from opacus_spectral.denoisers.rmt import PAPER_SETTING, RMTDenoiser, bulk_edge, rmt_denoise
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, PrivacyEngine

from ..timing import spread, timed, timed_steps


class Switch(Denoiser):
    """Runs the wrapped denoiser only when ``on``; times it; keeps one step's records for the offline part."""

    name = "switch"

    def __init__(self, inner: RMTDenoiser, device: torch.device) -> None:
        super().__init__()
        self.inner, self.device, self.on = inner, device, False
        self.seconds: list[float] = []
        self.gated: list[int] = []
        self.capture = False
        self.captured: list[NoisyGradient] | None = None

    def __call__(self, grads: Sequence[NoisyGradient]) -> Any:
        if self.capture:
            self.captured = [
                NoisyGradient(g.name, g.role, g.tensor.detach().clone(), g.sigma, g.step, g.layer) for g in grads
            ]
            self.capture = False
        if not self.on:
            return None
        seconds, out = timed(lambda: self.inner(grads), self.device)
        self.seconds.append(seconds)
        self.gated.append(int(self.inner.stats["gated"]))
        return out

    def clear(self) -> None:
        """Forget the timings and gate counts so far (after the warm-up)."""
        self.seconds.clear()
        self.gated.clear()


def step_summary(t_on: list[float], t_off: list[float], den: list[float], gated: list[int]) -> dict[str, Any]:
    """Medians with quartiles of the ABBA steps; overhead = in-step denoiser time / step without."""
    med_on, med_off, med_dn = statistics.median(t_on), statistics.median(t_off), statistics.median(den)
    return {
        "steps_measured_each": len(t_on),
        "step_s_without": med_off,
        "step_s_with": med_on,
        "denoiser_s_in_step": med_dn,
        "overhead_ratio": med_dn / med_off,
        "overhead_ratio_step_difference": (med_on - med_off) / med_off,
        "step_ratio_with_over_without": med_on / med_off,
        "step_s_without_spread": spread(t_off),
        "step_s_with_spread": spread(t_on),
        "denoiser_s_spread": spread(den),
        "gated_per_step": statistics.mean(gated) if gated else 0.0,
        "raw_step_s_without": t_off,
        "raw_step_s_with": t_on,
        "raw_denoiser_s": den,
    }


def spiked_matrix(m: int, n: int, k: int, s: float, seed: int, device: torch.device) -> torch.Tensor:
    """``s·Z`` plus k orthonormal spikes at 1.5…3 × the BBP threshold (k = 0: pure noise)."""
    gen = torch.Generator().manual_seed(seed)
    g = s * torch.randn(m, n, generator=gen)
    if k:
        u = torch.linalg.qr(torch.randn(m, k, generator=gen))[0]
        v = torch.linalg.qr(torch.randn(n, k, generator=gen))[0]
        lam = s * (m * n) ** 0.25 * torch.linspace(1.5, 3.0, k)
        g += (u * lam) @ v.T
    return g.to(device)


def run_synthetic(
    shapes: Sequence[tuple[int, int]], spikes: Sequence[int], reps: int, device: torch.device, seed: int = 0
) -> dict[str, Any]:
    """Per shape: time of one ``rmt_denoise`` call, gate shut vs open with k spikes (ABBA), and the ratios."""
    s = 0.01
    out: dict[str, Any] = {}
    for m, n in shapes:
        configs: list[tuple[str, torch.Tensor, dict[str, Any]]] = [
            ("shut", spiked_matrix(m, n, 0, s, seed, device), {}),
            ("shut_cholesky_screen", spiked_matrix(m, n, 0, s, seed, device), {"screen": "cholesky"}),
        ]
        configs += [(f"open_k{k}", spiked_matrix(m, n, k, s, seed + k, device), {}) for k in spikes]
        info: dict[str, Any] = {}
        slowest = 0.0
        for name, g, kw in configs:  # warm-up, and the decisions / work counts
            dt, res = timed(lambda g=g, kw=kw: rmt_denoise(g, s, **kw), device)
            slowest = max(slowest, dt)
            info[name] = {"gated": bool(res.gated.all()), "work": res.work}
        # small matrices take milliseconds: repeat until each configuration has about a second of samples
        n_reps = max(reps, min(40, 2 * math.ceil(0.5 / max(slowest, 1e-6))))
        by_name = {name: (g, kw) for name, g, kw in configs}

        def call(i: int, name: str, by_name: dict[str, Any] = by_name) -> Any:
            g, kw = by_name[name]
            return rmt_denoise(g, s, **kw)

        times = timed_steps(call, n_reps, arms=list(by_name), device=device)
        med_shut = statistics.median(times["shut"])
        out[f"{m}x{n}"] = {
            "sigma": s,
            "configs": {name: {"seconds": spread(ts), **info[name]} for name, ts in times.items()},
            "open_over_shut": {f"k{k}": statistics.median(times[f"open_k{k}"]) / med_shut for k in spikes},
            "cholesky_screen_over_krylov_shut": statistics.median(times["shut_cholesky_screen"]) / med_shut,
        }
        row = out[f"{m}x{n}"]
        print(
            f"[synthetic {m}x{n}] shut {med_shut * 1e3:.1f} ms (Cholesky screen "
            f"{statistics.median(times['shut_cholesky_screen']) * 1e3:.1f} ms); open/shut "
            + ", ".join(f"{k} {v:.2f}" for k, v in row["open_over_shut"].items()),
            flush=True,
        )
    return out


def _big_layer(
    dim: int, batch: int, seq: int, device: torch.device, seed: int
) -> tuple[Callable[[int, bool, float], None], Switch, list[torch.Tensor]]:
    """One ``dim × dim`` Linear layer under DP (lr 0; rank ≤ 8 inputs), a switchable ``rmt`` after a pass-through
    that captures the first noisy gradient, and ``step(i, on, nm)``: one DP step at noise multiplier nm."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, 8, generator=gen))[0].T  # (8, dim) orthonormal rows
    n_ex = batch * 4
    inputs = torch.randn(n_ex, seq, 8, generator=gen) @ basis
    targets = torch.randn(n_ex, seq, dim, generator=gen)
    model = nn.Sequential(nn.Linear(dim, dim, bias=False)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=batch)
    switch = Switch(RMTDenoiser(**PAPER_SETTING), device)
    captured: list[torch.Tensor] = []

    class _Capture(Denoiser):
        name = "capture"

        def __call__(self, grads: Sequence[NoisyGradient]) -> None:
            if not captured:
                captured.append(grads[0].tensor.detach().clone())

        def output_noise(self, grads: Sequence[NoisyGradient]) -> float:
            return 1.0  # a pass-through: rmt after it still sees isotropic noise

    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=dl,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        post_hooks=[_Capture(), switch],
    )
    batches = [(x.to(device), y.to(device)) for x, y in dl]
    crit = nn.MSELoss()

    def step(i: int, on: bool, nm: float) -> None:
        switch.on = on
        dp_opt.noise_multiplier = nm
        x, y = batches[i % len(batches)]
        dp_opt.zero_grad(set_to_none=True)
        crit(gsm(x), y).backward()
        dp_opt.step()

    return step, switch, captured


def _big_abba(
    step: Callable[[int, bool, float], None], switch: Switch, plan: list[tuple[str, bool, float]], steps: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """One warm-up pass over ``plan``, then ``steps`` rounds (alternately forward and reversed): step times and
    matrices gated per configuration."""
    by_name = {name: (on, nm) for name, on, nm in plan}
    gates: dict[str, list[int]] = {"shut": [], "open": []}

    def gated(i: int, name: str, seconds: float) -> None:
        if by_name[name][0]:
            gates[name].append(switch.gated[-1])

    times = timed_steps(
        lambda i, name: step(i, *by_name[name]),
        steps,
        arms=list(by_name),
        warmup=len(plan),
        on_start=switch.clear,
        after=gated,
    )
    return times, gates


def run_big_step(dim: int, batch: int, seq: int, steps: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """DP steps of one ``dim × dim`` Linear layer: gate shut, gate open (rank ≤ 8 clean gradient), no denoiser."""
    step, switch, captured = _big_layer(dim, batch, seq, device, seed)
    step(0, False, 1e-12)  # (almost) the clean gradient: its top singular value sets the "open" noise level
    clean_top = float(torch.linalg.matrix_norm(captured[0].float(), ord=2))
    edge_per_nm = float(bulk_edge(1.0 / batch, dim, dim))  # edge for noise multiplier 1 (s = nm·C/B)
    nm_open = clean_top / (2.0 * 1.02 * edge_per_nm)
    nm_shut = 1.0
    plan = [("shut", True, nm_shut), ("open", True, nm_open), ("off", False, nm_shut)]
    times, gates = _big_abba(step, switch, plan, steps)
    med_shut = statistics.median(times["shut"])
    res = {
        "dim": dim,
        "batch": batch,
        "seq": seq,
        "clean_top_singular_value": clean_top,
        "noise_multiplier_open": nm_open,
        "noise_multiplier_shut": nm_shut,
        "step_s": {name: spread(ts) for name, ts in times.items()},
        "gated_per_step": {name: statistics.mean(v) if v else 0.0 for name, v in gates.items()},
        "worst_open_over_median_shut": max(times["open"]) / med_shut,
        "median_open_over_median_shut": statistics.median(times["open"]) / med_shut,
        "shut_over_off": med_shut / statistics.median(times["off"]),
        "denoiser_s": spread(switch.seconds),
    }
    print(
        f"[big {dim}x{dim}] step shut {med_shut:.2f} s, open worst {max(times['open']):.2f} s "
        f"({res['worst_open_over_median_shut']:.2f}x), off {statistics.median(times['off']):.2f} s, gated "
        f"{res['gated_per_step']}",
        flush=True,
    )
    return res
