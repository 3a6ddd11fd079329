"""The noise certificate (``docs/mechanisms.md``, "The noise certificate"; DESIGN invariant 11): at every DP step,
before the update, the engine compares the noise it *released* with the noise it *charged*.

The realized noise is r_t = (released gradient × B·k) − clipped sum (``p.grad`` and ``p.summed_grad`` at the step
hook, on the rank that adds the noise), so whatever wrote ``p.grad`` — the engine's stream, Opacus' ``add_noise``, a
subclassed optimizer or a patched method — is what is measured. For a strategy c (DP-SGD: c = (1,)) and charged
per-entry std s = σ·C, a correct release has, exactly:

* marginal: every entry of r_t ~ N(0, s²ρ_t²), ρ_t = ‖row_t(M⁻¹)‖ — tested over all d coordinates;
* whitened: w_t = Σ_j c_j r_{t−j} = s·z_t, white — tested on K secret coordinates per tensor (drawn from OS
  entropy): its variance per step, its lag-1 correlation with w_{t−1} (a replayed draw has correlation 1), and the
  variance summed over the run (so a small model's deficit is caught after a few steps).

Each test is a χ² tail bound (Laurent–Massart: P(χ²_n − n ≥ 2√(nx) + 2x) ≤ e^{−x}, P(n − χ²_n ≥ 2√(nx)) ≤ e^{−x})
at x = 30, so a correct run fails a step with probability below 10⁻¹²; with d = 10⁴ coordinates the marginal test
catches a std 5.5 % below the charge. The statistics stay on the tensors' device; on a CPU they are checked at once, on
an accelerator by ``torch._assert_async`` before the update, with the message at the next check. The coordinates it
keeps of the last b − 1 steps' noise are as secret as the noise stream's buffers: held in memory only, never saved,
logged or shown (its messages give ratios of variances).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from typing import Any

import torch
from opacus.optimizers import DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping

from ..errors import NoiseCertificateError
from ..step.noise_std import effective_noise_multiplier
from .strategy import BandedToeplitz, RowNorms

__all__ = ["CERTIFICATE_ATTR", "NoiseCertificate", "SAMPLE_PER_TENSOR", "TAIL", "certificate_of"]

CERTIFICATE_ATTR = "_opacus_spectral_noise_certificate"  #: the DPOptimizer's certificate (``make_private`` sets it)

TAIL = 30.0  #: x of the tail bounds: each test fails a correct step with probability ≤ e^{−x} (one-sided)
SAMPLE_PER_TENSOR = 1024  #: secret coordinates of each tensor whitened across steps


def certificate_of(optimizer: Any) -> NoiseCertificate | None:
    """The noise certificate ``make_private`` put on ``optimizer`` (``None``: a hand-built DPOptimizer)."""
    return getattr(optimizer, CERTIFICATE_ATTR, None)


def chi2_bounds(n: float, x: float = TAIL) -> tuple[float, float]:
    """(lo, hi) for χ²_n / n: outside it with probability ≤ e^{−x} on each side (Laurent & Massart 2000, Lemma 1)."""
    return 1 - 2 * math.sqrt(x / n), 1 + 2 * math.sqrt(x / n) + 2 * x / n


def product_bound(n: float, x: float = TAIL) -> float:
    """|Σ_i a_i b_i| / (n s²) for 2n independent N(0, s²): at most this with probability ≥ 1 − 4e^{−x}
    (a·b = ((a + b)² − (a − b)²)/4, two independent χ²_n)."""
    return (2 * math.sqrt(n * x) + 2 * x) / n


class NoiseCertificate:
    """Certifies each step's released noise against strategy ``coefficients`` (κ-free: the whitened noise is s·z)."""

    def __init__(self, coefficients: Sequence[float] = (1.0,)) -> None:
        self.strategy = BandedToeplitz(tuple(coefficients))
        self.row = RowNorms(self.strategy)  #: ‖row_t(M⁻¹)‖, the released noise's std at step t in units of σC
        self._seed = int.from_bytes(os.urandom(8), "big") >> 1  # the sample's coordinates: unknown to the loop
        self.reset()

    def reset(self) -> None:
        """A fresh stream (a resumed run): the strategy restarts at its step 0."""
        self.t = 0
        self._sample: dict[int, torch.Tensor] = {}
        self._history: dict[int, list[tuple[int, torch.Tensor]]] = {}  # per tensor: its last b − 1 sampled r_t
        self._last_white: dict[int, tuple[int, torch.Tensor]] = {}  # per tensor: its last whitened sample
        self._total = [0.0, 0]  # Σ‖w‖²/s² and the count of whitened entries, over the run
        self._pending: list[tuple[str, torch.Tensor, float, float]] = []
        self._last: tuple[Any, Any] = (None, None)

    def check(self, optimizer: Any) -> None:
        """Certify the step whose noise ``optimizer`` has just released (from its step hook); raise
        :class:`~opacus_spectral.errors.NoiseCertificateError` before its update if it fails."""
        self._report()
        first = next((p.grad for p in optimizer.params if p.grad is not None), None)
        if first is not None and first is self._last[0] and first._version == self._last[1]:
            return  # the same release seen twice (a doubled hook): one step
        self._last = (first, None if first is None else first._version)  # held: its id cannot be reused meanwhile
        t, self.t = self.t, self.t + 1
        if isinstance(optimizer, (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping)):
            if int(getattr(optimizer, "rank", 0)) != 0:
                return  # the rank that adds no noise: nothing released here
        s = effective_noise_multiplier(optimizer) * float(optimizer.max_grad_norm)
        if not s > 0:
            return  # no noise charged (a non-private run): nothing to certify
        unscale = 1.0
        if optimizer.loss_reduction == "mean":
            unscale = float(optimizer.expected_batch_size) * float(optimizer.accumulated_iterations)
        params = [p for p in optimizer.params if p.grad is not None and getattr(p, "summed_grad", None) is not None]
        if not params:
            return
        realized = [(p.grad.detach().float() * unscale - p.summed_grad.detach().float()).reshape(-1) for p in params]
        if realized[0].device.type == "cpu" and not all(bool(torch.isfinite(r).all()) for r in realized):
            return  # a non-finite gradient releases no number: the pipeline's on_nonfinite_grad decides the step
        self._marginal(realized, params, s, unscale, t)
        self._whitened(realized, params, s, t)

    # -- the tests --------------------------------------------------------------------------------------------
    def _marginal(self, realized: list[torch.Tensor], params: list[Any], s: float, unscale: float, t: int) -> None:
        d = sum(r.numel() for r in realized)
        charged = (s * self.row(t)) ** 2
        squares = torch.stack(torch._foreach_norm(realized)).square().sum()
        # float rounding of p.grad = (sum + noise)/(B·k) and back: a few ulps of the released entries
        eps = max(torch.finfo(p.grad.dtype).eps for p in params)
        grads = [p.grad.detach().float() for p in params]
        released = torch.stack(torch._foreach_norm(grads)).square().sum() * unscale**2
        slack = (8 * eps) ** 2 * released / (d * charged)
        lo, hi = chi2_bounds(d)
        self._expect("marginal", squares / (d * charged), lo - slack, hi + slack)

    def _whitened(self, realized: list[torch.Tensor], params: list[Any], s: float, t: int) -> None:
        c, b = self.strategy.coefficients, self.strategy.bands
        power, lag, entries, lag_entries = [], [], 0, 0
        for p, r in zip(params, realized, strict=True):
            key = id(p)
            idx = self._sample.get(key)
            if idx is None or idx.device != r.device:
                idx = self._sample[key] = _coordinates(r.numel(), self._seed ^ len(self._sample), r.device)
            v = r.index_select(0, idx).double()
            past = self._history.setdefault(key, [])
            steps = {step: value for step, value in past}
            needed = [t - j for j in range(1, min(t, b - 1) + 1)]
            if all(u in steps for u in needed):
                w = c[0] * v
                for j, u in enumerate(needed, start=1):
                    w = w + c[j] * steps[u]
                power.append(w.square().sum())
                entries += w.numel()
                prior = self._last_white.get(key)
                if prior is not None and prior[0] == t - 1:
                    lag.append((w * prior[1]).sum())
                    lag_entries += w.numel()
                self._last_white[key] = (t, w)
            past.append((t, v))
            del past[: max(0, len(past) - (b - 1))]
        if entries:
            total = torch.stack(power).sum() / s**2
            lo, hi = chi2_bounds(entries)
            self._expect("whitened", total / entries, lo, hi)
            self._total[0] = self._total[0] + total
            self._total[1] += entries
            lo, hi = chi2_bounds(self._total[1])
            self._expect("whitened over the run", self._total[0] / self._total[1], lo, hi)
        if lag_entries:
            bound = product_bound(lag_entries)
            self._expect("lag-1 correlation", torch.stack(lag).sum() / (lag_entries * s**2), -bound, bound)

    # -- checking -----------------------------------------------------------------------------------------------
    def _expect(self, what: str, value: Any, lo: Any, hi: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
            _verdict(what, float(value), float(lo), float(hi), self.t - 1)
            return
        ok = (value >= lo) & (value <= hi)
        torch._assert_async(ok, f"opacus_spectral: the noise certificate failed ({what})")
        self._pending.append((what, value, lo, hi))

    def _report(self) -> None:
        """The accelerator's statistics of the previous step, read now (one step late, never on the hot path's
        critical sync): the message of a failure ``torch._assert_async`` already stopped."""
        pending, self._pending = self._pending, []
        for what, value, lo, hi in pending:
            _verdict(what, float(value), float(lo), float(hi), self.t - 1)


def _verdict(what: str, value: float, lo: float, hi: float, step: int) -> None:
    if lo <= value <= hi and math.isfinite(value):
        return
    if what == "lag-1 correlation":
        found = f"a lag-1 correlation of {value:.4f} between consecutive steps' whitened noise (bound ±{hi:.4f})"
    else:
        found = f"a {what} noise variance of {value:.4f}× the charged one (accepted: [{max(lo, 0):.4f}, {hi:.4f}])"
    raise NoiseCertificateError(
        f"noise certificate, DP step {step}: the released noise has {found}. The step released other noise than "
        "the accountant was charged for (a plugin, a subclassed optimizer or a patched add_noise?); it is stopped "
        "before its update"
    )


def _coordinates(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Up to :data:`SAMPLE_PER_TENSOR` distinct coordinates of a tensor of ``n`` entries, from a secret seed."""
    picked = random.Random(seed).sample(range(n), min(n, SAMPLE_PER_TENSOR))  # O(k) memory: no permutation of n
    return torch.tensor(picked, dtype=torch.long, device=device)
