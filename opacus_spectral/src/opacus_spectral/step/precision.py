"""Clipping exact in every precision (``docs/engine.md``, "Reduced precision"; DESIGN invariant 8).

Under bf16 / fp16 autocast Opacus' grad samplers (hooks mode) compute each example's gradient from reduced-precision
activations and backprops, so ``p.grad_sample`` is bfloat16 / float16, and ``DPOptimizer.clip_and_accumulate`` takes
the per-example norms and applies the clip factor ``C / norm`` in that dtype: a clipped example's contribution then
exceeds C by the rounding (measured on an MLP: 1.0076·C in bf16, 1.0028·C in fp16), and the sensitivity the
accountant assumes no longer holds. The engine casts the per-sample gradients to the parameter's dtype (float32)
at the start of every physical batch's ``pre_step``, before Opacus clips: norms, clip factors, the clipped sum, the
noise and the released gradient are float32; each record's contribution has norm ≤ C up to float32 rounding
(≤ C·(1 + 1e-6), tests/opacus_spectral/test_privacy_matrix.py). Parameters that are themselves float16 / bfloat16
are left as Opacus has them (``DPTrainer`` refuses them: :mod:`~opacus_spectral.hf.precision`).

Ghost clipping computes the norms inside the backward pass from reduced-precision activations and applies the clip
factor in a second reduced-precision backward (measured 1.011·C in bf16): it cannot be made exact from outside, so a
training forward under autocast in ghost mode is refused. So is one in ``"ew"`` mode, where torch's ExpandedWeights
fail under autocast with a raw dtype error (``expected m1 and m2 to have the same dtype``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from .attachment import PHYSICAL_BATCH, PRECISION, attachment
from .copies import InertOnCopy

__all__ = ["AUTOCAST_REFUSED", "PrecisionGuard", "install_precision_guard", "upcast_grad_samples"]

#: why a grad-sample mode cannot train under autocast, by mode
AUTOCAST_REFUSED = {
    "ghost": "ghost clipping under {dtype} autocast: Opacus computes the per-example norms from {dtype} activations "
    "and applies the clip factor in a second {dtype} backward pass, so a clipped example can exceed max_grad_norm "
    "(measured 1.011·C in bf16) and the sensitivity the accountant assumes does not hold",
    "ew": "grad_sample_mode='ew' under {dtype} autocast: torch's ExpandedWeights multiply {dtype} activations with "
    "float32 weights and fail",
}
_FIX = ". Use grad_sample_mode='hooks' (per-sample gradients clipped in float32) or train without autocast."
_FLOAT = (torch.float32, torch.float64)


def upcast_grad_samples(params: Iterable[torch.nn.Parameter]) -> None:
    """Cast each float32/64 parameter's reduced-precision per-sample gradient(s) to the parameter's dtype."""
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if p.dtype not in _FLOAT:
            continue
        if torch.is_tensor(gs) and gs.dtype != p.dtype:
            p.grad_sample = gs.to(p.dtype)
        elif isinstance(gs, list) and any(g.dtype != p.dtype for g in gs):
            p.grad_sample = [g.to(p.dtype) for g in gs]


def uneven_rows(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters whose per-sample gradient's first dimension is not the one most of the others share (what Opacus
    stacks per record: a mismatch is its raw "stack expects each tensor to be equal size")."""
    rows: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if torch.is_tensor(gs) and gs.dim() > 0:
            rows.setdefault(int(gs.shape[0]), []).append(p)
    if len(rows) < 2:
        return []
    common = max(rows, key=lambda k: len(rows[k]))
    return [p for k, group in rows.items() if k != common for p in group]


class PrecisionGuard:
    """The upcast on ``PHYSICAL_BATCH``; in ghost and ew modes, a forward pre-hook refusing autocast."""

    def __init__(self, dp_optimizer: DPOptimizer, module: nn.Module, *, mode: str) -> None:
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._handles: list[Any] = [attachment(dp_optimizer).subscribe(PHYSICAL_BATCH, self._upcast, order=PRECISION)]
        if mode in AUTOCAST_REFUSED:
            self.mode = mode
            self._handles.append(module.register_forward_pre_hook(InertOnCopy(self._refuse_autocast)))

    def _upcast(self, opt: DPOptimizer) -> None:
        odd = uneven_rows(opt.params)
        if odd:
            names = ", ".join(self._names.get(id(p), "?") for p in odd)
            raise ValueError(
                f"the per-sample gradients of {names} do not have one row per record of the batch (the others do): a "
                "layer applied to an input shared by the whole batch — GPT-2's or BERT's position embedding with "
                "position ids of batch 1 (Opacus issue #841), say — has no per-record gradient, so Opacus cannot clip "
                "it per record. Freeze those parameters (requires_grad=False; LoRA trains none of them) or give the "
                "layer one input per record (position_ids of shape (batch, seq_len))"
            )
        upcast_grad_samples(opt.params)

    def remove(self) -> None:
        """Detach (the attachment lets go of the optimizer once nothing else subscribes)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _refuse_autocast(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
                raise ValueError(AUTOCAST_REFUSED[self.mode].format(dtype=dtype) + _FIX)


def install_precision_guard(dp_optimizer: DPOptimizer, module: nn.Module, *, mode: str) -> PrecisionGuard:
    """Attach a :class:`PrecisionGuard` to what ``make_private`` returned: the optimizer and the module (the
    ``GradSampleModule`` / hooks object; its forward is where autocast is refused)."""
    return PrecisionGuard(dp_optimizer, module, mode=mode)
