"""opacus-spectral role plugin: tells denoisers which gradients are LoRA A / LoRA B, and of which layer.

Loaded by opacus-spectral through the entry point ``[project.entry-points.opacus_spectral] peft_lalora =
"peft_lalora.dp.plugin"`` (never imported by ``import peft_lalora``), so importing opacus_spectral here is fine.
With the roles, the ``lowpass`` denoiser smooths A ``(r, in_features)`` along input features and B
``(out_features, r)`` along output features, and RMT can be restricted to the LoRA factors.
"""

from __future__ import annotations

from opacus_spectral.plugins import ParameterRole
from torch import nn

from opacus_spectral import hookimpl

from ..alternation.factors import find_lora_factors

ROLE_OF_FACTOR = {"A": "lora_A", "B": "lora_B"}


def lora_parameter_roles(module: nn.Module) -> dict[str, ParameterRole]:
    """``{qualified param name: ParameterRole("lora_A"|"lora_B", layer=<LoraLayer name>)}`` for every 2-D
    LoRA factor of every adapter in ``module`` (names as in ``module.named_parameters()``).

    Conv LoRA factors (4-D) are left to the built-in roles: the A/B axis convention is for matrices.
    """
    roles: dict[str, ParameterRole] = {}
    all_names = dict(module.named_parameters(remove_duplicate=False))
    names = {id(p): n for n, p in all_names.items()}
    for f in find_lora_factors(module, adapter_names=_all_adapters(module)):
        if f.param.dim() != 2:
            continue
        name = f.name if f.name in all_names else names.get(id(f.param), f.name)
        roles[name] = ParameterRole(ROLE_OF_FACTOR[f.factor], layer=f.layer)
    return roles


def _all_adapters(module: nn.Module) -> list[str] | None:
    """Every adapter (not only the active ones): denoisers should know a factor whatever is active."""
    from peft.tuners.lora import LoraLayer

    adapters: set[str] = set()
    for m in module.modules():
        if isinstance(m, LoraLayer):
            adapters.update(m.lora_A.keys())
            adapters.update(m.lora_embedding_A.keys())
    return sorted(adapters) if adapters else None


@hookimpl
def opacus_spectral_parameter_roles(module: nn.Module) -> dict[str, ParameterRole] | None:
    """pluggy hook (see ``opacus_spectral.hookspecs``): the LoRA roles of ``module``, or None if it has none."""
    roles = lora_parameter_roles(module)
    return roles or None
