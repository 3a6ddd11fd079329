"""Gradient-share probe: which trainable group — classifier head, LoRA A, LoRA B — carries the clipped gradient.

Per-example gradients are computed exactly, one example at a time (model in eval mode: dropout off). For a group
``G`` and example ``i`` with gradient ``g_i``:

* ``per_example_share[G]`` = mean over the batch of ``‖g_i,G‖² / ‖g_i‖²`` — the group's share of the squared norm
  of each clipped per-example gradient (clipping scales a whole example, so the share is the same before and
  after it);
* ``clipped_sum_share[G]`` = ``‖S_G‖² / ‖S‖²`` with ``S = Σ_i clip_C(g_i)``: the group's share of the summed clipped
  gradient, the signal DP-SGD adds noise to;
* ``numel_share[G]``: the group's share of the parameters — its share of the noise energy (isotropic noise).

A group the head dominates leaves the LoRA scheme (which factor trains when) almost nothing to decide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from peft_lalora.federated.server.aggregate import factor_of
from torch import nn

__all__ = ["GROUPS", "gradient_share", "param_group", "probe_federation"]

GROUPS = ("head", "lora_A", "lora_B")
_GROUP_OF_FACTOR = {"A": "lora_A", "B": "lora_B", "other": "head"}
LossFn = Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]


def param_group(name: str) -> str:
    """``"lora_A"`` / ``"lora_B"`` for LoRA factors (PEFT names, matched as the federated aggregation matches
    them: :func:`peft_lalora.federated.server.aggregate.factor_of`), ``"head"`` for every other trainable tensor."""
    return _GROUP_OF_FACTOR[factor_of(name)]


def gradient_share(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    max_grad_norm: float,
    params: Mapping[str, nn.Parameter] | None = None,
) -> dict[str, Any]:
    """Shares of the clipped per-example gradients of ``params`` (default: the trainable ones) over ``batch``
    (tensors with the example index first; ``loss_fn(model, one_example_batch)`` is that example's loss)."""
    if params is None:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = list(params)
    if not names:
        raise ValueError("no trainable parameters to probe")
    groups = [param_group(n) for n in names]
    n = int(batch[0].shape[0])
    if n < 1:
        raise ValueError("empty probe batch")
    was_training = model.training
    model.eval()
    sq = np.zeros((n, len(GROUPS)))
    summed = [torch.zeros_like(p, dtype=torch.float64) for p in params.values()]
    try:
        for i in range(n):
            loss = loss_fn(model, [t[i : i + 1] for t in batch])
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values(), strict=True)]
            for g, grp in zip(grads, groups, strict=True):
                sq[i, GROUPS.index(grp)] += float(g.double().pow(2).sum())
            scale = min(1.0, max_grad_norm / max(float(np.sqrt(sq[i].sum())), 1e-300))
            for acc, g in zip(summed, grads, strict=True):
                acc.add_(g.double(), alpha=scale)
    finally:
        model.train(was_training)
    total = sq.sum(1)
    ok = total > 0
    per_example = sq[ok] / total[ok, None] if ok.any() else np.full((1, len(GROUPS)), np.nan)
    s_sq = np.zeros(len(GROUPS))
    for acc, grp in zip(summed, groups, strict=True):
        s_sq[GROUPS.index(grp)] += float(acc.pow(2).sum())
    numel = np.zeros(len(GROUPS))
    for p, grp in zip(params.values(), groups, strict=True):
        numel[GROUPS.index(grp)] += p.numel()
    norms = np.sqrt(total)
    return {
        "n": n,
        "max_grad_norm": float(max_grad_norm),
        "per_example_share": dict(zip(GROUPS, per_example.mean(0).tolist(), strict=True)),
        "clipped_sum_share": dict(zip(GROUPS, (s_sq / s_sq.sum() if s_sq.sum() > 0 else s_sq).tolist(), strict=True)),
        "numel": dict(zip(GROUPS, numel.astype(int).tolist(), strict=True)),
        "numel_share": dict(zip(GROUPS, (numel / numel.sum()).tolist(), strict=True)),
        "norm_median": float(np.median(norms)),
        "group_norm_median": {g: float(np.median(np.sqrt(sq[:, j]))) for j, g in enumerate(GROUPS)},
        "clipped_fraction": float(np.mean(norms > max_grad_norm)),
    }


def probe_federation(cfg: Any, task: Any, state: Mapping[str, torch.Tensor] | None, n: int) -> dict[str, Any]:
    """:func:`gradient_share` of a federation's model with the global adapter ``state`` (``None``: the initial
    one) on ``n`` training examples (a seeded choice, the same for every run on the same training split)."""
    from peft_lalora.federated.builders import make_peft_model
    from peft_lalora.federated.client.adapter_state import load_adapter_state, trainable_parameters
    from peft_lalora.federated.client.losses import NamedInputsLoss

    model = make_peft_model(cfg, task)
    params = trainable_parameters(model)
    if state is not None:
        load_adapter_state(params, state)
    size = len(task.train)
    rows = np.sort(np.random.default_rng(0).choice(size, size=min(n, size), replace=False))
    data = task.tensors("train", rows)
    return gradient_share(model, data.tensors, NamedInputsLoss(task.input_names), cfg.max_grad_norm, params)
