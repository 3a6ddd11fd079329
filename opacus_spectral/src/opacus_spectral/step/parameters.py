"""Naming the optimizer's parameters and telling denoisers their role.

Names are those of the user's own model (Opacus' ``_module.`` and DDP's ``module.`` wrapper prefixes are
removed by unwrapping). Roles come from role plugins (``opacus_spectral_parameter_roles``), else from the
built-in rule: ``embedding`` for an ``nn.Embedding`` weight, ``bias`` for ≤1-D tensors, ``weight`` otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from opacus.grad_sample import AbstractGradSampleModule
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..plugins.registry import Registry
from .records import ROLE_BIAS, ROLE_EMBEDDING, ROLE_WEIGHT, ParameterRole


@dataclass(frozen=True)
class ParamInfo:
    name: str
    role: str
    layer: str | None


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside Opacus/DDP wrappers (GradSampleModule, DPDDP, DDP, GradSampleHooks)."""
    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(module, AbstractGradSampleModule):
            module = module._module
        elif (
            isinstance(module, DistributedDataParallel)
            or type(module).__name__ == "DifferentiallyPrivateDistributedDataParallel"
        ):
            module = module.module
        elif not isinstance(module, nn.Module) and hasattr(module, "_module"):  # GradSampleHooks (wrap_model=False)
            module = module._module
        else:
            return module
    return module


def builtin_role(owner: nn.Module | None, param: torch.Tensor) -> str:
    if param.dim() <= 1:
        return ROLE_BIAS
    if isinstance(owner, nn.Embedding):
        return ROLE_EMBEDDING
    return ROLE_WEIGHT


def describe_parameters(
    params: Iterable[torch.Tensor], module: nn.Module | None, registry: Registry | None
) -> dict[int, ParamInfo]:
    """``{id(param): ParamInfo}`` for the given parameters (plugins' roles merged over built-in ones)."""
    params = list(params)
    if module is None:
        return {id(p): ParamInfo(f"param.{i}", builtin_role(None, p), None) for i, p in enumerate(params)}
    user = unwrap(module)
    owners: dict[int, tuple[str, nn.Module]] = {}
    for mname, m in user.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), (f"{mname}.{pname}" if mname else pname, m))
    plugin_roles: dict[str, ParameterRole] = registry.roles(user) if registry is not None else {}
    out: dict[int, ParamInfo] = {}
    for i, p in enumerate(params):
        if id(p) not in owners:
            out[id(p)] = ParamInfo(f"param.{i}", builtin_role(None, p), None)
            continue
        name, owner = owners[id(p)]
        told = plugin_roles.get(name)
        if told is not None:
            out[id(p)] = ParamInfo(name, told.role, told.layer)
        else:
            out[id(p)] = ParamInfo(name, builtin_role(owner, p), name.rpartition(".")[0] or None)
    return out
