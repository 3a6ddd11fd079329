"""DOPPLER (Zhang et al., NeurIPS 2024): an IIR low-pass filter over steps of the noisy gradient.

The formulas and their noise behaviour are in the repository's ``docs/math.md`` §4.1–§4.3.

Per parameter, with its own step counter t (advanced only on steps where the parameter has a gradient):

    m_t = Σ_{τ=0..n_b} b_τ g̃_{t−τ} − Σ_{τ=1..n_a} a_τ m_{t−τ}          (a_0 = 1; g̃, m = 0 before t = 0)
    c_t = Σ_{τ=0..min(t,n_b)} b_τ − Σ_{τ=1..min(t,n_a)} a_τ c_{t−τ}     (the filter's response to a unit step)
    output_t = m_t / c_t                                                    (bias correction, like Adam's)

The DC gain Σb/Σa must be 1 so a constant gradient passes unchanged once the filter has settled.

sigma = 0 is *not* an identity: DOPPLER is a temporal filter (like momentum) and smooths whatever sequence it
is given; the conformance kit is run with ``sigma_zero_identity=False`` for that reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from opacus_spectral.denoisers import Selector

from opacus_spectral import Denoiser, NoisyGradient

#: name -> (a, b). first_order is the example in the DOPPLER paper; second_order is a double pole at 0.8
#: (a = (1 − 0.8z⁻¹)²) with b chosen for unit DC gain.
PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "first_order": ((1.0, -0.9), (0.15, -0.05)),
    "second_order": ((1.0, -1.6, 0.64), (0.04,)),
}


def impulse_response(a: Sequence[float], b: Sequence[float], steps: int) -> list[float]:
    """h_0..h_{steps−1}: the filter's output for a unit impulse at step 0 (its noise gain is ``sqrt(Σ h²)``)."""
    h: list[float] = []
    for t in range(steps):
        v = b[t] if t < len(b) else 0.0
        v -= sum(a[k] * h[t - k] for k in range(1, min(t, len(a) - 1) + 1))
        h.append(v)
    return h


def step_response(a: Sequence[float], b: Sequence[float], steps: int) -> list[float]:
    """c_0..c_{steps−1}: the filter's output for a unit step input (the bias-correction denominators)."""
    c: list[float] = []
    for t in range(steps):
        v = sum(b[k] for k in range(min(t, len(b) - 1) + 1))
        v -= sum(a[k] * c[t - k] for k in range(1, min(t, len(a) - 1) + 1))
        c.append(v)
    return c


class DopplerDenoiser(Denoiser):
    """``"doppler"``: temporal IIR filter with bias correction, stateful per parameter name.

    Args:
        preset: ``"first_order"`` (default) or ``"second_order"``; ignored when ``a`` and ``b`` are given.
        a, b: filter coefficients (``a[0]`` must be 1; DC gain Σb/Σa must be 1).
        roles: roles to filter (default: all, 1-D included; a plain string is one role): its :attr:`selector`, which
            the pipeline applies (it is handed only those records).
        state_dtype: dtype of the history tensors (float32; float64 for float64 gradients).
    """

    #: it averages the noise over steps as if independent: a correlated noise mechanism is refused (docs/mechanisms.md)
    assumes_independent_noise = True

    name = "doppler"
    temporal = True

    def __init__(
        self,
        preset: str = "first_order",
        a: Sequence[float] | None = None,
        b: Sequence[float] | None = None,
        roles: str | Sequence[str] | None = None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if (a is None) != (b is None):
            raise ValueError("give both a and b, or a preset")
        if a is None:
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
            a, b = PRESETS[preset]
        a, b = tuple(float(x) for x in a), tuple(float(x) for x in b)  # type: ignore[arg-type]
        if not a or a[0] != 1.0 or not b:
            raise ValueError("a must start with a_0 = 1 and b must be non-empty")
        if abs(sum(b) / sum(a) - 1.0) > 1e-9:
            raise ValueError(f"DC gain Σb/Σa = {sum(b) / sum(a):.6g}; it must be 1")
        self.a, self.b = a, b
        self.selector = Selector.build(roles=roles)
        self.state_dtype = state_dtype
        self._c = step_response(a, b, 1)
        self._h2: list[float] = []  #: cumulative Σ_{j≤t} h_j²
        self._gains: list[float | str] = []
        self.reset()

    @property
    def roles(self) -> frozenset[str] | None:
        return self.selector.roles

    def reset(self) -> None:
        #: per parameter: t, past inputs g̃_{t−1..t−n_b}, past outputs m_{t−1..t−n_a}
        self.t: dict[str, int] = {}
        self.sigma: dict[str, float] = {}  #: the noise std this parameter's history was filtered with
        self.x_hist: dict[str, list[torch.Tensor]] = {}
        self.y_hist: dict[str, list[torch.Tensor]] = {}

    def _gain_at(self, t: int) -> float:
        """Output noise std / input noise std at (0-based) step ``t`` for a constant input std: ``‖h_{0..t}‖₂/c_t``."""
        if t >= len(self._h2):
            h = impulse_response(self.a, self.b, max(t + 1, 2 * len(self._h2)))
            acc, self._h2 = 0.0, []
            for v in h:
                acc += v * v
                self._h2.append(acc)
        return self._h2[t] ** 0.5 / self._c_at(t)

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        """Per filtered record ``‖h‖₂/c_t`` (exact while its noise std stays the same; ``"unknown"`` once it
        changed), 1 for the others (docs: opacus-spectral ``docs/math.md`` §4.2)."""
        return list(self._gains) if len(self._gains) == len(grads) else ["unknown"] * len(grads)

    def _c_at(self, t: int) -> float:
        if t >= len(self._c):
            self._c = step_response(self.a, self.b, max(t + 1, 2 * len(self._c)))
        return self._c[t]

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(grads)
        self._gains = [1.0] * len(grads)
        sel = [i for i, g in enumerate(grads) if g.tensor.numel()]  # the pipeline hands it only what it selects
        if not sel:
            return out
        nb, na = len(self.b) - 1, len(self.a) - 1
        xs = [grads[i].tensor.detach().to(self._dtype(grads[i].tensor)) for i in sel]
        names = [grads[i].name for i in sel]
        for name, x in zip(names, xs, strict=True):
            if name not in self.t or self.x_hist[name] and self.x_hist[name][0].shape != x.shape:
                self.t[name] = 0
                self.sigma[name] = float("nan")
                self.x_hist[name] = [torch.zeros_like(x) for _ in range(nb)]
                self.y_hist[name] = [torch.zeros_like(x) for _ in range(na)]
        # m = b0·x + Σ b_τ·x_{t−τ} − Σ a_τ·m_{t−τ}: batched across parameters with foreach kernels
        m = torch._foreach_mul(xs, self.b[0])
        for k in range(1, nb + 1):
            torch._foreach_add_(m, [self.x_hist[n][k - 1] for n in names], alpha=self.b[k])
        for k in range(1, na + 1):
            torch._foreach_add_(m, [self.y_hist[n][k - 1] for n in names], alpha=-self.a[k])
        corrected = torch._foreach_div(m, [self._c_at(self.t[n]) for n in names])
        for j, (i, name) in enumerate(zip(sel, names, strict=True)):
            if nb:
                self.x_hist[name] = [xs[j].clone()] + self.x_hist[name][:-1]
            if na:
                self.y_hist[name] = [m[j]] + self.y_hist[name][:-1]
            s = float(grads[i].sigma)
            if self.t[name] == 0:
                self.sigma[name] = s
            constant = self.sigma.get(name) == s  # the exact gain assumes one noise std over the history
            self._gains[i] = self._gain_at(self.t[name]) if constant else "unknown"
            self.t[name] += 1
            out[i] = corrected[j].to(grads[i].tensor.dtype)
        self.stats = {"filtered": len(sel)}
        return out

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return torch.float64 if t.dtype == torch.float64 else self.state_dtype

    def state_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "t": dict(self.t),
            "sigma": dict(self.sigma),
            "x_hist": {k: [x.clone() for x in v] for k, v in self.x_hist.items()},
            "y_hist": {k: [y.clone() for y in v] for k, v in self.y_hist.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if tuple(state["a"]) != self.a or tuple(state["b"]) != self.b:
            raise ValueError(
                f"state was saved with a={state['a']}, b={state['b']}; this filter has a={self.a}, b={self.b}"
            )
        self.t = dict(state["t"])
        self.sigma = {k: float(v) for k, v in state.get("sigma", {}).items()}
        self.x_hist = {k: [x.clone() for x in v] for k, v in state["x_hist"].items()}
        self.y_hist = {k: [y.clone() for y in v] for k, v in state["y_hist"].items()}
