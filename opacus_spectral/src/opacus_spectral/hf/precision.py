"""The parameter dtypes a ``DPTrainer`` trains (``docs/llm.md``, "bf16").

Under bf16 autocast the engine clips each example's gradient in float32 (:mod:`~opacus_spectral.step.precision`), which
needs float32 parameters: :func:`check_trainable_dtypes` refuses trainable parameters in float16 / bfloat16 (Opacus
would clip, noise and release in that dtype, and a clipped norm could exceed C by the rounding). Ghost clipping under
bf16 is refused by :mod:`~opacus_spectral.hf.checks`: its norms come from bfloat16 activations and backprops, and the
clipped gradient from a second bfloat16 backward pass.
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION", "check_trainable_dtypes"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_trainable_dtypes(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when a parameter the optimizer trains is float16 / bfloat16."""
    low = sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"] if p.dtype in LOW_PRECISION})
    if low:
        raise ValueError(
            f"DPTrainer cannot train parameters in {low}: Opacus would clip each example's gradient, add the noise "
            "and release the gradient in that dtype, and a clipped norm can exceed max_grad_norm by its rounding. "
            "Keep the trained (e.g. LoRA) weights float32 — PEFT does by default (autocast_adapter_dtype=True) — "
            "and use bf16=True (autocast) or a bfloat16 base model for speed."
        )
