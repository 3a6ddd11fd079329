"""The denoiser contract: a callable over a sequence of :class:`NoisyGradient` records.

Optional parts, all read with ``getattr`` so a plain callable is a denoiser too: ``output_noise`` (the noise its
outputs carry), ``selector`` (a :class:`~opacus_spectral.step.selection.Selector`: the records the pipeline hands it),
state (``state_dict``/``load_state_dict``/``reset``) and ``gradient_estimator(module)`` (a
:class:`GradientEstimator` that replaces the training loop's ``backward``, ``docs/plugins.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..step.records import NoisyGradient
from ..step.selection import Selector

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


@runtime_checkable
class GradientEstimator(Protocol):
    """A pre-clip gradient estimator: what the training loop calls instead of ``loss_fn().backward()``.

    ``backward(loss_fn)`` runs the closure ``loss_fn`` (the loss of the current batch) as often as it needs and
    leaves the per-sample gradients Opacus then clips and noises (``p.grad_sample``); it returns the loss
    (e.g. DiSK's two-point gradient, the ``disk`` plugin). A denoiser offers one through
    :meth:`Denoiser.gradient_estimator`.
    """

    def backward(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...


class Denoiser:
    """Convenience base class with the optional parts of the contract.

    Subclasses implement :meth:`__call__`. Stateful denoisers override :meth:`state_dict`,
    :meth:`load_state_dict` and :meth:`reset`. A denoiser may publish per-step numbers in
    ``self.stats`` (a dict, values may be tensors — the pipeline never syncs them); the pipeline copies them into
    the step's :class:`~opacus_spectral.step.StepDiagnostics`.
    """

    #: registry name; set by subclasses
    name: str = "denoiser"
    #: averages the gradient over steps (a momentum of its own, e.g. ``ema``, ``doppler``): the engine then
    #: advises against optimizer momentum or an adaptive optimizer behind it (:mod:`~opacus_spectral.denoisers.advice`)
    temporal: bool = False
    #: acts only on records whose noise is isotropic with a known std (a spectral denoiser such as ``rmt``): the
    #: pipeline warns once when an earlier callable that declares no output noise makes it skip records
    needs_isotropic_noise: bool = False
    #: the records the pipeline hands this denoiser (default: all); subclasses set an instance attribute from
    #: their ``roles=``/``params=`` arguments (:meth:`Selector.build <opacus_spectral.step.selection.Selector.build>`)
    selector: Selector = Selector()
    #: the Opacus ``grad_sample_mode`` values its :meth:`gradient_estimator` works with (``None``: any)
    estimator_grad_sample_modes: tuple[str, ...] | None = None

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

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
        """Whether the parameter ``name`` with ``role`` is selected: ``self.selector.matches(name, role)``.

        The pipeline applies the selector itself and hands the denoiser only the records it selects; it warns
        once at installation when a denoiser selects none of the optimizer's parameters.
        """
        selector = self.selector
        return selector.matches(name, role) if isinstance(selector, Selector) else True

    def gradient_estimator(self, module: nn.Module) -> GradientEstimator | None:
        """A :class:`GradientEstimator` for the (Opacus-wrapped) ``module`` that replaces the training loop's
        ``backward``, or ``None`` (default: the ordinary backward)."""
        return None

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
