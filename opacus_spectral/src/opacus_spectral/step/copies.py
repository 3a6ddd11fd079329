"""Copying a private model or its ``DPOptimizer`` (``docs/engine.md``, "Copies of the model and the optimizer").

* The hook the doctor puts on the model calls the doctor while it is installed; a copy of the model
  (``copy.deepcopy`` for an EMA or teacher model, ``pickle`` / ``torch.save(model)``) gets an inert hook instead
  of a copy of the doctor with its optimizer, accountant and data loader (:class:`InertOnCopy`).
* A ``DPOptimizer`` this engine returns refuses ``copy.copy``, ``copy.deepcopy`` and ``pickle`` with a
  ``TypeError`` (:func:`refuse_copies`). Opacus' ``DPOptimizer`` keeps torch's ``Optimizer.__getstate__``, which
  saves only ``defaults``, ``state`` and ``param_groups``: the copy lacks ``original_optimizer`` and raises, and on
  the way torch's ``Optimizer.__setstate__`` wraps ``DPOptimizer.step`` at class level in a profiling wrapper that
  reads ``_optimizer_step_pre_hooks``, which no ``DPOptimizer`` has, so every ``DPOptimizer`` made afterwards in the
  process (vanilla Opacus too) fails to step. A working copy would also step outside the engine's accountant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COPY_REFUSED = (
    "a DPOptimizer cannot be copied or pickled: Opacus' DPOptimizer keeps only defaults/state/param_groups when "
    "copied (the copy has no original_optimizer), torch's Optimizer.__setstate__ would then patch DPOptimizer.step "
    "for every later DPOptimizer in the process, and a copy would step outside the engine's accountant. Save "
    "optimizer.state_dict() (engine.save_checkpoint), or copy the model and call make_private on the copy"
)


class InertOnCopy:
    """A hook that calls ``fn``; its copies (``copy``, ``deepcopy``, ``pickle``) are inert and call nothing."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return None if self.fn is None else self.fn(*args)

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return InertOnCopy, (None,)


def _refuse(*args: Any) -> Any:
    raise TypeError(COPY_REFUSED)


def refuse_copies(dp_optimizer: Any) -> None:
    """Make ``copy``, ``deepcopy`` and ``pickle`` of ``dp_optimizer`` raise :data:`COPY_REFUSED` (a ``TypeError``).

    An instance attribute: all three look ``__reduce_ex__`` up on the object, so the class (Opacus') is untouched."""
    dp_optimizer.__reduce_ex__ = _refuse
