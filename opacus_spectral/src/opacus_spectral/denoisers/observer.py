"""Read-only callables in the pipeline: loggers and monitors that see the records and change nothing.

A plain callable in ``post_hooks`` declares no output noise, so a spectral denoiser after it (``rmt``) cannot
trust the noise level and skips every record. ``observer(fn)`` declares the output noise equal to the input
noise — true because it also *checks* that ``fn`` changed nothing: an in-place edit of a record's tensor, a
replaced ``record.tensor`` or a return value other than ``None`` is an error, handled by the engine's
``on_denoiser_error`` policy like any bad denoiser output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..step.records import NoisyGradient
from .base import Denoiser, denoiser_name

__all__ = ["Observer", "observer"]


class Observer(Denoiser):
    """``fn(records)`` as a pass-through denoiser (gain 1), named after ``fn``; see :func:`observer`."""

    def __init__(self, fn: Callable[[Sequence[NoisyGradient]], Any]) -> None:
        if not callable(fn) or isinstance(fn, type):
            raise TypeError(f"observer() needs a callable on the records (a function), got {fn!r}")
        super().__init__()
        self.fn = fn
        self.name = denoiser_name(fn)

    def __call__(self, grads: Sequence[NoisyGradient]) -> None:
        before = [(g.tensor, g.tensor._version) for g in grads]
        result = self.fn(grads)
        if result is not None:
            raise TypeError(
                f"observer {self.name!r} returned {type(result).__name__}; an observer must return None (it only "
                "reads the records — a callable that changes gradients is a denoiser: give it output_noise instead)"
            )
        changed = [g.name for g, (t, v) in zip(grads, before, strict=True) if g.tensor is not t or t._version != v]
        if changed:
            raise RuntimeError(
                f"observer {self.name!r} changed the gradient of {changed[:3]} (in place or by replacing "
                "record.tensor); an observer only reads — .clone() what it keeps or edits"
            )

    def output_noise(self, grads: Sequence[NoisyGradient]) -> float:
        """The records are unchanged (checked after each call): same noise, gain 1."""
        return 1.0

    def __repr__(self) -> str:
        return f"observer({self.fn!r})"


def observer(fn: Callable[[Sequence[NoisyGradient]], Any]) -> Observer:
    """Mark ``fn(records)`` — a logger, a monitor — as a read-only pass-through for ``post_hooks``.

    Use it as ``post_hooks=[observer(log_norms), "rmt"]`` or as a decorator (``@observer``). The wrapper
    declares the output noise equal to the input noise (so ``rmt`` after it still acts) and enforces it: ``fn``
    must return ``None`` and leave every ``record.tensor`` unchanged, else the step follows ``on_denoiser_error``.
    """
    return Observer(fn)
