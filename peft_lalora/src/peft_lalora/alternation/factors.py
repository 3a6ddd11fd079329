"""Find the LoRA factors A and B of a (PEFT) model, build optimizer param groups from them, and freeze them.

A factor is located through ``isinstance(module, peft.tuners.lora.LoraLayer)`` and its
``lora_A[adapter]`` / ``lora_B[adapter]`` (``lora_embedding_A/B[adapter]`` for embeddings). Shapes
for linear / Conv1D layers: A is ``(r, in_features)``, B is ``(out_features, r)``; ``ΔW = s·B·A``.

:func:`apply_phase` is the one freeze operation of every driver (a training loop, the federated client, the HF
Trainer), through the :class:`~peft_lalora.AlternationController`: the factors of the phase trainable, the others
frozen by a ``set_trainable(params, trainable)`` — :func:`set_requires_grad` without DP, ``opacus_spectral``'s
``set_trainable`` (which also drops Opacus' per-sample state, ``docs/upstream.md`` §1.4) under DP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from peft.tuners.lora import LoraLayer
from torch import nn

from .schedule import Factor, Phase

#: ``set_trainable(params, trainable)``: how :func:`apply_phase` freezes and unfreezes
SetTrainable = Callable[[Sequence[nn.Parameter], bool], None]


@dataclass(frozen=True)
class LoraFactor:
    """One LoRA factor of one adapter in one layer."""

    name: str  #: qualified parameter name in the model given to :func:`find_lora_factors`
    layer: str  #: qualified name of the owning ``LoraLayer`` (A and B of one layer share it)
    factor: Factor
    adapter: str
    param: nn.Parameter


def _active_adapters(model: nn.Module) -> list[str] | None:
    """The adapters a PeftModel (possibly wrapped) currently trains, or None when unknown."""
    for m in model.modules():
        if hasattr(m, "peft_config") and hasattr(m, "active_adapters"):
            return active_adapter_names(m)
    return None


def active_adapter_names(module: nn.Module) -> list[str] | None:
    """``module``'s active adapters: PEFT's ``active_adapters`` property, or transformers' method of that name (a model
    whose LoRA layers PEFT injected, such as ``PeftModel.get_base_model()``); ``None`` when it cannot say."""
    active = getattr(module, "active_adapters", None)
    if callable(active):
        try:
            active = active()
        except (ValueError, AttributeError, RuntimeError):  # transformers: "no adapter loaded"
            return None
    if isinstance(active, str):
        return [active]
    return [a for a in active if isinstance(a, str)] if isinstance(active, list | tuple) else None


def find_lora_factors(model: nn.Module, adapter_names: str | Sequence[str] | None = None) -> list[LoraFactor]:
    """All LoRA factors of ``model`` (a PeftModel, a wrapper around one, or a model with injected LoRA).

    Args:
        model: the module to search; names are relative to it.
        adapter_names: which adapters; default: the PeftModel's active adapters, else every adapter found.

    Returns:
        Factors in module order, A before B within a layer.
    """
    if isinstance(adapter_names, str):
        adapter_names = [adapter_names]
    wanted = list(adapter_names) if adapter_names is not None else _active_adapters(model)
    found: list[LoraFactor] = []
    for layer_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        containers = (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B"))
        for a_attr, b_attr in containers:
            a_dict, b_dict = getattr(module, a_attr, {}), getattr(module, b_attr, {})
            for adapter in a_dict.keys():
                if wanted is not None and adapter not in wanted:
                    continue
                for attr, factor, store in ((a_attr, "A", a_dict), (b_attr, "B", b_dict)):
                    entry = store[adapter]
                    if isinstance(entry, nn.Parameter):  # embedding: ParameterDict
                        param, suffix = entry, f"{attr}.{adapter}"
                    else:
                        param, suffix = entry.weight, f"{attr}.{adapter}.weight"
                    name = f"{layer_name}.{suffix}" if layer_name else suffix
                    found.append(LoraFactor(name, layer_name, factor, adapter, param))  # type: ignore[arg-type]
    if wanted is not None and adapter_names is not None:
        present = {f.adapter for f in found}
        missing = [a for a in wanted if a not in present]
        if missing:
            raise ValueError(f"No LoRA layers found for adapter(s) {missing}; adapters present: {sorted(present)}.")
    return found


def lalora_param_groups(
    model: nn.Module,
    lr: float,
    *,
    b_lr_ratio: float = 1.0,
    weight_decay: float = 0.0,
    other_lr: float | None = None,
    adapter_names: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups: LoRA A at ``lr``, LoRA B at ``b_lr_ratio·lr``, other trainable params at
    ``other_lr`` (default ``lr``).

    The LA-LoRA reference code trains B at twice A's learning rate (``b_lr_ratio=2``); the paper and our
    default use one rate. Both factors are included whatever their current ``requires_grad`` (the
    controller freezes one of them between steps, and the optimizer must know both). Empty groups are
    omitted. Groups carry a ``"name"`` key (``"lora_A"``, ``"lora_B"``, ``"other"``).

    Example::

        opt = torch.optim.AdamW(lalora_param_groups(model, 1e-3, b_lr_ratio=2.0, weight_decay=0.01))
    """
    if not lr > 0 or not b_lr_ratio > 0:
        raise ValueError(f"lr and b_lr_ratio must be > 0, got lr={lr}, b_lr_ratio={b_lr_ratio}.")
    factors = find_lora_factors(model, adapter_names)
    if not factors:
        raise ValueError("The model has no LoRA layers (no peft.tuners.lora.LoraLayer found).")
    factor_ids = {id(f.param) for f in factors}
    a = _unique(f.param for f in factors if f.factor == "A")
    b = _unique(f.param for f in factors if f.factor == "B")
    other = _unique(p for p in model.parameters() if p.requires_grad and id(p) not in factor_ids)
    groups = [
        {"params": a, "lr": lr, "weight_decay": weight_decay, "name": "lora_A"},
        {"params": b, "lr": lr * b_lr_ratio, "weight_decay": weight_decay, "name": "lora_B"},
        {"params": other, "lr": lr if other_lr is None else other_lr, "weight_decay": weight_decay, "name": "other"},
    ]
    return [g for g in groups if g["params"]]


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def set_requires_grad(params: Sequence[nn.Parameter], trainable: bool) -> None:
    """Freeze (``False``) or unfreeze parameters between optimizer steps: ``requires_grad``, and when freezing
    ``grad = None``, so AdamW moments and weight decay leave a frozen factor untouched (torch optimizers skip a
    parameter without a gradient; ``docs/upstream.md`` §1.4)."""
    for p in params:
        p.requires_grad_(trainable)
        if not trainable:
            p.grad = None


def apply_phase(
    factors: Sequence[LoraFactor],
    phase: Phase,
    set_trainable: SetTrainable = set_requires_grad,
) -> None:
    """Make the factors of ``phase`` (``"A"``, ``"B"`` or ``"AB"``) trainable and freeze the others, A first."""
    set_trainable([f.param for f in factors if f.factor == "A"], "A" in phase)
    set_trainable([f.param for f in factors if f.factor == "B"], "B" in phase)
