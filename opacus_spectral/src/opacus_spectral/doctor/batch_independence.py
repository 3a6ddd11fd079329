"""No record's clipped gradient may depend on the other records of its batch (``docs/engine.md``, "Batch
independence"; DESIGN invariant 8) — the comparisons, pure tensor code.

DP-SGD's sensitivity bound (one record moves the clipped sum by at most C) assumes that each record's gradient is a
function of that record alone. A padded batch breaks it silently when a record's computation depends on how much
padding the *longest other record* forced on it:

* left padding with a model that numbers positions ``0 … T−1`` whatever the padding (learned absolute positions:
  GPT-2, BERT) shifts every record's positions by its number of left pads (measured: 3.5·C on a GPT-2 LoRA);
* a padded batch without ``attention_mask``: every model attends to the padding (Llama 2.0·C, GPT-2 2.7·C);
* layers that mix the records of a batch (batch statistics), or several records packed into one row.

The check (:mod:`~opacus_spectral.doctor.batch_check` for the engine, :mod:`~opacus_spectral.hf.batch_check` for
``DPTrainer``) takes a few records, drops the *longest*, re-collates the rest with the user's own collator and compares
what each remaining record gets in both batches: its outputs of the model's forward (engine) or its per-example gradient
(``DPTrainer``). Rows are aligned by the attention mask (a record's real positions, whatever the padding). Tolerances
are relative to the record's own scale, by dtype (:data:`TOLERANCES`): a different padding length changes the matrix
shapes and so the summation order (measured 1.5e-7 in float32), while a coupling changes the result at order 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BatchDependenceError

__all__ = [
    "CAUSES",
    "TOLERANCES",
    "BatchDependenceError",
    "Comparison",
    "compare_gradients",
    "compare_outputs",
    "left_padded",
    "leaves",
    "positions_from_mask",
    "rebuild",
    "record_sizes",
    "split_records",
    "tolerance",
]

#: relative tolerance of a record's outputs / gradient between two paddings, by the dtype the model computes in
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}

CAUSES = (
    "Likely causes: (1) left padding with a model that numbers positions 0..T-1 whatever the padding (learned "
    "absolute positions: GPT-2, BERT) — pad on the right (tokenizer.padding_side='right') or pass "
    "position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0); (2) a padded batch without attention_mask — return "
    "and pass the attention mask; (3) a layer that uses statistics of the whole batch (BatchNorm-like) — "
    "opacus.validators.ModuleValidator.fix replaces them; (4) several records packed into one row."
)

Path = tuple[Any, ...]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each record's positions counted over its own tokens: ``cumsum(mask) − 1`` (0 on leading padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether some row has padding (0) before a real token (1)."""
    mask = attention_mask != 0
    return bool((~mask[:, :-1] & mask[:, 1:]).any())


def leaves(obj: Any, path: Path = ()) -> list[tuple[Path, torch.Tensor]]:
    """The tensors of a nested batch / call / model output (mappings, ``ModelOutput``, lists, tuples), with paths."""
    if torch.is_tensor(obj):
        return [(path, obj)]
    if isinstance(obj, Mapping) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
        return [leaf for k in obj.keys() for leaf in leaves(obj[k], (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, v in enumerate(obj) for leaf in leaves(v, (*path, i))]
    return []


def rebuild(obj: Any, values: Mapping[Path, Any], path: Path = ()) -> Any:
    """``obj`` with the leaves at ``values``' paths replaced (other leaves and non-tensors kept)."""
    if path in values:
        return values[path]
    if isinstance(obj, Mapping):
        return {k: rebuild(v, values, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(rebuild(v, values, (*path, i)) for i, v in enumerate(obj))
    return obj


def _size(collate: Callable[[list[Any]], Any], item: Any) -> int:
    return sum(t.numel() for _, t in leaves(collate([item])))


def record_sizes(items: Sequence[Any], collate: Callable[[list[Any]], Any]) -> list[int]:
    """Each record's size: the entries of its tensors collated alone."""
    return [_size(collate, item) for item in items]


def split_records(
    items: Sequence[Any], collate: Callable[[list[Any]], Any], keep: int = 3
) -> tuple[list[Any], int] | None:
    """The check batch drawn from ``items`` and the position of its longest record in it: that record and up to
    ``keep`` strictly shorter others (the shortest, the longest of them and evenly spaced sizes between), in their
    original order; ``None`` below two records."""
    if len(items) < 2:
        return None
    sizes = record_sizes(items, collate)
    longest = max(range(len(items)), key=lambda i: (sizes[i], -i))
    shorter = [i for i in range(len(items)) if sizes[i] < sizes[longest]]  # the dropped record alone sets the padding
    others = sorted(shorter or [i for i in range(len(items)) if i != longest], key=lambda i: (sizes[i], i))
    if len(others) > keep:
        others = [others[round(j * (len(others) - 1) / max(keep - 1, 1))] for j in range(keep)]
    chosen = sorted({*others, longest})
    return [items[i] for i in chosen], chosen.index(longest)


def tolerance(dtypes: Sequence[torch.dtype]) -> float:
    """The loosest tolerance among the dtypes the comparison involves (float32's for anything unknown)."""
    return max(TOLERANCES.get(d, TOLERANCES[torch.float32]) for d in dtypes)


@dataclass(frozen=True)
class Comparison:
    """What a comparison found: ``independent`` (``None``: nothing could be compared), the worst relative
    difference (for tests and the docs' cost table; never printed in an error, it is derived from the records), and
    why nothing was compared."""

    independent: bool | None
    worst: float = 0.0
    note: str = ""


def _record(t: torch.Tensor, mask: torch.Tensor | None, row: int) -> torch.Tensor:
    """Record ``row`` of output ``t``, over its real positions when dim 1 is the mask's sequence axis."""
    if mask is not None and t.dim() >= 2 and t.shape[1] == mask.shape[1]:
        return t[row][mask[row] != 0]
    return t[row]


def compare_outputs(
    full: Any,
    reduced: Any,
    *,
    dropped: int | Sequence[int],
    masks: tuple[torch.Tensor | None, torch.Tensor | None],
    tol: float,
) -> Comparison:
    """Compare every record but the ``dropped`` row(s) between the outputs of the full check batch and of the batch
    without them: each output tensor with a record axis (dim 0), record by record, aligned by the attention masks. An
    output whose sequence axis changed length with no mask to align it is a padded batch without ``attention_mask``."""
    gone = sorted({dropped} if isinstance(dropped, int) else set(dropped))
    reduced_leaves = dict(leaves(reduced))
    worst, compared, unaligned = 0.0, 0, False
    for path, a in leaves(full):
        b = reduced_leaves.get(path)
        if b is None or a.dim() == 0 or b.dim() == 0 or not a.is_floating_point():
            continue
        if b.shape[0] != a.shape[0] - len(gone):
            continue
        if a.shape[2:] != b.shape[2:] or (a.shape[1:2] != b.shape[1:2] and None in masks):
            unaligned = True
            continue
        for row in range(a.shape[0]):
            if row in gone:
                continue
            x, y = _record(a, masks[0], row), _record(b, masks[1], row - sum(g < row for g in gone))
            if x.shape != y.shape:
                unaligned = True
                continue
            worst, compared = max(worst, _relative(x, y)), compared + 1
    if compared == 0:
        note = "a padded batch without attention_mask" if unaligned else "no output of the forward has a record axis"
        return Comparison(False if unaligned else None, note=note)
    return Comparison(worst <= tol, worst)


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x − y| / max(|x|, |y|); a record non-finite in both batches is not compared (0: the doctor reports
    non-finite gradients), one non-finite in only one of them differs (∞)."""
    if not x.numel():
        return 0.0
    x, y = x.detach().double(), y.detach().double()
    finite = (bool(torch.isfinite(x).all()), bool(torch.isfinite(y).all()))
    if not all(finite):
        return 0.0 if not any(finite) else math.inf
    scale = max(float(x.abs().max()), float(y.abs().max()), 1e-30)
    return float((x - y).abs().max()) / scale


def compare_gradients(full: Sequence[torch.Tensor], reduced: Sequence[torch.Tensor], tol: float) -> Comparison:
    """Each remaining record's per-example gradient (flattened) in the full and the reduced batch."""
    worst = 0.0
    for g, h in zip(full, reduced, strict=True):
        g, h = g.detach().double(), h.detach().double()
        finite = (bool(torch.isfinite(g).all()), bool(torch.isfinite(h).all()))
        if not all(finite):
            worst = max(worst, 0.0 if not any(finite) else math.inf)
            continue
        scale = max(float(g.norm()), float(h.norm()), 1e-30)
        worst = max(worst, float((g - h).norm()) / scale)
    return Comparison(worst <= tol, worst)
