"""Installing the post-noise pipeline on an Opacus optimizer.

Where it runs (``../shared/notes/upstream.md`` §1.3): a step **pre-hook on the inner optimizer**
(``dp_optimizer.original_optimizer``). That hook fires after Opacus' clipping, noise, scaling, accountant
and — under DDP — the all-reduce, for every Opacus optimizer class, and once per logical step
(BatchMemoryManager's virtual steps never reach the inner optimizer). Opacus' single ``step_hook`` slot is
*chained* (never replaced): the previous hook (the accountant) runs first, then a snapshot of sigma, which
for AdaClip must be taken before the clipping bound is updated.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from opacus.optimizers import (
    DPOptimizer,
    DPPerLayerOptimizer,
    FSDPOptimizerFastGradientClipping,
)
from torch import nn

from .calibration import clean_scale, noise_std, world_size
from .pipeline import (
    DEFAULT_MAX_OUTPUT_RATIO,
    DenoiserError,
    NonFiniteGradientError,
    OnError,
    OnNonFinite,
    PipelineDiagnostics,
    PostNoisePipeline,
)
from .registry import HookSpec, Registry, create_denoisers, get_registry
from .roles import ParamInfo, describe_parameters

HANDLE_ATTR = "_opacus_spectral_handle"


class PostHookHandle:
    """A live installation of the pipeline on one DPOptimizer. ``remove()`` detaches it."""

    def __init__(
        self,
        dp_optimizer: DPOptimizer,
        pipeline: PostNoisePipeline,
        module: nn.Module | None,
        registry: Registry | None,
    ) -> None:
        self.optimizer = dp_optimizer
        self.pipeline = pipeline
        self._module = module
        self._registry = registry
        # names are fixed once, by position in the inner optimizer's param groups (not the changing
        # trainable subset), so a stateful denoiser keyed by name never mixes two tensors under alternation
        self._infos: dict[int, ParamInfo] = self._describe()
        pipeline.check_selection(list(self._infos.values()))
        self._sigma: float | None = None
        self._scale: float | None = None
        self._removed = False
        self._prev_step_hook = dp_optimizer.step_hook
        # per-layer clipping pairs norms with params positionally: remember the wrap-time order
        self._per_layer_ids = (
            [id(p) for p in dp_optimizer.params] if isinstance(dp_optimizer, DPPerLayerOptimizer) else None
        )
        dp_optimizer.step_hook = self._step_hook
        self._torch_handle = dp_optimizer.original_optimizer.register_step_pre_hook(self._pre_step)
        setattr(dp_optimizer.original_optimizer, HANDLE_ATTR, self)

    # -- public ---------------------------------------------------------------------------------------
    @property
    def diagnostics(self) -> PipelineDiagnostics:
        return self.pipeline.diagnostics

    @property
    def denoisers(self) -> list[Any]:
        return self.pipeline.denoisers

    def state_dict(self) -> dict[str, Any]:
        return self.pipeline.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(state)

    def remove(self) -> None:
        """Detach: the optimizer behaves exactly as before installation (the accountant hook stays)."""
        if self._removed:
            return
        self._removed = True
        self._torch_handle.remove()
        if self.optimizer.step_hook == self._step_hook:
            self.optimizer.step_hook = self._prev_step_hook
        inner = self.optimizer.original_optimizer
        if getattr(inner, HANDLE_ATTR, None) is self:
            delattr(inner, HANDLE_ATTR)

    def _describe(self) -> dict[int, ParamInfo]:
        every = [p for group in self.optimizer.original_optimizer.param_groups for p in group["params"]]
        return describe_parameters(every, self._module, self._registry)

    # -- hooks ----------------------------------------------------------------------------------------
    def _step_hook(self, opt: DPOptimizer) -> None:
        if self._per_layer_ids is not None and [id(p) for p in opt.params] != self._per_layer_ids:
            raise RuntimeError(
                "clipping='per_layer' pairs clipping norms with the trainable parameters by position; the set of "
                "trainable parameters changed since make_private (e.g. alternating LoRA factors), so norms would "
                "be applied to the wrong parameters. Use clipping='flat' with parameter toggling."
            )
        if self._prev_step_hook is not None:
            self._prev_step_hook(opt)
        if not self._removed:
            self._sigma = noise_std(opt)
            self._scale = clean_scale(opt) if self.pipeline.oracle else None

    def _pre_step(self, inner: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        opt = self.optimizer
        sigma, self._sigma = self._sigma, None
        if sigma is None:
            # Opacus' pre_step did not run (the inner optimizer was stepped directly): p.grad holds no DP noise,
            # so a denoiser must not see it (invariant 1). Skip, warn once, count.
            self.pipeline.diagnostics.skipped += 1
            if self.pipeline.diagnostics.skipped == 1:
                warnings.warn(
                    "the inner optimizer stepped without Opacus adding noise (DPOptimizer.step was bypassed); "
                    "post hooks were skipped for that step",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        params = [p for p in opt.params if p.grad is not None]
        if not params:
            return
        if any(id(p) not in self._infos for p in params):  # a param group added after installation
            self._infos = self._describe()
        infos = [self._infos[id(p)] for p in params]
        clean = None
        if self.pipeline.oracle:
            scale = self._scale if self._scale is not None else clean_scale(opt)
            clean = [
                (p.summed_grad.view_as(p.grad) * scale) if getattr(p, "summed_grad", None) is not None
                else torch.full_like(p.grad, float("nan"))
                for p in params
            ]
        try:
            out = self.pipeline.run([p.grad for p in params], infos, sigma, clean)
        except (DenoiserError, NonFiniteGradientError):
            for p in params:  # never let the caller step on a gradient a denoiser may have corrupted in place
                p.grad = None
            raise
        if out is None:  # non-finite noisy gradient, on_nonfinite_grad="skip_step": nothing moves this step
            for p in params:
                p.grad = None
            return
        if not self.pipeline.denoisers:
            return  # nobody saw the gradients: p.grad stays as Opacus made it (bit-identical, no copy)
        install_fresh_grads(params, out)


def install_fresh_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``p.grad = copy of g`` in fresh memory, in the parameter's memory layout.

    The tensors the denoisers saw (and may keep, or returned from their own state) are never written again:
    with ``zero_grad(set_to_none=False)`` the next backward accumulates the next batch's *clean* gradient into
    ``p.grad``'s memory, which no denoiser can then reach. (The layout matters: autograd accumulates into
    ``p.grad`` on the next backward.)
    """
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.empty_like(p, dtype=g.dtype).copy_(g)


def _check_supported(dp_optimizer: Any) -> None:
    if not isinstance(dp_optimizer, DPOptimizer):
        raise TypeError(
            f"install_post_hooks needs an Opacus DPOptimizer (from make_private), got {type(dp_optimizer).__name__}"
        )
    if isinstance(dp_optimizer, FSDPOptimizerFastGradientClipping):
        raise NotImplementedError(
            "FSDP (grad_sample_mode='ghost_fsdp') is not supported by opacus_spectral v1: its gradients are sharded "
            "DTensors and a spectral denoiser needs each full matrix. Use DDP, or train without post_hooks."
        )


def install_post_hooks(
    dp_optimizer: DPOptimizer,
    hooks: Sequence[HookSpec],
    *,
    module: nn.Module | None = None,
    on_error: OnError = "raise",
    oracle: bool = False,
    history: int = 1000,
    registry: Registry | None = None,
    max_output_ratio: float | None = DEFAULT_MAX_OUTPUT_RATIO,
    on_nonfinite_grad: OnNonFinite = "raise",
) -> PostHookHandle:
    """Run ``hooks`` (names, ``(name, kwargs)`` pairs or denoiser callables, in this order) on every noisy step.

    Args:
        dp_optimizer: an Opacus ``DPOptimizer`` (any subclass except FSDP).
        hooks: the denoisers; ``[]`` installs a pipeline that leaves gradients bit-identical.
        module: the model (wrapped or not) — used to name parameters and ask role plugins about them.
        on_error: ``"raise"`` (default) or ``"fallback"`` (keep the noisy gradient, warn once, count).
        max_output_ratio: a denoiser output whose norm exceeds this many times the step's noisy gradient norm
            is treated as invalid (default 1000; ``None``: no bound).
        on_nonfinite_grad: NaN/Inf in the noisy gradient: ``"raise"`` (default), ``"skip_step"`` or ``"ignore"``.
        oracle: record cos(noisy, clean) vs cos(denoised, clean) each step (benchmarks; costs syncs).
        history: how many steps of diagnostics to keep.
    """
    _check_supported(dp_optimizer)
    if oracle and world_size(dp_optimizer) > 1:
        raise ValueError("oracle diagnostics need the clean gradient, which DDP ranks never share; use oracle=False")
    reg = registry or get_registry()
    denoisers = create_denoisers(hooks, reg)
    old = getattr(dp_optimizer.original_optimizer, HANDLE_ATTR, None)
    if old is not None:
        warnings.warn("replacing post hooks previously installed on this optimizer", RuntimeWarning, stacklevel=2)
        old.remove()
    pipeline = PostNoisePipeline(
        denoisers,
        on_error=on_error,
        oracle=oracle,
        history=history,
        max_output_ratio=max_output_ratio,
        on_nonfinite_grad=on_nonfinite_grad,
    )
    return PostHookHandle(dp_optimizer, pipeline, module, reg)
