"""``"ema"``: an exponential moving average of the noisy gradients over steps, per parameter.

Per parameter, with its own step counter ``t`` (advanced only on steps where the parameter has a gradient, so
alternating LoRA factors average their own steps)::

    m_t = β·m_{t−1} + (1 − β)·g~_t,        output_t = m_t / (1 − β^t)   (bias correction, like Adam's)

The state is the raw average; only the output is bias-corrected, and a later denoiser (``post_hooks=["ema",
"rmt"]``) works on a copy of the output, never on the state. The noise of the output is still i.i.d. Gaussian
across entries within a step (a linear combination of independent Gaussian steps), with per-entry std
``sqrt(v_t)/(1 − β^t)``, ``v_t = β²·v_{t−1} + (1 − β)²·s_t²`` (exact, also when ``s_t`` changes over steps;
``s·sqrt((1−β)/(1+β))`` once settled, ``docs/math.md`` §4.1). :meth:`EMADenoiser.output_noise` declares it,
so a spectral denoiser after it uses the right noise level.

Where it fits: with SGD *without* momentum (the momentum lives here, and the released update can be
denoised), or with Adam/AdamW (their own first moment then averages a denoised average). ``sigma = 0`` is not an
identity: it is a temporal filter of whatever sequence it is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..step.records import NoisyGradient
from ..step.selection import ParamFilter, Selector
from .base import Denoiser

__all__ = ["EMADenoiser"]


class EMADenoiser(Denoiser):
    """Exponential moving average of each parameter's noisy gradient (module docstring).

    Args:
        beta: the averaging factor β in [0, 1) (0: identity).
        bias_correction: divide by ``1 − β^t`` (default), so the first outputs are not shrunk toward zero.
        roles: roles to average (default: all, 1-D included; a plain string is one role).
        params: optional name filter: a substring, substrings (any match) or a predicate on the name.
        state_dtype: dtype of the averages (float32; float64 inputs are averaged in float64).
    """

    #: it averages the noise over steps as if independent: a correlated noise mechanism is refused (docs/mechanisms.md)
    assumes_independent_noise = True

    name = "ema"
    temporal = True

    def __init__(
        self,
        beta: float = 0.9,
        *,
        bias_correction: bool = True,
        roles: str | Iterable[str] | None = None,
        params: ParamFilter = None,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be a number in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.bias_correction = bool(bias_correction)
        #: the records it averages (applied by the pipeline)
        self.selector = Selector.build(roles=roles, params=params)
        self.state_dtype = state_dtype
        self._gains: list[float | str] = []
        self.reset()

    def reset(self) -> None:
        self.m: dict[str, Tensor] = {}  #: raw averages
        self.t: dict[str, int] = {}  #: steps averaged, per parameter
        self.v: dict[str, float] = {}  #: output-noise variance recursion (before bias correction)

    @property
    def roles(self) -> frozenset[str] | None:
        return self.selector.roles

    @property
    def params(self) -> ParamFilter:
        return self.selector.params

    def _dtype(self, t: Tensor) -> torch.dtype:
        return torch.float64 if t.dtype == torch.float64 else self.state_dtype

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(grads)
        self._gains = [1.0] * len(grads)
        sel = [i for i, g in enumerate(grads) if g.tensor.numel()]  # the pipeline hands it only what it selects
        if not sel:
            self.stats = {"averaged": 0}
            return out
        beta = self.beta
        xs = [grads[i].tensor.detach().to(self._dtype(grads[i].tensor)) for i in sel]
        names = [grads[i].name for i in sel]
        for name, x in zip(names, xs, strict=True):
            if name not in self.m or self.m[name].shape != x.shape or self.m[name].dtype != x.dtype:
                self.m[name] = torch.zeros_like(x)
                self.t[name], self.v[name] = 0, 0.0
        ms = [self.m[n] for n in names]
        torch._foreach_mul_(ms, beta)
        torch._foreach_add_(ms, xs, alpha=1.0 - beta)
        corrs = []
        for i, name in zip(sel, names, strict=True):
            self.t[name] += 1
            s = float(grads[i].sigma)
            self.v[name] = beta * beta * self.v[name] + (1.0 - beta) ** 2 * s * s
            corr = 1.0 - beta ** self.t[name] if self.bias_correction else 1.0
            corrs.append(corr)
            out_std = math.sqrt(self.v[name]) / corr
            self._gains[i] = out_std / s if s > 0 else (1.0 if out_std == 0 else "unknown")
        outputs = torch._foreach_div(ms, corrs)
        for i, o in zip(sel, outputs, strict=True):
            out[i] = o.to(grads[i].tensor.dtype)
        self.stats = {"averaged": len(sel)}
        return out

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        """Per record: ``sqrt(v_t)/(1 − β^t)/s_t`` for the averaged ones (exact), 1 for the others."""
        return list(self._gains) if len(self._gains) == len(grads) else ["unknown"] * len(grads)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "bias_correction": self.bias_correction,
            "m": {k: v.clone() for k, v in self.m.items()},
            "t": dict(self.t),
            "v": dict(self.v),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if float(state["beta"]) != self.beta or bool(state["bias_correction"]) != self.bias_correction:
            raise ValueError(
                f"state was saved with beta={state['beta']}, bias_correction={state['bias_correction']}; this "
                f"denoiser has beta={self.beta}, bias_correction={self.bias_correction}"
            )
        self.m = {k: v.clone() for k, v in state["m"].items()}
        self.t = {k: int(v) for k, v in state["t"].items()}
        self.v = {k: float(v) for k, v in state["v"].items()}

    def __repr__(self) -> str:
        return f"EMADenoiser(beta={self.beta}, bias_correction={self.bias_correction})"
