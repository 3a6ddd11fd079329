"""The denoiser contract: a callable over a sequence of :class:`NoisyGradient` records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .records import NoisyGradient

#: what :meth:`Denoiser.output_noise` returns: a gain or a kind, for all records or one per record
NoiseDeclaration = float | str | Sequence[float | str]


@runtime_checkable
class DenoiserProtocol(Protocol):
    """Anything callable on the step's records is a denoiser.

    It edits ``record.tensor`` in place and returns ``None``, or returns one replacement tensor per
    record (same shape, dtype and device; ``None`` entries keep the record's tensor). It keeps neither a
    record nor its tensor's memory after the call (``.clone()`` what it keeps; ``.detach()`` shares the
    memory, ``docs/upstream.md`` §1.5); the engine copies outputs into fresh ``p.grad`` memory, so returning a
    tensor it keeps is fine. Outputs must be plain dense tensors (no sparse layout, no subclass). Optionally it
    declares the noise its outputs carry with ``output_noise(grads)`` (see :meth:`Denoiser.output_noise`; a
    callable without it counts as ``"unknown"``; a read-only logger is wrapped with :func:`~opacus_spectral.observer`).
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
    #: averages the gradient over steps (a momentum of its own, e.g. ``ema``, ``doppler``): the engine then
    #: advises against optimizer momentum or an adaptive optimizer behind it (:mod:`~opacus_spectral.advice`)
    temporal: bool = False
    #: acts only on records whose noise is isotropic with a known std (a spectral denoiser such as ``rmt``): the
    #: pipeline warns once when an earlier callable that declares no output noise makes it skip records
    needs_isotropic_noise: bool = False

    def __init__(self) -> None:
        self.diagnostics: dict[str, Any] = {}

    def __call__(self, grads: Sequence[NoisyGradient]) -> Sequence[torch.Tensor | None] | None:
        raise NotImplementedError

    def output_noise(self, grads: Sequence[NoisyGradient]) -> NoiseDeclaration:
        """What noise this call's outputs carry, per record (called by the pipeline right after ``__call__``).

        A number ``g`` (for all records or one per record) says: the output noise is still i.i.d. Gaussian, with
        per-entry std ``g × record.sigma`` — e.g. a pass-through (1.0) or a linear temporal filter
        (``‖h‖₂`` of its impulse response, ``docs/math.md`` §4.1–§4.2). ``"colored"``: still Gaussian but
        correlated across entries (a spatial filter); ``"unknown"``: anything else. The pipeline applies the
        declaration (a denoiser cannot set ``sigma`` itself); the default is ``"unknown"``, so a spectral
        denoiser placed after an undeclared one skips its records rather than assume a wrong noise level.
        """
        return "unknown"

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


def declares_noise(d: object) -> bool:
    """Whether ``d`` declares its output noise: it has an ``output_noise`` other than :class:`Denoiser`'s default."""
    declare = getattr(d, "output_noise", None)
    return declare is not None and getattr(declare, "__func__", None) is not Denoiser.output_noise
