"""The engine's batch-independence check on the user's own model, loader and forward call (``docs/engine.md``,
"Batch independence"; the comparisons: :mod:`~opacus_spectral.doctor.batch_independence`).

``make_private`` cannot see the loss, so it compares outputs of the model's forward. At the first training-mode
forward of a non-empty batch it learns how the user calls the model: every tensor of that call with a record axis
must equal (up to device and dtype) a tensor of the batch the DP loader just collated — the check keeps the last
records the loader's ``collate_fn`` received and what it returned (in-process loaders, ``num_workers=0``). It then
takes a few records of the dataset (the longest of its first 64 and up to three others), collates them with that
``collate_fn``, once with and once without the longest, calls the model the same way on both — in eval mode (no
dropout), without gradients, with Opacus' per-sample hooks off and under a forked RNG, so training is bit-identical
with and without the check — and compares the remaining records' outputs. Then it removes itself.

Outcomes: a difference raises :class:`~opacus_spectral.doctor.batch_independence.BatchDependenceError`
(``batch_check="raise"``, the default) or warns (``"warn"``); a set-up the check cannot read (worker processes, a call
whose tensors are not the collated batch's, outputs without a record axis, ``batch_first=False``) warns
:class:`BatchCheckWarning` once.
"""

from __future__ import annotations

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
from .batch_independence import CAUSES, Comparison, compare_outputs, leaves, rebuild, split_records, tolerance

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
CANDIDATES = 64  #: dataset records the check chooses its batch from


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
def quiet_forward(model: nn.Module, owner: Any) -> Iterator[None]:
    """Eval mode, Opacus' hooks off (``owner.hooks_enabled``), a forked RNG; everything restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    enabled = getattr(owner, "hooks_enabled", None)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        model.eval()
        if enabled is not None:
            owner.hooks_enabled = False
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            if enabled is not None:
                owner.hooks_enabled = enabled


def autocast_dtypes(device_type: str) -> list[torch.dtype]:
    """The dtype autocast computes in on ``device_type`` right now (empty: autocast off)."""
    return [torch.get_autocast_dtype(device_type)] if torch.is_autocast_enabled(device_type) else []


class BatchCheck:
    """Installed by ``make_private`` (see the module docstring). ``outcome`` and ``seconds`` once it ran."""

    def __init__(self, module: Any, data_loader: Any, *, mode: Literal["raise", "warn"]) -> None:
        self.mode, self.module, self.loader = mode, module, data_loader
        self.model = unwrap(module)
        self.outcome: Comparison | None = None
        self.seconds: float | None = None
        self._running = False
        self._recorder: CollateRecorder | None = None
        target = module if isinstance(module, GradSampleModuleExpandedWeights) else self.model
        self._hook = target.register_forward_pre_hook(InertOnCopy(self._on_forward), with_kwargs=True)
        if getattr(data_loader, "num_workers", 0):
            self._skip(
                "the DP data loader collates in worker processes (num_workers > 0); run the first steps with "
                "num_workers=0 to have the set-up checked"
            )
        elif getattr(data_loader, "collate_fn", None) is None:
            self._skip("the data loader has no collate_fn")
        else:
            self._recorder = CollateRecorder(data_loader.collate_fn)
            data_loader.collate_fn = self._recorder

    @property
    def done(self) -> bool:
        return self._hook is None

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

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._running or self._recorder is None or not (self.model.training and torch.is_grad_enabled()):
            return
        last = self._recorder.last
        if last is None or not last[0]:
            return  # an empty Poisson batch: wait for one with records
        self._running = True
        start = time.perf_counter()
        try:
            self._check(args, kwargs, *last)
        finally:
            self._running = False
            self.seconds = time.perf_counter() - start

    def _check(self, args: Any, kwargs: Any, items: list[Any], collated: Any) -> None:
        call = (tuple(args), dict(kwargs))
        mapping = _map_call(call, collated, len(items))
        if mapping is None:
            return self._skip(
                "the model's inputs are not the tensors the DP data loader collated (the check "
                "rebuilds them from re-collated records)"
            )
        chosen = split_records(_candidates(self.loader.dataset, items), self._recorder.collate)
        if chosen is None:
            return self._skip("fewer than two records to compare")
        records, dropped = chosen
        outputs, masks, dtypes = [], [], []
        for batch_items in (records, records[:dropped] + records[dropped + 1 :]):
            batch = self._recorder.collate(batch_items)
            values = _call_values(call, mapping, batch)
            if values is None:
                return self._skip("the re-collated records lack a tensor the model's call takes")
            with quiet_forward(self.model, self.module), torch.no_grad():
                out = self.model(*rebuild(call[0], values[0]), **rebuild(call[1], values[1]))
            dtypes += [t.dtype for _, t in leaves(out) if t.is_floating_point()]
            outputs.append(out)
            masks.append(_mask(batch))
        device_type = next(self.model.parameters()).device.type
        tol = tolerance(dtypes + autocast_dtypes(device_type))
        self.outcome = compare_outputs(*outputs, dropped=dropped, masks=(masks[0], masks[1]), tol=tol)
        self.remove()
        self._report(self.outcome, tol)

    def _report(self, outcome: Comparison, tol: float) -> None:
        if outcome.independent is None:
            return self._skip(outcome.note)
        if outcome.independent:
            return None
        text = (
            "batch independence check failed: the model's outputs for a record changed when the longest record "
            f"of its batch was removed and the rest re-collated ({outcome.note or f'beyond the tolerance {tol:g}'}). "
            "Each record's clipped gradient then depends on which other records were sampled, so one record can move "
            "the clipped sum by more than max_grad_norm and the privacy guarantee is void. " + CAUSES
        )
        if self.mode == "raise":
            raise BatchDependenceError(text)
        warnings.warn(text, BatchCheckWarning, stacklevel=external_stacklevel())
        return None


def _candidates(dataset: Any, items: list[Any]) -> list[Any]:
    """The dataset's first records (deterministic: no RNG, the same for every run), else the batch's."""
    try:
        n = min(len(dataset), CANDIDATES)
        return [dataset[i] for i in range(n)]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return items


def _map_call(call: Any, collated: Any, n: int) -> dict[tuple, tuple] | None:
    """call path -> batch path for every call tensor with ``n`` records; ``None`` if one is not the batch's."""
    batch = leaves(collated)
    mapping = {}
    for path, t in leaves(call):
        if t.dim() == 0 or t.shape[0] != n:
            continue
        found = [bp for bp, u in batch if u.shape == t.shape and _same(u.to(t.device, t.dtype), t)]
        if not found:
            return None
        mapping[path] = found[0]
    return mapping or None


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
        if bpath not in found:
            return None
        t = originals[path]
        values[path[0]][path[1:]] = found[bpath].to(t.device, t.dtype)
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
