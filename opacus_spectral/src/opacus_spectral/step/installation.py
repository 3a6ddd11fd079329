"""Installing the denoiser pipeline on an Opacus optimizer.

Where it runs (``docs/upstream.md`` §1.3): on the optimizer's :mod:`~opacus_spectral.step.attachment`, at
``BEFORE_INNER_STEP`` — the step pre-hook of the inner optimizer (``dp_optimizer.original_optimizer``), after Opacus'
clipping, noise, scaling, accountant and — under DDP — the all-reduce, for every Opacus optimizer class, and once per
logical step (BatchMemoryManager's virtual steps never reach the inner optimizer). The per-entry noise std is read at
``AFTER_ACCOUNTANT``, which for AdaClip precedes the clipping bound's update (``docs/upstream.md`` §1.2).

An inner step to which Opacus added noise (the attachment's ``InnerStep.noised``) is a *logical step*;
:attr:`PostHookHandle.logical_steps` counts them, and callbacks added with :meth:`PostHookHandle.add_step_callback`
run after each one (at ``AFTER_STEP``). An inner step without noise is skipped and counted
(``diagnostics.skipped``); the doctor reports it (:mod:`~opacus_spectral.doctor.doctor`, check ``accounting``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..denoisers.advice import combination_advice, external_stacklevel
from ..errors import DenoiserAdviceWarning
from ..plugins.registry import DenoiserSpec, Registry, create_denoisers, get_registry
from .attachment import AFTER_ACCOUNTANT, AFTER_STEP, BEFORE_INNER_STEP, PIPELINE, InnerStep, attachment
from .noise_std import clean_scale, noise_std, world_size
from .oracle import clean_gradients
from .parameters import ParamInfo, describe_parameters
from .pipeline import (
    DEFAULT_MAX_OUTPUT_RATIO,
    OnError,
    OnNonFinite,
    PipelineDiagnostics,
    PostNoisePipeline,
    StepDiagnostics,
)

HANDLE_ATTR = "_opacus_spectral_handle"

#: ``fn(step_index, diagnostics)``: called once per completed logical step (:meth:`PostHookHandle.add_step_callback`)
StepCallback = Callable[[int, StepDiagnostics | None], None]


class PostHookHandle:
    """A live installation of the denoiser pipeline on one DPOptimizer. ``remove()`` detaches it.

    Returned by :func:`install_post_hooks` and held as ``engine.post_hooks``. Besides the pipeline's
    ``diagnostics`` and state, it tells a training loop when a logical DP step completed
    (:attr:`logical_steps`, :meth:`add_step_callback`), as opposed to a BatchMemoryManager virtual step.
    It subscribes to the optimizer's :mod:`~opacus_spectral.step.attachment` (order
    :data:`~opacus_spectral.step.attachment.PIPELINE`).
    """

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
        self._logical_steps = 0
        self._callbacks: OrderedDict[int, StepCallback] = OrderedDict()  # weak-referenceable, for RemovableHandle
        # (step index, diagnostics) of a logical step whose pipeline ran, until the inner step completes
        self._completed: tuple[int, StepDiagnostics | None] | None = None
        att = attachment(dp_optimizer)
        self._subscriptions = [
            att.require_fixed_trainable_set(),  # per-layer clipping names parameters by wrap-time position
            att.subscribe(AFTER_ACCOUNTANT, self._snapshot, order=PIPELINE),
            att.subscribe(BEFORE_INNER_STEP, self._pre_step, order=PIPELINE),
            att.subscribe(AFTER_STEP, self._post_step, order=PIPELINE),
        ]
        setattr(dp_optimizer.original_optimizer, HANDLE_ATTR, self)

    # -- public ---------------------------------------------------------------------------------------
    @property
    def diagnostics(self) -> PipelineDiagnostics:
        return self.pipeline.diagnostics

    @property
    def denoisers(self) -> list[Any]:
        return self.pipeline.denoisers

    @property
    def logical_steps(self) -> int:
        """Logical DP steps since installation: inner-optimizer steps to which Opacus added noise.

        Counts every such step — with or without denoisers, skipped ones (``on_nonfinite_grad="skip_step"``)
        and ones aborted by a denoiser or non-finite error included (their privacy is spent) — and never a
        BatchMemoryManager virtual step or an inner-optimizer step taken without Opacus' noise. Not part of
        :meth:`state_dict`.
        """
        return self._logical_steps

    def add_step_callback(self, fn: StepCallback) -> RemovableHandle:
        """Call ``fn(step_index, diagnostics)`` after every completed logical step; returns a handle whose
        ``remove()`` stops it.

        ``step_index`` is the 0-based index of the step among :attr:`logical_steps`; ``diagnostics`` is the
        pipeline's :class:`StepDiagnostics` for that step (``skipped=True`` for a skipped non-finite step), or
        ``None`` when no parameter had a gradient. ``fn`` runs after the inner optimizer's update of that step
        (so after the denoisers), in the order callbacks were added; it is not called for a step aborted by an
        error. An exception in ``fn`` propagates out of ``optimizer.step()`` (the weights have moved already).
        """
        if not callable(fn):
            raise TypeError(f"step callback must be callable, got {type(fn).__name__}")
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = fn
        return handle

    def state_dict(self) -> dict[str, Any]:
        return self.pipeline.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(state)

    def remove(self) -> None:
        """Detach: the optimizer behaves exactly as before installation (the accountant hook stays)."""
        if self._removed:
            return
        self._removed = True
        for subscription in self._subscriptions:
            subscription.remove()
        self._completed = None
        inner = self.optimizer.original_optimizer
        if getattr(inner, HANDLE_ATTR, None) is self:
            delattr(inner, HANDLE_ATTR)

    def _describe(self) -> dict[int, ParamInfo]:
        every = [p for group in self.optimizer.original_optimizer.param_groups for p in group["params"]]
        return describe_parameters(every, self._module, self._registry)

    # -- the attachment's events ----------------------------------------------------------------------
    def _snapshot(self, opt: DPOptimizer) -> None:
        """After the accountant and before AdaClip's bound update (``docs/upstream.md`` §1.2): this step's std."""
        self._sigma = noise_std(opt)
        self._scale = clean_scale(opt) if self.pipeline.oracle else None

    def _pre_step(self, step: InnerStep) -> None:
        sigma, self._sigma = self._sigma, None
        self._completed = None
        if not step.noised or sigma is None:
            # Opacus' pre_step did not run (the inner optimizer was stepped directly): p.grad holds no DP noise,
            # so a denoiser must not see it. Skip and count; the doctor reports it (its "accounting" check).
            self.pipeline.diagnostics.skipped += 1
            return
        index = self._logical_steps
        self._logical_steps += 1
        diag = self._run_pipeline(sigma)
        self._completed = (index, diag)

    def _run_pipeline(self, sigma: float) -> StepDiagnostics | None:
        """Denoise this step's noisy gradients and install the result; the step's diagnostics (None: no grads)."""
        opt = self.optimizer
        params = [p for p in opt.params if p.grad is not None]
        if not params:
            return None
        if any(id(p) not in self._infos for p in params):  # a param group added after installation
            self._infos = self._describe()
        infos = [self._infos[id(p)] for p in params]
        clean = None
        if self.pipeline.oracle:
            clean = clean_gradients(opt, params, scale=self._scale)
        try:
            out = self.pipeline.run([p.grad for p in params], infos, sigma, clean)
        except BaseException:  # DenoiserError, NonFiniteGradientError, or anything else (even an interrupt):
            for p in params:  # never let the caller step on a gradient a denoiser may have corrupted in place
                p.grad = None
            raise
        diag = self.pipeline.last_step
        if out is None:  # non-finite noisy gradient, on_nonfinite_grad="skip_step": nothing moves this step
            for p in params:
                p.grad = None
            return diag
        if self.pipeline.denoisers:  # else nobody saw the gradients: p.grad stays as Opacus made it (no copy)
            install_fresh_grads(params, out)
        return diag

    def _post_step(self, step: InnerStep) -> None:
        completed, self._completed = self._completed, None
        if completed is None:
            return
        for fn in list(self._callbacks.values()):
            fn(*completed)


def install_fresh_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``p.grad = copy of g`` in fresh memory, in the parameter's memory layout.

    The tensors the denoisers saw (and may keep, or returned from their own state) are never written again:
    with ``zero_grad(set_to_none=False)`` the next backward accumulates the next batch's *clean* gradient into
    ``p.grad``'s memory (``docs/upstream.md`` §1.5), which no denoiser can then reach. (The layout matters:
    autograd accumulates into ``p.grad`` on the next backward.)
    """
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.empty_like(p, dtype=g.dtype).copy_(g)


def remove_pipeline(optimizer: Any) -> bool:
    """Remove the pipeline installed on ``optimizer`` (a DPOptimizer or its inner optimizer), if any; whether there
    was one. What a new ``make_private`` and :func:`install_post_hooks` do with the previous pipeline."""
    inner = getattr(optimizer, "original_optimizer", optimizer)
    old = getattr(inner, HANDLE_ATTR, None)
    if old is not None:
        old.remove()
    return old is not None


def install_post_hooks(
    dp_optimizer: DPOptimizer,
    hooks: Sequence[DenoiserSpec],
    *,
    module: nn.Module | None = None,
    on_error: OnError = "raise",
    oracle: bool = False,
    history: int = 1000,
    registry: Registry | None = None,
    max_output_ratio: float | None = DEFAULT_MAX_OUTPUT_RATIO,
    on_nonfinite_grad: OnNonFinite = "raise",
) -> PostHookHandle:
    """Install a pipeline that runs the denoisers ``hooks`` (the ``post_hooks`` list), in order, every logical step.

    Args:
        dp_optimizer: an Opacus ``DPOptimizer`` (any subclass but FSDP's, which the engine refuses:
            :func:`~opacus_spectral.engine.refuse_fsdp`).
        hooks: the denoisers, as registered names, ``(name, kwargs)`` pairs or denoiser callables
            (:data:`~opacus_spectral.plugins.registry.DenoiserSpec`); ``[]`` installs a pipeline that leaves gradients
            bit-identical.
        module: the model (wrapped or not) — used to name parameters and ask role plugins about them.
        on_error: ``"raise"`` (default) or ``"fallback"`` (keep the noisy gradient, warn once, count).
        max_output_ratio: a denoiser output whose norm exceeds this many times its own tensor's reference
            ``max(‖noisy gradient‖, sigma·sqrt(numel))`` is treated as invalid (default 1000; ``None``: no bound;
            :mod:`~opacus_spectral.step.validation`).
        on_nonfinite_grad: NaN/Inf in the noisy gradient: ``"raise"`` (default), ``"skip_step"`` or ``"ignore"``.
        oracle: record cos(noisy, clean) vs cos(denoised, clean) each step (benchmarks; costs syncs).
        history: how many steps of diagnostics to keep.
    """
    from ..engine import refuse_fsdp  # noqa: PLC0415 - the engine owns its refusals (and imports this module)

    if not isinstance(dp_optimizer, DPOptimizer):
        raise TypeError(
            f"install_post_hooks needs an Opacus DPOptimizer (from make_private), got {type(dp_optimizer).__name__}"
        )
    refuse_fsdp(optimizer=dp_optimizer)
    if oracle and world_size(dp_optimizer) > 1:
        raise ValueError("oracle diagnostics need the clean gradient, which DDP ranks never share; use oracle=False")
    reg = registry or get_registry()
    denoisers = create_denoisers(hooks, reg)
    for message in combination_advice(dp_optimizer.original_optimizer, denoisers):
        warnings.warn(message, DenoiserAdviceWarning, stacklevel=external_stacklevel())
    if remove_pipeline(dp_optimizer):
        warnings.warn(
            "replacing the denoiser pipeline previously installed on this optimizer", RuntimeWarning, stacklevel=2
        )
    pipeline = PostNoisePipeline(
        denoisers,
        on_error=on_error,
        oracle=oracle,
        history=history,
        max_output_ratio=max_output_ratio,
        on_nonfinite_grad=on_nonfinite_grad,
    )
    return PostHookHandle(dp_optimizer, pipeline, module, reg)
