"""The precision DP-SGD's clipping runs in under a ``DPTrainer`` with ``bf16=True`` (``docs/llm.md``, "bf16").

Under bf16 autocast Opacus' grad samplers compute each example's gradient from bfloat16 activations and
backprops, so ``p.grad_sample`` is bfloat16, and ``DPOptimizer.clip_and_accumulate`` takes the per-example norms
of those bfloat16 tensors in bfloat16: the clip factor ``C / norm`` is then off by up to bfloat16's rounding and a
clipped example's norm exceeds C (up to 1.007·C measured on the tiny Llama of
``tests/opacus_spectral/test_trainer_causal_lm.py``),
so the sensitivity the accountant assumes no longer holds. :func:`upcast_grad_samples` turns the per-sample
gradients into the parameter's float32 before clipping: norms, clip factors, the clipped sum, the noise and the
released gradient are then float32, which is also what the post-noise denoisers receive.

Refused (:func:`check_trainable_dtypes`): trainable parameters in float16 / bfloat16 (Opacus clips, noises and
releases in the parameter's dtype). Ghost clipping under bf16 is refused by :mod:`.trainer_checks`: its norms come
from bfloat16 activations and backprops, and the clipped gradient from a second bfloat16 backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LOW_PRECISION", "check_trainable_dtypes", "upcast_grad_samples"]

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


def upcast_grad_samples(params: Iterable[torch.nn.Parameter]) -> None:
    """Cast each parameter's per-sample gradient(s) to the parameter's dtype (float32), in place of the
    bfloat16 ones, before Opacus takes their norms."""
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if torch.is_tensor(gs) and gs.dtype != p.dtype:
            p.grad_sample = gs.to(p.dtype)
        elif isinstance(gs, list) and any(g.dtype != p.dtype for g in gs):
            p.grad_sample = [g.to(p.dtype) for g in gs]
