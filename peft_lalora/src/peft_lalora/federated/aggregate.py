"""Server-side FedAvg of LoRA adapters with update validation.

LA-LoRA (ICLR 2026, §3.3) aggregates the factors **separately**:

    A_g = Σ_i w_i A_i,   B_g = Σ_i w_i B_i,   head_g = Σ_i w_i head_i,   w_i = n_i / Σ_j n_j  (or 1/m)

i.e. a per-tensor weighted mean over every trainable tensor of the adapter state — LoRA factors and the
``modules_to_save`` copies (classifier head), which the public reference code forgot. With a server
learning rate η (FedOpt-style server SGD on the pseudo-gradient ``Δ = avg - global``):

    θ_g ← θ_g + η · (avg − θ_g)

η = 1 is plain FedAvg. Updates are validated first (keys, shapes, dtypes, finiteness, weight); a bad
update is dropped with its reason, the rest are averaged if at least ``min_clients`` remain. The inputs
are never written to: the output tensors are freshly allocated.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AggregationError", "AggregationResult", "Rejection", "fedavg", "factor_of", "validate_update"]

State = Mapping[str, torch.Tensor]


def factor_of(key: str) -> str:
    """``"A"`` / ``"B"`` for LoRA factor tensors, ``"other"`` for anything else (head, modules_to_save, ...)."""
    if ".lora_A." in key:
        return "A"
    if ".lora_B." in key:
        return "B"
    return "other"


@dataclass(frozen=True)
class Rejection:
    """One dropped update: its position in the input, the caller's client id, and why."""

    index: int
    client: Any
    reason: str


@dataclass
class AggregationResult:
    """Output of :func:`fedavg`.

    Attributes:
        state: the new global state (fresh tensors, same keys/shapes/dtypes/devices as the reference).
        accepted: input positions that were averaged.
        rejected: the dropped updates with their reasons.
        weights: normalised weights of ``accepted`` (sum to 1).
        factors: number of tensors aggregated per group ``{"A": .., "B": .., "other": ..}``.
    """

    state: dict[str, torch.Tensor]
    accepted: list[int]
    rejected: list[Rejection] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    factors: dict[str, int] = field(default_factory=dict)


class AggregationError(ValueError):
    """Raised when fewer than ``min_clients`` valid updates remain; ``.rejected`` says why."""

    def __init__(self, message: str, rejected: Sequence[Rejection]) -> None:
        super().__init__(message)
        self.rejected = list(rejected)


Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def _signature(state: State) -> Signature:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in state.items()))


def validate_update(state: Any, reference: Mapping[str, torch.Tensor], weight: float) -> str | None:
    """Reason why ``state`` cannot be averaged against ``reference`` (``None`` if it can).

    Checks, in order: a mapping of tensors; the weight is finite and > 0; the same key set; per key the
    same shape and dtype; every entry finite (one host sync for the whole update).
    """
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return "update is not a mapping of str -> torch.Tensor"
    if isinstance(weight, bool) or not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight > 0):
        return f"weight must be finite and > 0, got {weight!r}"
    missing = sorted(set(reference) - set(state))
    extra = sorted(set(state) - set(reference))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected keys {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        return "; ".join(parts)
    for k, ref in reference.items():
        v = state[k]
        if tuple(v.shape) != tuple(ref.shape):
            return f"shape mismatch for {k!r}: {tuple(v.shape)} != {tuple(ref.shape)}"
        if v.dtype != ref.dtype:
            return f"dtype mismatch for {k!r}: {v.dtype} != {ref.dtype}"
    keys = list(reference)
    if keys:
        finite = torch.stack([torch.isfinite(state[k]).all().to("cpu") for k in keys]).tolist()
        bad = [k for k, ok in zip(keys, finite, strict=True) if not ok]
        if bad:
            return f"non-finite values (NaN/Inf) in {bad[:5]}{' ...' if len(bad) > 5 else ''}"
    return None


def fedavg(
    states: Sequence[State],
    weights: Sequence[float] | None = None,
    *,
    server_lr: float = 1.0,
    global_state: State | None = None,
    min_clients: int = 1,
    client_ids: Sequence[Any] | None = None,
) -> AggregationResult:
    """Weighted per-tensor FedAvg of adapter states (LoRA A, B and every other trainable tensor).

    Args:
        states: one adapter state per client (``{name: tensor}``), e.g. from
            :func:`peft_lalora.federated.client.adapter_state`.
        weights: per-client weights (e.g. number of examples); ``None`` = uniform. Normalised over the
            *accepted* clients.
        server_lr: η in ``θ_g + η·(avg − θ_g)``; needs ``global_state`` unless η = 1.
        global_state: the current global state; when given it is also the reference for validation.
            Without it the reference is the (key, shape, dtype) signature most clients share.
        min_clients: minimum number of valid updates; fewer raises :class:`AggregationError`.
        client_ids: labels for the rejection reasons (default: positions).

    Returns:
        :class:`AggregationResult` with the new state and the rejections.

    Raises:
        ValueError: bad arguments (lengths, ``min_clients < 1``, ``server_lr`` not finite/positive, η ≠ 1
            without ``global_state``, non-floating reference tensors, non-finite global state).
        AggregationError: fewer than ``min_clients`` updates survive validation.
    """
    n = len(states)
    if weights is not None and len(weights) != n:
        raise ValueError(f"got {n} states but {len(weights)} weights")
    if client_ids is not None and len(client_ids) != n:
        raise ValueError(f"got {n} states but {len(client_ids)} client_ids")
    if not isinstance(min_clients, int) or min_clients < 1:
        raise ValueError(f"min_clients must be an int >= 1, got {min_clients!r}")
    if not (isinstance(server_lr, (int, float)) and math.isfinite(server_lr) and server_lr > 0):
        raise ValueError(f"server_lr must be finite and > 0, got {server_lr!r}")
    if server_lr != 1.0 and global_state is None:
        raise ValueError("server_lr != 1 needs global_state (the update is global + server_lr * (avg - global))")
    ids = list(client_ids) if client_ids is not None else list(range(n))
    w_in = (
        [1.0] * n
        if weights is None
        else [float(w) if isinstance(w, numbers.Real) and not isinstance(w, bool) else w for w in weights]
    )

    if global_state is not None:
        reference: Mapping[str, torch.Tensor] = global_state
        bad_global = validate_update(global_state, global_state, 1.0)
        if bad_global is not None:
            raise ValueError(f"global_state is invalid: {bad_global}")
    else:
        sigs = [
            _signature(s)
            for s in states
            if isinstance(s, Mapping) and all(isinstance(v, torch.Tensor) for v in s.values())
        ]
        if not sigs:
            raise AggregationError(
                f"no valid updates (need {min_clients}): none is a mapping of tensors",
                [Rejection(i, ids[i], "update is not a mapping of str -> torch.Tensor") for i in range(n)],
            )
        counts = Counter(sigs)
        best = max(counts.values())
        winner = next(s for s in sigs if counts[s] == best)  # most common, first occurrence on ties
        reference = next(s for s in states if isinstance(s, Mapping) and _signature(s) == winner)  # type: ignore[arg-type]
    if not reference:
        raise ValueError("cannot aggregate empty adapter states")
    for k, v in reference.items():
        if not v.is_floating_point():
            raise ValueError(f"cannot average non-floating tensor {k!r} ({v.dtype})")

    accepted: list[int] = []
    rejected: list[Rejection] = []
    for i, s in enumerate(states):
        reason = validate_update(s, reference, w_in[i])
        if reason is None:
            accepted.append(i)
        else:
            rejected.append(Rejection(i, ids[i], reason))
    if len(accepted) < min_clients:
        detail = "; ".join(f"client {r.client}: {r.reason}" for r in rejected) or "no updates"
        raise AggregationError(
            f"only {len(accepted)} valid update(s) of {n}, need min_clients={min_clients} ({detail})", rejected
        )

    keys = list(reference)
    total = math.fsum(w_in[i] for i in accepted)
    norm_w = [w_in[i] / total for i in accepted]
    dev = reference[keys[0]].device
    # One [m, D] float64 matrix for all tensors of all accepted clients, one mat-vec for the mean.
    mat = torch.stack(
        [torch.cat([states[i][k].detach().to(dev, torch.float64).reshape(-1) for k in keys]) for i in accepted]
    )
    # Σ w_i x_i / Σ w_i: dividing last keeps exact results for integer weights and values.
    avg = (torch.tensor([w_in[i] for i in accepted], dtype=torch.float64, device=dev) @ mat) / total
    if global_state is not None and server_lr != 1.0:
        g = torch.cat([global_state[k].detach().to(dev, torch.float64).reshape(-1) for k in keys])
        avg = g + server_lr * (avg - g)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k in keys:
        ref = reference[k]
        numel = ref.numel()
        out[k] = avg[offset : offset + numel].reshape(ref.shape).to(device=ref.device, dtype=ref.dtype).clone()
        offset += numel
    factors = dict(Counter(factor_of(k) for k in keys))
    return AggregationResult(state=out, accepted=accepted, rejected=rejected, weights=norm_w, factors=factors)
