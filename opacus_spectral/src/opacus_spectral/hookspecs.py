"""Every pluggy hook of opacus-spectral, in one place.

Plugins are modules (or objects) exposed through the entry-point group ``opacus_spectral``::

    [project.entry-points.opacus_spectral]
    my_plugin = "my_package.plugin"

and implement any of the hooks below with ``@opacus_spectral.hookimpl``. A plugin that fails to import
or whose hook signature does not match a spec is skipped with one warning; the others still load
(see :func:`opacus_spectral.plugins.registry.available_denoisers`).

Order: pluggy calls implementations last-registered-first (``docs/upstream.md`` §3.2). Nothing here depends
on that order: denoisers are applied in the order of the user's ``post_hooks`` list, and role answers are
merged in registration order, the first-registered plugin winning a conflict (see
:func:`opacus_spectral_parameter_roles`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy
from torch import nn

from .step.records import ParameterRole

PROJECT = "opacus_spectral"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def opacus_spectral_denoisers() -> Mapping[str, Callable[..., Any]]:  # type: ignore[empty-body]
    """Return the denoisers this plugin provides: ``{name: factory}``.

    ``factory(**kwargs)`` builds a denoiser (any callable on a sequence of
    :class:`~opacus_spectral.NoisyGradient`, usually a :class:`~opacus_spectral.Denoiser` subclass);
    ``kwargs`` come from ``post_hooks=[(name, {...})]``. Names must be unique across plugins: a duplicate
    is reported as a load error and the first-loaded one is kept.
    """


@hookspec
def opacus_spectral_noise_mechanisms() -> Mapping[str, Callable[..., Any]]:  # type: ignore[empty-body]
    """Return the noise mechanisms this plugin provides: ``{name: factory}``.

    ``factory(**kwargs)`` builds a :class:`~opacus_spectral.mechanisms.base.NoiseMechanism`; ``kwargs`` come from
    ``make_private(noise_mechanism=(name, {...}))``. A mechanism contributes a strategy only — banded Toeplitz
    coefficients (:class:`~opacus_spectral.mechanisms.strategy.BandedToeplitz`); the engine draws the noise, builds
    the sampler, computes κ and the accounting, and certifies every step (``docs/mechanisms.md``, "Writing a
    mechanism"). Names must be unique across plugins, like denoisers'; a built-in name is never replaced.
    """


@hookspec
def opacus_spectral_parameter_roles(  # type: ignore[empty-body]
    module: nn.Module,
) -> Mapping[str, ParameterRole | str] | None:
    """Tell denoisers what a parameter *is*.

    Given the user's (unwrapped) model, return ``{qualified_param_name: ParameterRole(role, layer)}`` for
    the parameters this plugin recognises (e.g. peft-lalora marks LoRA ``lora_A`` / ``lora_B`` factors and
    their layer), or ``None``. Names are those of ``module.named_parameters()``. Parameters no plugin names
    get the built-in role (``weight`` / ``bias`` / ``embedding``). When two plugins name the same
    parameter differently the one registered first wins and a warning is issued.
    """


@hookspec(firstresult=True)
def opacus_spectral_alternation_controller(trainer: Any) -> Any | None:
    """Attach an alternation controller to a ``DPTrainer`` about to train, and return it (``None``: not yours).

    Called once per ``DPTrainer.train()`` when ``DPTrainingArguments.alternation`` is true, before the optimizer
    exists. A controller changes which parameters train between DP steps (peft-lalora: the LoRA factor schedule of a
    LALoRA adapter); it attaches as a Trainer callback and freezes with ``trainer.set_trainable`` (Opacus' per-sample
    state included). Return ``None`` when the trainer's model carries none of your adapters or a controller is already
    attached. The first non-``None`` answer wins; an exception (a set-up the controller refuses) stops ``train()``.
    """
