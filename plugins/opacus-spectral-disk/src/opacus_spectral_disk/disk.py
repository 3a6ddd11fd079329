"""The DiSK update as a post-noise denoiser: ``g_t = (1 − κ)·g_{t−1} + κ·g~_t`` per parameter.

``g_0 = g~_0`` (the first noisy gradient of a parameter); the state advances only on steps where the parameter
has a gradient. The output noise is i.i.d. across entries with per-entry std ``sqrt(v_t)``,
``v_t = (1 − κ)²·v_{t−1} + κ²·s_t²``, ``v_0 = s_0²`` (exact for independent steps), which
:meth:`DiskDenoiser.output_noise` declares.

The denoiser also offers DiSK's two-point gradient with the same κ (and its γ) as the training loop's gradient
estimator (:meth:`DiskDenoiser.gradient_estimator`, opacus-spectral's ``docs/plugins.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from opacus_spectral import Denoiser, NoisyGradient

from .gradient import DiskGradient

__all__ = ["DiskDenoiser"]


class DiskDenoiser(Denoiser):
    """``"disk"``: the Kalman update of DiSK with gain ``kappa`` in (0, 1] (1: identity).

    ``gamma`` (> 0, the reference value 0.5) is the extrapolation of the two-point gradient it offers the training
    loop (:meth:`gradient_estimator`); the Kalman update itself does not use it.
    """

    #: it averages the noise over steps as if independent: a correlated noise mechanism is refused (docs/mechanisms.md)
    assumes_independent_noise = True

    name = "disk"
    temporal = True
    estimator_grad_sample_modes = ("hooks", "functorch")  #: per-sample gradients (:class:`DiskGradient`)

    def __init__(self, kappa: float = 0.7, state_dtype: torch.dtype = torch.float32, gamma: float = 0.5) -> None:
        super().__init__()
        if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not 0.0 < kappa <= 1.0:
            raise ValueError(f"kappa must be a number in (0, 1], got {kappa!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
            raise ValueError(f"gamma must be a number > 0, got {gamma!r}")
        self.kappa = float(kappa)
        self.gamma = float(gamma)
        self.state_dtype = state_dtype
        self._gains: list[float | str] = []
        self.reset()

    def gradient_estimator(self, module: nn.Module) -> DiskGradient:
        """DiSK's two-point gradient for the Opacus-wrapped ``module`` with this denoiser's κ and γ."""
        return DiskGradient(module, kappa=self.kappa, gamma=self.gamma)

    def reset(self) -> None:
        self.g: dict[str, Tensor] = {}
        self.v: dict[str, float] = {}

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(grads)
        self._gains = [1.0] * len(grads)
        sel = [i for i, r in enumerate(grads) if r.tensor.numel()]
        k = self.kappa
        fresh, update = [], []
        for i in sel:
            r = grads[i]
            x = r.tensor.detach().to(torch.float64 if r.tensor.dtype == torch.float64 else self.state_dtype)
            s = float(r.sigma)
            if r.name not in self.g or self.g[r.name].shape != x.shape:
                self.g[r.name], self.v[r.name] = x.clone(), s * s
                fresh.append(i)
            else:
                update.append((i, x))
                self.v[r.name] = (1 - k) ** 2 * self.v[r.name] + k * k * s * s
            out_std = math.sqrt(self.v[r.name])
            self._gains[i] = out_std / s if s > 0 else (1.0 if out_std == 0 else "unknown")
        if update:  # batched across parameters
            states = [self.g[grads[i].name] for i, _ in update]
            torch._foreach_mul_(states, 1.0 - k)
            torch._foreach_add_(states, [x for _, x in update], alpha=k)
        for i in sel:
            out[i] = self.g[grads[i].name].to(grads[i].tensor.dtype)
        self.stats = {"filtered": len(sel)}
        return out

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        return list(self._gains) if len(self._gains) == len(grads) else ["unknown"] * len(grads)

    def state_dict(self) -> dict[str, Any]:
        return {"kappa": self.kappa, "g": {k: v.clone() for k, v in self.g.items()}, "v": dict(self.v)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if float(state["kappa"]) != self.kappa:
            raise ValueError(f"state was saved with kappa={state['kappa']}; this denoiser has kappa={self.kappa}")
        self.g = {k: v.clone() for k, v in state["g"].items()}
        self.v = {k: float(v) for k, v in state["v"].items()}
