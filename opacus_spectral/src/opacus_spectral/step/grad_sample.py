"""Alternation-safe Opacus wrapping: toggling ``requires_grad`` between steps.

Upstream Opacus 1.6 sets per-sample hooks up for the parameters trainable at wrap time and then crashes when
a layer is frozen later (``docs/upstream.md`` §1.4): the frozen layer's backward hook fires but its
forward hook stored no activations ("No activations detected"), and ghost clipping stacks stale per-sample
norms of frozen parameters. The subclasses here

* skip the backward hook of a module that has no trainable parameter right now, and
* build ghost-clipping norms from the currently trainable parameters only,

and :func:`set_trainable` freezes/unfreezes parameters together with Opacus' per-sample state, so a factor
that trains again later never reuses a stale ``grad_sample``. They also turn two misleading upstream errors
into clear ones: a model left in eval mode, and trainable parameters Opacus can never see (PEFT LoRA on an
embedding keeps its factors in a ``ParameterDict`` that is never called as a module).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping
from opacus.utils.module_utils import has_trainable_params
from torch import nn

#: attributes Opacus attaches to a Parameter during a step
_PER_SAMPLE_ATTRS = ("grad_sample", "summed_grad", "_norm_sample")
#: torch's warning at a backward through a module with a full backward hook (Opacus' per-sample hook) none of whose
#: inputs needs a gradient (the first trainable layer: its input is data); that hook reads only the output gradient
FULL_BACKWARD_HOOK = "Full backward hook is firing"


@contextmanager
def without_full_backward_hook_warning() -> Iterator[None]:
    """Silence :data:`FULL_BACKWARD_HOOK` for the ``with`` block only (around the library's own backward passes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FULL_BACKWARD_HOOK, category=UserWarning)
        yield


def set_trainable(params: Iterable[nn.Parameter], trainable: bool) -> None:
    """Freeze (``False``) or unfreeze parameters between optimizer steps, Opacus-safely.

    Freezing sets ``requires_grad=False`` and drops ``grad`` (so AdamW moments and weight decay leave the
    parameter alone: torch optimizers skip parameters whose grad is None) and Opacus' per-sample state
    (``grad_sample``, ``_current_grad_sample``, ``summed_grad``, ``_norm_sample``).
    """
    for p in params:
        if not trainable:
            p.grad = None
            for attr in _PER_SAMPLE_ATTRS:
                if hasattr(p, attr):
                    setattr(p, attr, None)
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        p.requires_grad_(trainable)


class _AlternationSafe:
    """Mixin over Opacus' hook classes (``GradSampleHooks`` and the ghost-clipping variant)."""

    def capture_backprops_hook(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "hooks_enabled", True):  # disabled hooks: exactly upstream's behaviour
            return super().capture_backprops_hook(module, *args, **kwargs)  # type: ignore[misc]
        if not has_trainable_params(module):
            # frozen since wrap time (alternation): nothing to compute, and no activations were stored
            if hasattr(module, "activations"):
                module.activations = []
            return None
        if not getattr(module, "activations", None) and not module.training:
            raise RuntimeError(
                f"{type(module).__name__} is in eval mode, so Opacus recorded no activations for it; call "
                "model.train() before the private training steps (PeftModel.from_pretrained returns eval mode)."
            )
        return super().capture_backprops_hook(module, *args, **kwargs)  # type: ignore[misc]


class _GhostAlternationSafe(_AlternationSafe):
    trainable_parameters: list[nn.Parameter]

    def get_norm_sample(self) -> torch.Tensor:
        """Per-example gradient norms over the parameters trainable *now* (stale frozen norms excluded)."""
        active = [p for p in self.trainable_parameters if p.requires_grad]
        norms = [p._norm_sample for p in active if getattr(p, "_norm_sample", None) is not None]
        if len(norms) != len(active):
            missing = len(active) - len(norms)
            raise RuntimeError(f"{missing} trainable parameter(s) got no per-sample norm in this backward pass")
        device = norms[0].device
        norm_sample = torch.stack([n.to(device) for n in norms], dim=0).norm(2, dim=0)
        self.per_sample_gradient_norms = norm_sample
        return norm_sample


class SafeGradSampleHooks(_AlternationSafe, GradSampleHooks):
    """``GradSampleHooks`` (``wrap_model=False``, hooks/functorch modes) that tolerates parameter toggling."""


class SafeGradSampleModule(_AlternationSafe, GradSampleModule):
    """``GradSampleModule`` (hooks/functorch modes) that tolerates parameter toggling."""


class SafeGradSampleHooksFastGradientClipping(_GhostAlternationSafe, GradSampleHooksFastGradientClipping):
    """Ghost-clipping hooks (``wrap_model=False``) that tolerate parameter toggling."""


class SafeGradSampleModuleFastGradientClipping(_GhostAlternationSafe, GradSampleModuleFastGradientClipping):
    """Ghost-clipping ``GradSampleModule`` that tolerates parameter toggling."""


def refuse_upstream_toggling(model: nn.Module, what: str, alternative: str) -> None:
    """``ValueError`` if ``model`` carries upstream Opacus' per-sample hooks rather than these alternation-safe ones
    (made private by ``opacus.PrivacyEngine``): ``what`` would freeze a layer between steps, and at the next backward
    its hook finds no activations (``docs/upstream.md`` §1.4)."""
    for module in model.modules():
        for hook in module._forward_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, GradSampleHooks) and not isinstance(owner, _AlternationSafe):
                raise ValueError(
                    f"{what} freezes parameters between steps, but the model was made private by opacus.PrivacyEngine, "
                    'whose per-sample hooks fail on a layer frozen after make_private ("No activations detected" at '
                    "the next backward). Fix: make it private with opacus_spectral.PrivacyEngine() instead (a drop-in: "
                    f"the same make_private arguments), or use {alternative}."
                )


def safe_class(grad_sample_mode: str, wrap_model: bool) -> type | None:
    """The alternation-safe class for a mode, or None where upstream's is used as is ("ew", "no_op")."""
    if grad_sample_mode in ("hooks", "functorch"):
        return SafeGradSampleModule if wrap_model else SafeGradSampleHooks
    if grad_sample_mode == "ghost":
        return SafeGradSampleModuleFastGradientClipping if wrap_model else SafeGradSampleHooksFastGradientClipping
    return None


def check_per_sample_support(module: nn.Module) -> None:
    """Refuse trainable parameters whose per-sample gradients Opacus can never compute, naming them.

    A parameter held by an ``nn.ParameterDict``/``nn.ParameterList`` is read as an attribute, never through
    a module call, so no Opacus hook sees it and the first step fails with "Per sample gradient is not
    initialized". PEFT's LoRA on ``nn.Embedding`` (``lora_embedding_A``/``lora_embedding_B``) is such a case
    (``docs/upstream.md`` §1.7).
    """
    bad = [
        f"{mname}.{pname}" if mname else pname
        for mname, m in module.named_modules()
        if isinstance(m, (nn.ParameterDict, nn.ParameterList))
        for pname, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise ValueError(
            f"Opacus cannot compute per-sample gradients for trainable parameter(s) {shown}: they live in a "
            "ParameterDict/ParameterList that is never called as a module (e.g. PEFT LoRA on an nn.Embedding). "
            "Freeze them or leave embeddings out of LoRA's target_modules."
        )
