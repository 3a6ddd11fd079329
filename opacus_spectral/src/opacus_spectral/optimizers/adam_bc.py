"""DP-AdamBC: Adam with the DP noise's variance removed from its second moment (Tang, Shpilevskiy and Lécuyer,
"DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)", AAAI 2024, arXiv 2312.14334).

The released gradient g̃_t = g_t + n_t carries noise of known per-entry variance Φ_t: (σC/B)² under DP-SGD, times
‖row_t(M⁻¹)‖² under BandMF (``docs/mechanisms.md``), read from the engine's noise model
(:func:`~opacus_spectral.step.noise_std.noise_std`). Adam's v̂_t then estimates E[g²] + Φ̄_t, where Φ̄_t is Φ's
average with v̂'s own weights, Φ̄_t = Σ_k (1 − β₂)β₂^{t−k} Φ_k / (1 − β₂^t) (= Φ when Φ is constant: the paper's
case). The update is

    θ_t = θ_{t−1} − η·(m̂_t / √max(v̂_t − Φ̄_t, γ′) + λ·θ_{t−1})

(the paper's Algorithm with decoupled weight decay λ as AdamW's). γ′ has no default: every coordinate whose corrected
second moment is below it moves by η·m̂/√γ′, so it sets the step size wherever the noise dominates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..step.attachment import BEFORE_INNER_STEP, PIPELINE, attachment
from ..step.noise_std import noise_std

__all__ = ["DPAdamBC", "attach_noise_variance", "check_denoisers"]


class DPAdamBC(torch.optim.Optimizer):
    """DP-AdamBC (module docstring). Use it as the optimizer given to ``make_private``: the engine sets
    :attr:`noise_variance` (Φ_t) before every DP step; stepping it without that is refused."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        *,
        gamma: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if not (isinstance(gamma, (int, float)) and gamma > 0):
            raise ValueError(
                f"DPAdamBC: gamma (γ′, the floor of the corrected second moment) must be > 0, got {gamma!r}"
            )
        if not (lr >= 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1 and weight_decay >= 0):
            raise ValueError(
                f"DPAdamBC: need lr >= 0, betas in [0, 1), weight_decay >= 0; got {lr}, {betas}, {weight_decay}"
            )
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "gamma": float(gamma), "weight_decay": weight_decay})
        #: Φ_t, the per-entry variance of the DP noise in this step's gradients (set by the engine each step)
        self.noise_variance: float | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else torch.enable_grad()(closure)()
        phi, self.noise_variance = self.noise_variance, None
        if phi is None:
            raise RuntimeError(
                "DPAdamBC needs the DP noise variance of each step, which the engine sets: pass it to "
                "PrivacyEngine.make_private as the optimizer and step the DPOptimizer it returns"
            )
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, float(phi))
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], phi: float) -> None:
        """One coordinate-wise DP-AdamBC update of ``p`` (module docstring)."""
        (b1, b2), state = group["betas"], self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), noise_avg=0.0)
        state["step"] += 1
        t = state["step"]
        state["exp_avg"].lerp_(p.grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        state["noise_avg"] = b2 * state["noise_avg"] + (1 - b2) * phi
        m_hat = state["exp_avg"] / (1 - b1**t)
        excess = state["exp_avg_sq"] / (1 - b2**t) - state["noise_avg"] / (1 - b2**t)
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(m_hat, excess.clamp_(min=group["gamma"]).sqrt_(), value=-group["lr"])


def attach_noise_variance(dp_optimizer: Any) -> Any:
    """Tell ``dp_optimizer``'s inner :class:`DPAdamBC` the noise variance of every noisy DP step (after noise,
    scaling, the accountant and the DDP all-reduce); returns the subscription."""
    inner = dp_optimizer.original_optimizer

    def before_inner_step(step: Any) -> None:
        if step.noised:
            inner.noise_variance = noise_std(dp_optimizer) ** 2

    return attachment(dp_optimizer).subscribe(BEFORE_INNER_STEP, before_inner_step, order=PIPELINE - 1)


def check_denoisers(optimizer: Any, post_hooks: Any) -> None:
    """DP-AdamBC subtracts the variance of the noise the engine added; a denoiser changes that noise (by an amount
    nobody knows), so the two are refused together."""
    if isinstance(optimizer, DPAdamBC) and post_hooks:
        raise ValueError(
            "DPAdamBC subtracts the known variance of the DP noise from Adam's second moment, but post_hooks "
            "denoisers change the noise by an unknown amount: use DPAdamBC without post_hooks, or torch.optim.Adam "
            "with them"
        )
