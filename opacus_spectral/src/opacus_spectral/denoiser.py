"""The denoiser contract: a callable over a sequence of :class:`NoisyGradient` records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .records import NoisyGradient


@runtime_checkable
class DenoiserProtocol(Protocol):
    """Anything callable on the step's records is a denoiser.

    It edits ``record.tensor`` in place and returns ``None``, or returns one replacement tensor per
    record (same shape, dtype and device; ``None`` entries keep the record's tensor). It keeps neither a
    record nor its tensor's memory after the call (``.clone()`` what it keeps; ``.detach()`` shares the
    memory, ``docs/upstream.md`` §1.5); the engine copies outputs into fresh ``p.grad`` memory, so returning a
    tensor it keeps is fine.
    """

    def __call__(self, grads: Sequence[NoisyGradient]) -> Sequence[torch.Tensor | None] | None: ...


class Denoiser:
    """Convenience base class with the optional parts of the contract.

    Subclasses implement :meth:`__call__`. Stateful denoisers override :meth:`state_dict`,
    :meth:`load_state_dict` and :meth:`reset`. A denoiser may publish per-step numbers in
    ``self.diagnostics`` (a dict, values may be tensors — the pipeline never syncs them).
    """

    #: registry name; set by subclasses
    name: str = "denoiser"

    def __init__(self) -> None:
        self.diagnostics: dict[str, Any] = {}

    def __call__(self, grads: Sequence[NoisyGradient]) -> Sequence[torch.Tensor | None] | None:
        raise NotImplementedError

    def selects(self, name: str, role: str) -> bool:
        """Whether this denoiser may act on the parameter ``name`` with ``role`` (default: every one).

        Denoisers with ``roles=``/``params=`` selectors override it; the engine warns once at installation
        when a denoiser selects none of the optimizer's parameters (a typo would otherwise do nothing).
        """
        return True

    def selector(self) -> str:
        """How the selector is shown in that warning."""
        return "all parameters"

    def reset(self) -> None:
        """Forget any state carried across steps."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def denoiser_name(d: object) -> str:
    """A human-readable name for error messages and diagnostics."""
    name = getattr(d, "name", None)
    if isinstance(name, str):
        return name
    return getattr(d, "__name__", type(d).__name__)
