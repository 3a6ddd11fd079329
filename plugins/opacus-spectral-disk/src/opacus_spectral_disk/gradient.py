"""DiSK's two-point gradient: what a training loop backpropagates instead of one loss.

Per example ξ the gradient that Opacus clips and noises is (DiSK, Zhang et al. 2025)::

    g_{t+½}(ξ) = a·∇f(x_t + γ·d_t; ξ) + (1 − a)·∇f(x_t; ξ),   a = (1 − κ)/(κγ),   d_t = x_t − x_{t−1}

:meth:`DiskGradient.backward` runs the loss twice — at the extrapolated point and at ``x_t`` — and combines the
per-sample gradients Opacus computed (``p.grad_sample``) before the optimizer clips them; the parameters are
restored bit for bit in between. The first step (no ``x_{t−1}`` yet) is an ordinary backward.

A logical step split into physical batches (Opacus's ``BatchMemoryManager``) calls :meth:`~DiskGradient.backward`
once per physical batch at the same ``x_t``: a call whose parameters equal, bit for bit, those of the previous call
belongs to the same logical step and extrapolates along the same ``d_t`` (an optimizer step that leaves every
parameter exactly unchanged is therefore not told apart from a further physical batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["DiskGradient"]


class DiskGradient:
    """Two-point per-example gradient of DiSK for a model wrapped by Opacus (hooks or functorch mode).

    Args:
        model: the (Opacus-wrapped) model whose trainable parameters the optimizer steps.
        kappa, gamma: DiSK's Kalman gain and extrapolation (``a = (1 − κ)/(κγ)``; the reference values 0.7, 0.5).
    """

    def __init__(self, model: nn.Module, kappa: float = 0.7, gamma: float = 0.5) -> None:
        if not 0.0 < kappa <= 1.0 or gamma <= 0:
            raise ValueError(f"need 0 < kappa <= 1 and gamma > 0, got kappa={kappa}, gamma={gamma}")
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        if isinstance(model, GradSampleModuleFastGradientClipping):
            raise ValueError(
                "DiSK's two-point gradient needs per-sample gradients (grad_sample_mode='hooks' or 'functorch'): "
                "fast gradient clipping cannot clip a combination of gradients taken at two points"
            )
        self.model = model
        self.kappa, self.gamma = float(kappa), float(gamma)
        self.a = (1.0 - kappa) / (kappa * gamma)
        self._prev: list[Tensor] | None = None  #: x_{t−1}, the parameters at the previous logical step
        self._at: list[Tensor] | None = None  #: x_t, the parameters of the logical step being computed

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def backward(self, loss_fn: Callable[[], Tensor]) -> Tensor:
        """Backpropagate the two-point gradient of ``loss_fn()`` (a closure over the current batch); returns the
        loss at ``x_t``."""
        params = self._params()
        here = [p.detach().clone() for p in params]
        same_step = (
            self._at is not None
            and len(self._at) == len(params)
            and all(torch.equal(x, at) for x, at in zip(here, self._at, strict=True))
        )
        if not same_step:  # the optimizer moved the parameters: a new logical step, d_t = x_t − x_{t−1}
            self._prev, self._at = self._at, here
        # else another physical batch of the same logical step (BatchMemoryManager): the same x_t and d_t
        if self._prev is not None and self.a != 0.0 and len(self._prev) == len(params):
            with torch.no_grad():
                for p, x, prev in zip(params, here, self._prev, strict=True):
                    p.add_(x - prev, alpha=self.gamma)  # x_t + γ·d_t
            loss_fn().backward()
            ahead = [p.grad_sample.detach().clone() for p in params]
            for p, x in zip(params, here, strict=True):
                p.grad_sample = None
                p.grad = None
                with torch.no_grad():
                    p.copy_(x)  # back to x_t, bit for bit
            loss = loss_fn()
            loss.backward()
            with torch.no_grad():
                for p, g in zip(params, ahead, strict=True):
                    p.grad_sample = self.a * g + (1.0 - self.a) * p.grad_sample
        else:
            loss = loss_fn()
            loss.backward()
        return loss
