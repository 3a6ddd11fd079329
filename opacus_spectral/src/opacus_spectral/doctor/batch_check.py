"""The engine's batch-independence audit on the user's own model, loader and forward call, on the run's own batches
(``docs/engine.md``, "Batch independence"; the comparisons: :mod:`~opacus_spectral.doctor.batch_independence`).

``make_private`` cannot see the loss, so it compares outputs of the model's forward. It keeps the last records the
loader's ``collate_fn`` received and what it returned (in-process loaders, ``num_workers=0``), and audits training
forwards of batches of two or more records: the first :data:`DENSE` of them, then forward k with probability
:data:`SPARSE`/k, drawn from OS entropy (unpredictable to the loop). An audit removes one record of the batch actually
sampled — the longest, the shortest and a random one in turn — re-collates the rest with the loader's ``collate_fn``,
calls the model the same way on both batches (every tensor of the call with a record axis must be one the loader
collated, or ``position_ids`` derived from its attention mask) and compares the remaining records' outputs. The
forwards run without gradients, with Opacus' per-sample hooks off, under a forked RNG and with the model's buffers
restored afterwards, so training is bit-identical with and without the audit; they run in training mode (so a layer
that mixes the batch only in training — batch statistics — is seen) with dropout modules off, unless the model's
training forward is not deterministic on the same batch (functional dropout), in which case in eval mode.

Outcomes: a difference raises :class:`~opacus_spectral.doctor.batch_independence.BatchDependenceError`
(``batch_check="raise"``, the default) or warns (``"warn"``); a set-up the check cannot read (worker processes, a call
whose tensors are not the collated batch's, outputs without a record axis, ``batch_first=False``) warns
:class:`BatchCheckWarning` once.
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from opacus.grad_sample import GradSampleModuleExpandedWeights
from torch import nn

from ..denoisers.advice import external_stacklevel
from ..errors import BatchCheckWarning, BatchDependenceError
from ..step.copies import InertOnCopy
from ..step.parameters import unwrap
from .batch_independence import (
    CAUSES,
    Comparison,
    compare_outputs,
    leaves,
    positions_from_mask,
    rebuild,
    record_sizes,
    tolerance,
)

__all__ = [
    "CANDIDATES",
    "BatchCheck",
    "BatchCheckSetting",
    "BatchCheckWarning",
    "autocast_dtypes",
    "install_batch_check",
    "quiet_forward",
]

BatchCheckSetting = Literal["raise", "warn"] | bool
CANDIDATES = 64  #: dataset records DPTrainer's one-off check draws (at random over the whole dataset)
DENSE = 8  #: the first training forwards of batches with two or more records: every one audited
SPARSE = 4  #: after them, forward k (0-based) is audited with probability SPARSE / (k + 1)
REMOVALS = ("longest", "shortest", "random")  #: the record an audit removes, in turn
DERIVED = "<positions from the mask at>"  #: mapping marker: a call's position_ids computed from a 0/1 mask of the batch


class CollateRecorder:
    """The loader's ``collate_fn``, keeping the last records it received and what it returned."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.last: tuple[list[Any], Any] | None = None

    def __call__(self, items: list[Any]) -> Any:
        out = self.collate(items)
        self.last = (list(items), out)
        return out


@contextmanager
def quiet_forward(model: nn.Module, owner: Any, *, train: bool = False) -> Iterator[None]:
    """Forwards that leave training untouched: eval mode, or (``train``) training mode with dropout modules off;
    Opacus' hooks off (``owner.hooks_enabled``), a forked RNG, and modes and buffers (running statistics) restored."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    enabled = getattr(owner, "hooks_enabled", None)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        model.train(train)
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
        if enabled is not None:
            owner.hooks_enabled = False
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            if enabled is not None:
                owner.hooks_enabled = enabled


def autocast_dtypes(device_type: str) -> list[torch.dtype]:
    """The dtype autocast computes in on ``device_type`` right now (empty: autocast off)."""
    return [torch.get_autocast_dtype(device_type)] if torch.is_autocast_enabled(device_type) else []


class BatchCheck:
    """Installed by ``make_private`` (see the module docstring). ``outcome`` and ``seconds``: the last audit's;
    ``audits``: how many ran; ``forwards``: the training forwards of batches with two or more records seen."""

    def __init__(self, module: Any, data_loader: Any, *, mode: Literal["raise", "warn"]) -> None:
        self.mode, self.module, self.loader = mode, module, data_loader
        self.model = unwrap(module)
        self.outcome: Comparison | None = None
        self.seconds: float | None = None
        self.total_seconds = 0.0  #: the audits' time so far (the cost table of docs/results/batch_check_cost.json)
        self.audits = self.forwards = 0
        self.train_mode: bool | None = None  #: whether audits run in training mode (decided at the first)
        self._running = False
        self._recorder: CollateRecorder | None = None
        target = module if isinstance(module, GradSampleModuleExpandedWeights) else self.model
        self._hook = target.register_forward_pre_hook(InertOnCopy(self._on_forward), with_kwargs=True)
        if getattr(data_loader, "num_workers", 0):
            self._skip(
                "the DP data loader collates in worker processes (num_workers > 0); run with num_workers=0 to have "
                "the run's batches audited"
            )
        elif getattr(data_loader, "collate_fn", None) is None:
            self._skip("the data loader has no collate_fn")
        else:
            self._recorder = CollateRecorder(data_loader.collate_fn)
            data_loader.collate_fn = self._recorder

    @property
    def done(self) -> bool:
        """Whether at least one audit ran (or the audit is off)."""
        return self.audits > 0 or self._hook is None

    def remove(self) -> None:
        """Detach (the loader's ``collate_fn`` as it was)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._recorder is not None and self.loader.collate_fn is self._recorder:
            self.loader.collate_fn = self._recorder.collate
        self._recorder = None

    def _skip(self, why: str) -> None:
        self.remove()
        warnings.warn(
            f"opacus_spectral: batch independence not checked: {why} (docs/engine.md, 'Batch independence')",
            BatchCheckWarning,
            stacklevel=external_stacklevel(),
        )

    def scheduled(self, k: int) -> bool:
        """Whether training forward ``k`` is audited: all of the first :data:`DENSE`, then with probability
        :data:`SPARSE` / (k + 1), from OS entropy."""
        return k < DENSE or secrets.randbelow(k + 1) < SPARSE

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._running or self._recorder is None or not (self.model.training and torch.is_grad_enabled()):
            return
        last = self._recorder.last
        if last is None or len(last[0]) < 2:
            return  # an empty or one-record batch: nothing to compare
        k, self.forwards = self.forwards, self.forwards + 1
        if not self.scheduled(k):
            return
        self._running = True
        start = time.perf_counter()
        try:
            self._check(args, kwargs, *last)
        finally:
            self._running = False
            self.seconds = time.perf_counter() - start
            self.total_seconds += self.seconds

    def _check(self, args: Any, kwargs: Any, items: list[Any], collated: Any) -> None:
        call = (tuple(args), dict(kwargs))
        mapping = _map_call(call, collated, len(items))
        if mapping is None:
            return self._skip(
                "the model's inputs are not the tensors the DP data loader collated (the audit "
                "rebuilds them from re-collated records)"
            )
        removal = REMOVALS[self.audits % len(REMOVALS)]
        removed = _pick(items, removal, self._recorder.collate)
        reduced = self._recorder.collate([item for i, item in enumerate(items) if i not in removed])
        calls = [_call_values(call, mapping, batch) for batch in (collated, reduced)]
        if None in calls:
            return self._skip("the re-collated records lack a tensor the model's call takes")
        if self.train_mode is None:
            self.train_mode = self._deterministic_in_training(call, calls[0])
        outputs, dtypes = [], []
        for values in calls:
            out = self._forward(call, values)
            dtypes += [t.dtype for _, t in leaves(out) if t.is_floating_point()]
            outputs.append(out)
        device_type = next(self.model.parameters()).device.type
        tol = tolerance(dtypes + autocast_dtypes(device_type))
        masks = (_mask(collated), _mask(reduced))
        dropped = _dropped_rows(collated, reduced, removed)
        self.outcome = compare_outputs(*outputs, dropped=dropped, masks=masks, tol=tol)
        self.audits += 1
        self._report(self.outcome, tol, removal)

    def _forward(self, call: Any, values: tuple[dict, dict], *, seed: int | None = None) -> Any:
        with quiet_forward(self.model, self.module, train=bool(self.train_mode)), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            return self.model(*rebuild(call[0], values[0]), **rebuild(call[1], values[1]))

    def _deterministic_in_training(self, call: Any, values: tuple[dict, dict]) -> bool:
        """Whether two training-mode forwards of the same batch under different RNG states agree (no dropout but
        its modules, which the audit turns off): then the audits run in training mode, else in eval mode."""
        self.train_mode = True
        a, b = (self._forward(call, values, seed=secrets.randbits(62)) for _ in range(2))
        return all(torch.equal(x, y) for (_, x), (_, y) in zip(leaves(a), leaves(b), strict=True))

    def _report(self, outcome: Comparison, tol: float, removal: str) -> None:
        if outcome.independent is None:
            return self._skip(outcome.note)
        if outcome.independent:
            return None
        found = outcome.note or f"a relative change of about {_magnitude(outcome.worst)} (tolerance {tol:g})"
        text = (
            f"batch independence audit failed at DP training forward {self.forwards}: the model's outputs for the "
            f"other records of the batch changed when its {removal} record was removed and the rest re-collated "
            f"({found}). Each record's clipped gradient then depends on which other records were sampled, so one "
            "record can move the clipped sum by more than max_grad_norm and the privacy guarantee is void. The "
            "step is stopped before its update. " + CAUSES
        )
        if self.mode == "raise":
            raise BatchDependenceError(text)
        warnings.warn(text, BatchCheckWarning, stacklevel=external_stacklevel())
        return None


def _magnitude(x: float) -> str:
    """An order of magnitude, not a value derived from the records to many digits."""
    return "∞" if not math.isfinite(x) else f"1e{math.floor(math.log10(x)):+d}" if x > 0 else "0"


def _pick(items: list[Any], removal: str, collate: Any) -> list[int]:
    """The indices of the records an audit removes: every longest, or every shortest record (by collated size: a
    longest record tied with another would leave the padding as it was), or one drawn from OS entropy; never all of
    them (the first stays)."""
    if removal == "random":
        return [secrets.randbelow(len(items))]
    sizes = record_sizes(items, collate)
    extreme = max(sizes) if removal == "longest" else min(sizes)
    chosen = [i for i, size in enumerate(sizes) if size == extreme]
    return chosen[1:] if len(chosen) == len(items) else chosen


def _dropped_rows(full: Any, reduced: Any, removed: list[int]) -> list[int]:
    """The rows of the removed records in the collated batch: those left over when the reduced batch's input rows
    are matched, in order, to the full batch's (rows compared over the columns both batches have, at either end:
    padding may have shrunk), so that a collator that reorders (say, longest first) is compared record by record;
    ``removed`` when the rows cannot be matched that way."""
    pairs = [(a, b) for (_, a), (_, b) in zip(leaves(full), leaves(reduced), strict=False) if a.dim() > 0]
    if not pairs or any(b.shape[0] != a.shape[0] - len(removed) or a.shape[2:] != b.shape[2:] for a, b in pairs):
        return removed
    n, m, gone, j = pairs[0][0].shape[0], pairs[0][1].shape[0], [], 0
    for r in range(n):
        if j < m and all(_rows_match(a[r], b[j]) for a, b in pairs):
            j += 1
        else:
            gone.append(r)
    return gone if j == m and len(gone) == len(removed) else removed


def _rows_match(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal rows, or (a sequence axis of another length) equal on the shorter one's columns at either end."""
    if x.shape == y.shape:
        return torch.equal(x, y)
    if x.dim() == 0 or y.dim() == 0 or x.shape[1:] != y.shape[1:]:
        return False
    k = min(x.shape[0], y.shape[0])
    return torch.equal(x[:k], y[:k]) or torch.equal(x[x.shape[0] - k :], y[y.shape[0] - k :])


def _map_call(call: Any, collated: Any, n: int) -> dict[tuple, tuple] | None:
    """call path -> batch path for every call tensor with ``n`` records (``position_ids`` the loop computed from the
    attention mask: :data:`DERIVED_POSITIONS`); ``None`` if one is not the batch's."""
    batch = leaves(collated)
    mapping: dict[tuple, tuple] = {}
    for path, t in leaves(call):
        if t.dim() == 0 or t.shape[0] != n:
            continue
        found = [bp for bp, u in batch if u.shape == t.shape and _same(u.to(t.device, t.dtype), t)]
        derived = [bp for bp, u in batch if t.dim() == 2 and _is_mask(u, t) and _same(_positions(u, t), t)]
        if found:
            mapping[path] = found[0]
        elif path and path[-1] == "position_ids" and derived:  # the loop numbered each record's own tokens
            mapping[path] = (DERIVED, *derived[0])
        else:
            return None
    return mapping or None


def _is_mask(u: torch.Tensor, like: torch.Tensor) -> bool:
    """A 0/1 tensor of ``like``'s shape (an attention mask, whatever its name in the batch)."""
    return u.shape == like.shape and not u.is_floating_point() and bool(((u == 0) | (u == 1)).all())


def _positions(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return positions_from_mask(mask).to(like.device, like.dtype)


def _same(u: torch.Tensor, t: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: a record with a NaN is still the same record)."""
    if t.is_floating_point() or t.is_complex():
        return bool(torch.allclose(u, t, rtol=0.0, atol=0.0, equal_nan=True))
    return torch.equal(u, t)


def _call_values(call: Any, mapping: dict[tuple, tuple], batch: Any) -> tuple[dict, dict] | None:
    """The (args, kwargs) replacement values for a re-collated ``batch``: each mapped tensor on the call's device
    and dtype."""
    found = dict(leaves(batch))
    originals = dict(leaves(call))
    values: tuple[dict, dict] = ({}, {})
    for path, bpath in mapping.items():
        t = originals[path]
        derived = bool(bpath) and bpath[0] == DERIVED
        source = bpath[1:] if derived else bpath
        if source not in found:
            return None
        values[path[0]][path[1:]] = _positions(found[source], t) if derived else found[source].to(t.device, t.dtype)
    return values


def _mask(batch: Any) -> torch.Tensor | None:
    for path, t in leaves(batch):
        if path and path[-1] == "attention_mask" and t.dim() == 2:
            return t
    return None


def install_batch_check(module: Any, data_loader: Any, setting: BatchCheckSetting, *, batch_first: bool) -> Any:
    """A :class:`BatchCheck` for ``make_private``'s model and DP loader (``None``: off, or ``batch_first=False``)."""
    if setting is False or setting is None:
        return None
    if setting is True:
        setting = "raise"
    if setting not in ("raise", "warn"):
        raise ValueError(f"batch_check must be 'raise', 'warn' or False, got {setting!r}")
    if not batch_first:
        warnings.warn(
            "opacus_spectral: batch independence not checked: batch_first=False (docs/engine.md)",
            BatchCheckWarning,
            stacklevel=external_stacklevel(),
        )
        return None
    return BatchCheck(module, data_loader, mode=setting)
