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

Server-side bounds on what a client can do to the global adapter (a client's update is its state minus the
global state, over all tensors):

* ``max_update_norm``: an update longer than this is clipped to it (``update_norm_policy="clip"``, like the
  update clipping of Flower's ``DifferentialPrivacyServerSideFixedClipping``) or dropped with its norm as the
  reason (``"reject"``);
* ``rule="trimmed_mean"``: coordinate-wise trimmed mean (Flower's ``FedTrimmedAvg``; its ``trim_mean`` is used):
  the ``int(trim_fraction · m)`` largest and smallest values of every coordinate (``m`` valid updates) are
  discarded, the rest averaged without weights — an outlier cannot move a coordinate beyond the honest
  clients' range. A trimmed mean that would trim nothing (``int(trim_fraction · m) = 0``, e.g. the default 0.1
  with fewer than 10 clients) is an error (:func:`~peft_lalora.federated.server.rules.trim_problem`), not a silent
  plain mean;
* a result that overflows the state's dtype (e.g. clients sending 3e38) fails the round instead of becoming Inf.

Weights are the caller's: a runner passes the example counts *it* assigned, never counts a client reports.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .rules import NORM_POLICIES, RULES, trim_problem

__all__ = [
    "AggregationError",
    "AggregationResult",
    "Rejection",
    "fedavg",
    "factor_of",
    "validate_update",
]

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
        clipped: ids of the clients whose update was clipped to ``max_update_norm``.
    """

    state: dict[str, torch.Tensor]
    accepted: list[int]
    rejected: list[Rejection] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    factors: dict[str, int] = field(default_factory=dict)
    clipped: list[Any] = field(default_factory=list)  #: clients whose update was scaled down to max_update_norm


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

    Checks, in order: a mapping of tensors; the weight is finite and > 0; the same key set; per key a dense
    (not sparse), materialised (not meta) tensor of the same shape and dtype; every entry finite (one host
    sync for the whole update).
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
        if v.is_meta:
            return f"tensor {k!r} is on the meta device (no data: an unmaterialised parameter was sent)"
        if v.layout != torch.strided:
            return f"tensor {k!r} has layout {v.layout}: only dense tensors are aggregated (send .to_dense())"
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
    max_update_norm: float | None = None,
    update_norm_policy: str = "clip",
    rule: str = "mean",
    trim_fraction: float = 0.1,
) -> AggregationResult:
    """Weighted per-tensor FedAvg of adapter states (LoRA A, B and every other trainable tensor).

    Args:
        states: one adapter state per client (``{name: tensor}``), e.g. from
            :func:`peft_lalora.federated.client.dp_client.adapter_state`.
        weights: per-client weights (e.g. number of examples); ``None`` = uniform. Normalised over the
            *accepted* clients.
        server_lr: η in ``θ_g + η·(avg − θ_g)``; needs ``global_state`` unless η = 1.
        global_state: the current global state; when given it is also the reference for validation.
            Without it the reference is the (key, shape, dtype) signature most clients share.
        min_clients: minimum number of valid updates; fewer raises :class:`AggregationError`.
        client_ids: labels for the rejection reasons (default: positions).
        max_update_norm: bound on ``‖state − global_state‖₂`` over all tensors (needs ``global_state``);
            ``None``: no bound.
        update_norm_policy: ``"clip"`` (scale a longer update down to the bound) or ``"reject"`` (drop it).
        rule: ``"mean"`` (weighted FedAvg) or ``"trimmed_mean"`` (coordinate-wise, unweighted).
        trim_fraction: share of clients trimmed at *each* end per coordinate, in [0, 0.5) (> 0 for
            ``"trimmed_mean"``, which must trim at least one update per end).

    Returns:
        :class:`AggregationResult` with the new state and the rejections.

    Raises:
        ValueError: bad arguments (lengths, ``min_clients < 1``, ``server_lr`` not finite/positive, η ≠ 1
            without ``global_state``, non-floating reference tensors, non-finite global state).
        AggregationError: fewer than ``min_clients`` updates survive validation, or a trimmed mean of the
            valid ones would trim nothing (:func:`~peft_lalora.federated.server.rules.trim_problem`).
    """
    n = len(states)
    _check_arguments(n, weights, client_ids, min_clients, server_lr, global_state, max_update_norm)
    _check_rule(update_norm_policy, rule, trim_fraction)
    ids = list(client_ids) if client_ids is not None else list(range(n))
    w_in = (
        [1.0] * n
        if weights is None
        else [float(w) if isinstance(w, numbers.Real) and not isinstance(w, bool) else w for w in weights]
    )
    reference = _reference(states, global_state, ids, min_clients)
    accepted, rejected = _validate_all(states, reference, w_in, ids, min_clients)
    keys = list(reference)
    mat, g = _flatten(states, accepted, global_state, keys, reference[keys[0]].device)
    clipped: list[Any] = []
    if max_update_norm is not None and g is not None:
        accepted, mat, clipped = _bound_updates(
            accepted, mat, g, float(max_update_norm), update_norm_policy, ids, rejected
        )
        if len(accepted) < min_clients:
            detail = "; ".join(f"client {r.client}: {r.reason}" for r in rejected)
            raise AggregationError(
                f"only {len(accepted)} update(s) within max_update_norm, need min_clients={min_clients} ({detail})",
                rejected,
            )
    avg, norm_w = _combine(mat, [w_in[i] for i in accepted], rule, trim_fraction, n, rejected)
    if g is not None and server_lr != 1.0:
        avg = g + server_lr * (avg - g)
    out = _unflatten(avg, reference, len(accepted), rejected)
    factors = dict(Counter(factor_of(k) for k in keys))
    return AggregationResult(
        state=out, accepted=accepted, rejected=rejected, weights=norm_w, factors=factors, clipped=clipped
    )


def _flatten(
    states: Sequence[State], accepted: Sequence[int], global_state: State | None, keys: list[str], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[m, D]`` float64 matrix of the accepted clients' tensors (in ``keys`` order) and the global state
    flattened the same way (``None`` without one)."""
    mat = torch.stack(
        [torch.cat([states[i][k].detach().to(dev, torch.float64).reshape(-1) for k in keys]) for i in accepted]
    )
    if global_state is None:
        return mat, None
    return mat, torch.cat([global_state[k].detach().to(dev, torch.float64).reshape(-1) for k in keys])


def _check_arguments(
    n: int,
    weights: Sequence[float] | None,
    client_ids: Sequence[Any] | None,
    min_clients: int,
    server_lr: float,
    global_state: State | None,
    max_update_norm: float | None,
) -> None:
    """``ValueError`` for :func:`fedavg` arguments that do not fit together (lengths, ``min_clients``, η, bound)."""
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
    if max_update_norm is not None:
        if not (isinstance(max_update_norm, (int, float)) and math.isfinite(max_update_norm) and max_update_norm > 0):
            raise ValueError(f"max_update_norm must be finite and > 0 or None, got {max_update_norm!r}")
        if global_state is None:
            raise ValueError("max_update_norm needs global_state (an update is state - global_state)")


def _check_rule(update_norm_policy: str, rule: str, trim_fraction: float) -> None:
    """``ValueError`` for an unknown norm policy or rule, or a trim fraction outside [0, 0.5) (> 0 to trim)."""
    if update_norm_policy not in NORM_POLICIES:
        raise ValueError(f"update_norm_policy must be one of {NORM_POLICIES}, got {update_norm_policy!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not (isinstance(trim_fraction, (int, float)) and 0.0 <= trim_fraction < 0.5):
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}")
    if rule == "trimmed_mean" and trim_fraction == 0:
        raise ValueError("rule='trimmed_mean' with trim_fraction=0 trims nothing: use rule='mean' or trim_fraction > 0")


def _reference(
    states: Sequence[State], global_state: State | None, ids: Sequence[Any], min_clients: int
) -> Mapping[str, torch.Tensor]:
    """What updates are validated against: ``global_state``, else the (key, shape, dtype) signature most valid
    updates share (first occurrence on ties). Floating tensors only."""
    if global_state is not None:
        reference: Mapping[str, torch.Tensor] = global_state
        bad_global = validate_update(global_state, global_state, 1.0)
        if bad_global is not None:
            raise ValueError(f"global_state is invalid: {bad_global}")
    else:
        usable = [  # a meta / sparse / non-finite update must not become the reference
            s
            for s in states
            if isinstance(s, Mapping)
            and all(isinstance(v, torch.Tensor) for v in s.values())
            and validate_update(s, s, 1.0) is None
        ]
        sigs = [_signature(s) for s in usable]
        if not sigs:
            raise AggregationError(
                f"no valid updates (need {min_clients}): none is a mapping of dense, finite tensors",
                [Rejection(i, ids[i], validate_update(s, s, 1.0) or "empty update") for i, s in enumerate(states)],
            )
        counts = Counter(sigs)
        best = max(counts.values())
        winner = next(s for s in sigs if counts[s] == best)  # most common, first occurrence on ties
        reference = next(s for s in usable if _signature(s) == winner)
    if not reference:
        raise ValueError("cannot aggregate empty adapter states")
    for k, v in reference.items():
        if not v.is_floating_point():
            raise ValueError(f"cannot average non-floating tensor {k!r} ({v.dtype})")
    return reference


def _validate_all(
    states: Sequence[State], reference: Mapping[str, torch.Tensor], w_in: Sequence[Any], ids: Sequence[Any], m: int
) -> tuple[list[int], list[Rejection]]:
    """Positions of the valid updates and the rejections; :class:`AggregationError` when fewer than ``m`` remain."""
    accepted: list[int] = []
    rejected: list[Rejection] = []
    for i, s in enumerate(states):
        reason = validate_update(s, reference, w_in[i])
        if reason is None:
            accepted.append(i)
        else:
            rejected.append(Rejection(i, ids[i], reason))
    if len(accepted) < m:
        detail = "; ".join(f"client {r.client}: {r.reason}" for r in rejected) or "no updates"
        raise AggregationError(
            f"only {len(accepted)} valid update(s) of {len(states)}, need min_clients={m} ({detail})", rejected
        )
    return accepted, rejected


def _combine(
    mat: torch.Tensor, weights: list[float], rule: str, trim_fraction: float, n: int, rejected: list[Rejection]
) -> tuple[torch.Tensor, list[float]]:
    """The rows of ``mat`` averaged by ``rule``, and the normalised weights that were used."""
    total = math.fsum(weights)
    if rule == "trimmed_mean":
        problem = trim_problem(trim_fraction, len(weights))
        if problem is not None:
            raise AggregationError(f"{len(weights)} valid update(s) of {n}: {problem}", rejected)
        return _trimmed_mean(mat, trim_fraction), [1.0 / len(weights)] * len(weights)
    # Σ w_i x_i / Σ w_i: dividing last keeps exact results for integer weights and values.
    avg = (torch.tensor(weights, dtype=torch.float64, device=mat.device) @ mat) / total
    return avg, [w / total for w in weights]


def _unflatten(
    avg: torch.Tensor, reference: Mapping[str, torch.Tensor], m: int, rejected: list[Rejection]
) -> dict[str, torch.Tensor]:
    """``avg`` cut back into fresh tensors shaped, typed and placed as ``reference``'s; an overflow is an error."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k, ref in reference.items():
        numel = ref.numel()
        out[k] = avg[offset : offset + numel].reshape(ref.shape).to(device=ref.device, dtype=ref.dtype).clone()
        offset += numel
    overflow = [k for k in reference if not bool(torch.isfinite(out[k]).all())]
    if overflow:
        raise AggregationError(
            f"the aggregate of {m} finite updates overflows {reference[overflow[0]].dtype} in "
            f"{overflow[:5]}: refusing to install an Inf global state (set max_update_norm to bound updates)",
            rejected,
        )
    return out


def _bound_updates(
    accepted: list[int],
    mat: torch.Tensor,
    g: torch.Tensor,
    bound: float,
    policy: str,
    ids: Sequence[Any],
    rejected: list[Rejection],
) -> tuple[list[int], torch.Tensor, list[Any]]:
    """Clip (or drop) the rows of ``mat`` whose update ``row − g`` is longer than ``bound``."""
    delta = mat - g
    norms = torch.linalg.vector_norm(delta, dim=1)
    over = (norms > bound).tolist()
    if not any(over):
        return accepted, mat, []
    if policy == "clip":
        scale = torch.where(norms > bound, bound / norms, torch.ones_like(norms))
        return accepted, g + delta * scale[:, None], [ids[i] for i, o in zip(accepted, over, strict=True) if o]
    keep = [j for j, o in enumerate(over) if not o]
    for j, o in enumerate(over):
        if o:
            reason = f"update norm {float(norms[j]):.4g} exceeds max_update_norm={bound:g}"
            rejected.append(Rejection(accepted[j], ids[accepted[j]], reason))
    return [accepted[j] for j in keep], mat[keep], []


def _trimmed_mean(mat: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean of the rows of ``mat`` with Flower's ``trim_mean`` (``FedTrimmedAvg``)."""
    try:
        from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
    except ImportError as err:  # pragma: no cover - flwr is the [flower] extra
        raise ImportError(
            "rule='trimmed_mean' uses Flower's trim_mean: pip install -c constraints.txt './peft_lalora[flower]' "
            "(README, Install)"
        ) from err
    return torch.from_numpy(trim_mean(mat.cpu().numpy(), trim_fraction)).to(mat.device)
