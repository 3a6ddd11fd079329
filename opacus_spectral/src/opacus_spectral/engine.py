"""``opacus_spectral.PrivacyEngine``: Opacus' engine plus post-noise denoisers.

A drop-in subclass: without ``post_hooks`` it trains exactly like ``opacus.PrivacyEngine`` (same
optimizer classes, same noise, same accountant — bit-identical parameters for the same seeds); the only
difference is the alternation-safe GradSampleModule (identical maths, see :mod:`.grad_sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import opacus
from opacus.grad_sample import AbstractGradSampleModule
from opacus.grad_sample.utils import get_gsm_class
from torch.distributed._composable.fsdp import FSDPModule
from torch import nn

from .grad_sample import check_per_sample_support, safe_class
from .installation import HANDLE_ATTR, PostHookHandle, install_post_hooks

CHECKPOINT_KEY = "opacus_spectral_post_hooks"
from .pipeline import OnError
from .registry import HookSpec, Registry


class PrivacyEngine(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` whose ``make_private`` takes ``post_hooks=[...]``.

    After ``make_private`` the installed pipeline is ``engine.post_hooks`` (a :class:`PostHookHandle` with
    ``diagnostics``, ``state_dict()`` and ``remove()``), or ``None`` when ``post_hooks`` was not given.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False, registry: Registry | None = None):
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        self.registry = registry
        self.post_hooks: PostHookHandle | None = None

    # Opacus builds the GradSampleModule here; swap in the alternation-safe classes.
    def _prepare_model(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        max_grad_norm: float | list[float] = 1.0,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
    ) -> Any:
        if grad_sample_mode == "ghost_fsdp" or isinstance(module, FSDPModule):
            raise NotImplementedError(
                "FSDP is not supported by opacus_spectral v1 (sharded DTensor gradients); use DDP or opacus.PrivacyEngine"
            )
        check_per_sample_support(module)
        cls = safe_class(grad_sample_mode, wrap_model)
        if wrap_model and isinstance(module, AbstractGradSampleModule):
            # a module this engine (or Opacus) already wrapped, e.g. make_private called again
            accepted = {get_gsm_class(grad_sample_mode), cls}
            if (
                module.batch_first != batch_first
                or module.loss_reduction != loss_reduction
                or type(module) not in accepted
            ):
                raise ValueError(
                    f"pre-existing {type(module).__name__} does not match batch_first={batch_first}, "
                    f"loss_reduction={loss_reduction!r}, grad_sample_mode={grad_sample_mode!r}; pass the plain module"
                )
            return module
        if cls is None:
            return super()._prepare_model(
                module,
                batch_first=batch_first,
                max_grad_norm=max_grad_norm,
                loss_reduction=loss_reduction,
                grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model,
            )
        self.validate(module=module, optimizer=None, data_loader=None)
        kwargs: dict[str, Any] = {"batch_first": batch_first, "loss_reduction": loss_reduction}
        if grad_sample_mode == "functorch":
            kwargs["force_functorch"] = True
        if grad_sample_mode == "ghost":
            kwargs["max_grad_norm"] = max_grad_norm
        return cls(module, **kwargs)

    def make_private(  # type: ignore[override]
        self,
        *args: Any,
        post_hooks: Sequence[HookSpec] | None = None,
        on_denoiser_error: OnError = "raise",
        oracle: bool = False,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """``opacus.PrivacyEngine.make_private`` plus denoisers.

        Args:
            post_hooks: denoisers applied to the noisy gradient every logical step, in this order: registered
                names (``"rmt"``), ``(name, {kwargs})`` pairs or denoiser callables. ``None``: no pipeline.
            on_denoiser_error: ``"raise"`` or ``"fallback"`` (see :class:`~opacus_spectral.pipeline.PostNoisePipeline`).
            oracle: record cosines to the clean clipped gradient each step (benchmarks only).

        Returns what Opacus returns: ``(module, optimizer, data_loader)``, or with ghost clipping
        ``(module, optimizer, criterion, data_loader)``.
        """
        self._drop_previous_pipeline(kwargs.get("optimizer"))
        out = super().make_private(*args, **kwargs)
        if post_hooks is not None:
            module, optimizer = out[0], out[1]
            # installed after super() returns: the accountant's step hook is attached last inside make_private
            self.post_hooks = install_post_hooks(
                optimizer,
                post_hooks,
                module=module,
                on_error=on_denoiser_error,
                oracle=oracle,
                registry=self.registry,
            )
        return out

    def make_private_with_epsilon(  # type: ignore[override]
        self,
        *args: Any,
        post_hooks: Sequence[HookSpec] | None = None,
        on_denoiser_error: OnError = "raise",
        oracle: bool = False,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """``opacus.PrivacyEngine.make_private_with_epsilon`` plus ``post_hooks`` (kept out of Opacus' kwargs)."""
        self._drop_previous_pipeline(kwargs.get("optimizer"))
        out = super().make_private_with_epsilon(*args, **kwargs)
        if post_hooks is not None:
            self.post_hooks = install_post_hooks(
                out[1], post_hooks, module=out[0], on_error=on_denoiser_error, oracle=oracle, registry=self.registry
            )
        return out

    def _drop_previous_pipeline(self, optimizer: Any) -> None:
        """A new make_private on an optimizer that already carries a pipeline starts without it (whatever
        ``post_hooks`` says now): the old pipeline would otherwise keep running on the new DPOptimizer."""
        if self.post_hooks is not None:
            self.post_hooks.remove()
            self.post_hooks = None
        inner = getattr(optimizer, "original_optimizer", optimizer)
        old = getattr(inner, HANDLE_ATTR, None)
        if old is not None:
            old.remove()

    # Opacus' checkpoint helpers, plus the pipeline's state (stateful denoisers, step counter).
    def save_checkpoint(self, *, checkpoint_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        checkpoint_dict = dict(checkpoint_dict or {})
        if self.post_hooks is not None:
            checkpoint_dict[CHECKPOINT_KEY] = self.post_hooks.state_dict()
        super().save_checkpoint(checkpoint_dict=checkpoint_dict, **kwargs)

    def load_checkpoint(self, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        checkpoint = super().load_checkpoint(**kwargs)
        state = checkpoint.pop(CHECKPOINT_KEY, None)
        if state is not None:
            if self.post_hooks is None:
                raise ValueError(
                    "the checkpoint holds post-hook (denoiser) state but this engine has no post_hooks; call "
                    "make_private(..., post_hooks=[...]) with the same denoisers before load_checkpoint"
                )
            self.post_hooks.load_state_dict(state)
        return checkpoint
