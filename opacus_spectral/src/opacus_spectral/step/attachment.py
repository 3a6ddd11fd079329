"""One attachment per Opacus ``DPOptimizer``: the events of a DP step, with ordered subscribers.

Everything that rides on a ``DPOptimizer`` — the denoiser pipeline (:mod:`~opacus_spectral.step.installation`), the
doctor (:mod:`~opacus_spectral.doctor.doctor`), the audit's gradient canaries and peft_lalora's alternation controller —
subscribes here instead of patching the optimizer itself. The first subscription creates the optimizer's attachment
(:func:`attachment`); the ``remove()`` of the last one leaves the optimizer exactly as it was: ``step_hook``,
``pre_step`` and ``add_noise`` as before, no hook left on the inner optimizer (``docs/architecture.md``).

The events of one ``DPOptimizer.step()`` (``docs/upstream.md`` §1.1, §1.3), in the order they fire:

=======================  ======================================================================  ==============
event                    where                                                                   argument
=======================  ======================================================================  ==============
``PHYSICAL_BATCH``       start of ``pre_step``: every physical batch, BatchMemoryManager's       the optimizer
                         virtual steps included
``BEFORE_NOISE``         inside ``add_noise``, before Opacus draws the noise                      the optimizer
``BEFORE_ACCOUNTANT``    in ``step_hook``, before the previous hook (the accountant)              the optimizer
``AFTER_ACCOUNTANT``     in ``step_hook``, after it: AdaClip's bound is still this step's (§1.2)  the optimizer
``BEFORE_INNER_STEP``    step pre-hook of the inner optimizer: after noise, scaling, accountant   :class:`InnerStep`
                         and the DDP all-reduce, once per logical step
``AFTER_STEP``           step post-hook of the inner optimizer: the weights have moved            :class:`InnerStep`
=======================  ======================================================================  ==============

Within an event, subscribers run by ascending ``order`` (ties: in subscription order); the library's own are
:data:`DOCTOR` < :data:`PIPELINE` < :data:`CANARIES` < :data:`CONTROLLER`. ``pre_step`` and ``add_noise`` are
patched only while their event has a subscriber.

Checked here once, for every subscriber: whether an inner step follows Opacus' noisy step (its ``step_hook`` ran
since the previous inner step; :attr:`InnerStep.noised`, §1.3), and — while a subscriber holds
:meth:`Attachment.require_fixed_trainable_set` — that a per-layer clipping optimizer still clips the parameters it
was set up with (§1.4); :func:`refuse_toggling` is the same rule, asked up front by whoever would toggle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

__all__ = [
    "AFTER_ACCOUNTANT",
    "AFTER_STEP",
    "BEFORE_ACCOUNTANT",
    "BEFORE_INNER_STEP",
    "BEFORE_NOISE",
    "CANARIES",
    "CONTROLLER",
    "DOCTOR",
    "EVENTS",
    "PHYSICAL_BATCH",
    "PIPELINE",
    "PRECISION",
    "Attachment",
    "InnerStep",
    "Subscription",
    "attachment",
    "clips_per_layer",
    "find_attachment",
    "refuse_toggling",
]

PHYSICAL_BATCH = "physical_batch"
BEFORE_NOISE = "before_noise"
BEFORE_ACCOUNTANT = "before_accountant"
AFTER_ACCOUNTANT = "after_accountant"
BEFORE_INNER_STEP = "before_inner_step"
AFTER_STEP = "after_step"
#: every event, in firing order
EVENTS = (PHYSICAL_BATCH, BEFORE_NOISE, BEFORE_ACCOUNTANT, AFTER_ACCOUNTANT, BEFORE_INNER_STEP, AFTER_STEP)

#: the ``order`` keys of the library's subscribers (lower runs first in every event); PRECISION, the engine's float32
#: clipping (:mod:`~opacus_spectral.step.precision`), casts the per-sample gradients before anyone reads them
PRECISION, DOCTOR, PIPELINE, CANARIES, CONTROLLER = 50, 100, 200, 300, 400

ATTR = "_opacus_spectral_attachment"
#: the optimizer method each lazily patched event wraps
_PATCHED = {PHYSICAL_BATCH: "pre_step", BEFORE_NOISE: "add_noise"}
_ABSENT = object()

PER_LAYER_CHANGED = (
    "clipping='per_layer' pairs clipping norms with the trainable parameters by position; the set of trainable "
    "parameters changed since make_private (e.g. alternating LoRA factors), so norms would be applied to the wrong "
    "parameters. Use clipping='flat' with parameter toggling."
)


def clips_per_layer(dp_optimizer: Any) -> bool:
    """Whether Opacus pairs one clipping norm per parameter with ``params`` by position (``clipping='per_layer'``)."""
    return isinstance(dp_optimizer, DPPerLayerOptimizer) or hasattr(dp_optimizer, "max_grad_norms")


def refuse_toggling(dp_optimizer: Any, what: str, alternative: str) -> None:
    """``ValueError`` if ``dp_optimizer`` clips per layer: ``what`` would change the trainable set between steps,
    and Opacus pairs the per-layer norms with the trainable parameters by position (§1.4)."""
    if clips_per_layer(dp_optimizer):
        raise ValueError(
            f"{what} cannot be used with Opacus per-layer clipping (clipping='per_layer'): Opacus pairs the "
            "per-layer norms with the currently trainable params by position, which is wrong once a factor is "
            f"frozen. Use clipping='flat' (or {alternative})."
        )


@dataclass(frozen=True)
class InnerStep:
    """What ``BEFORE_INNER_STEP`` and ``AFTER_STEP`` subscribers get: the optimizer, and whether Opacus added noise
    to this step (``False``: the inner optimizer was stepped directly, or ``step_hook`` was replaced, and ``p.grad``
    holds no DP noise)."""

    optimizer: DPOptimizer
    noised: bool


class Subscription:
    """A subscription's handle (the shape of torch's ``RemovableHandle``): ``remove()`` ends it (idempotent); a
    ``with`` block removes it on exit."""

    def __init__(self, unsubscribe: Callable[[], None]) -> None:
        self._unsubscribe: Callable[[], None] | None = unsubscribe

    def remove(self) -> None:
        fn, self._unsubscribe = self._unsubscribe, None
        if fn is not None:
            fn()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Attachment:
    """The events of one ``DPOptimizer``'s steps (module docstring). Get it with :func:`attachment`."""

    def __init__(self, dp_optimizer: DPOptimizer) -> None:
        self.optimizer = dp_optimizer
        self._subscribers: dict[str, list[tuple[int, int, Callable[[Any], None]]]] = {e: [] for e in EVENTS}
        self._keys = 0
        self._guards: set[int] = set()
        self._per_layer_ids: list[int] | None = None
        self._noised = False  # the step hook ran since the previous inner step
        self._step: InnerStep | None = None  # the inner step between its pre- and post-hook
        self._depth = 0  # events being dispatched (a removal inside one defers the detach)
        self._detach_pending = False
        self.detached = False
        self._wrappers = {PHYSICAL_BATCH: self._on_pre_step, BEFORE_NOISE: self._on_add_noise}
        self._saved: dict[str, Any] = {}  # event -> the optimizer's own instance attribute it replaced (or _ABSENT)
        self._previous: dict[str, Callable[..., Any]] = {}  # event -> what its wrapper calls
        self._prev_step_hook = dp_optimizer.step_hook  # the accountant; chained, never replaced (§1.1)
        dp_optimizer.step_hook = self._on_step_hook
        inner = dp_optimizer.original_optimizer
        self._torch = [inner.register_step_pre_hook(self._on_inner_pre), inner.register_step_post_hook(self._on_post)]
        setattr(dp_optimizer, ATTR, self)

    # -- subscribing ----------------------------------------------------------------------------------------
    def subscribe(self, event: str, fn: Callable[[Any], None], *, order: int) -> Subscription:
        """Call ``fn`` at every ``event`` (module docstring), after the subscribers of lower ``order``."""
        if event not in self._subscribers:
            raise ValueError(f"unknown event {event!r}; expected one of {', '.join(EVENTS)}")
        if not callable(fn):
            raise TypeError(f"subscriber must be callable, got {type(fn).__name__}")
        self._check_live()
        key = self._next_key()
        entries = self._subscribers[event]
        entries.append((int(order), key, fn))
        entries.sort(key=lambda e: (e[0], e[1]))
        if event in _PATCHED and len(entries) == 1 and event not in self._previous:
            self._patch(event)
        return Subscription(lambda: self._unsubscribe(event, key))

    def require_fixed_trainable_set(self) -> Subscription:
        """Until ``remove()``: with per-layer clipping, a step whose trainable parameters differ from those at the
        first such request raises ``RuntimeError`` before the accountant counts it (§1.4). No-op for flat clipping."""
        self._check_live()
        key = self._next_key()
        if not self._guards and clips_per_layer(self.optimizer):
            self._per_layer_ids = [id(p) for p in self.optimizer.params]
        self._guards.add(key)
        return Subscription(lambda: self._unguard(key))

    def subscribers(self, event: str) -> list[Callable[[Any], None]]:
        """The subscribers of ``event``, in calling order."""
        return [fn for _, _, fn in self._subscribers[event]]

    @property
    def empty(self) -> bool:
        return not self._guards and not any(self._subscribers.values())

    def _next_key(self) -> int:
        self._keys += 1
        return self._keys

    def _check_live(self) -> None:
        if self.detached:
            raise RuntimeError("this attachment was detached; call opacus_spectral.step.attachment.attachment() again")

    def _unsubscribe(self, event: str, key: int) -> None:
        entries = self._subscribers[event]
        entries[:] = [e for e in entries if e[1] != key]
        if event in _PATCHED and not entries:
            self._unpatch(event)
        self._maybe_detach()

    def _unguard(self, key: int) -> None:
        self._guards.discard(key)
        if not self._guards:
            self._per_layer_ids = None
        self._maybe_detach()

    # -- patching and restoring -----------------------------------------------------------------------------
    def _patch(self, event: str) -> None:
        name, opt = _PATCHED[event], self.optimizer
        self._saved[event] = opt.__dict__.get(name, _ABSENT)
        self._previous[event] = getattr(opt, name)
        setattr(opt, name, self._wrappers[event])  # an instance attribute: Opacus calls self.pre_step() etc.

    def _unpatch(self, event: str) -> None:
        """Restore the method if ours is on top; else something wrapped it since, and ours stays a pass-through."""
        name, opt = _PATCHED[event], self.optimizer
        if opt.__dict__.get(name) is not self._wrappers[event]:
            return
        saved = self._saved.pop(event)
        if saved is _ABSENT:
            del opt.__dict__[name]
        else:
            opt.__dict__[name] = saved
        del self._previous[event]

    def _maybe_detach(self) -> None:
        if not self.empty or self.detached:
            return
        if self._depth > 0:  # inside an event: torch is iterating the inner optimizer's hooks
            self._detach_pending = True
            return
        self.detached = True
        self._detach_pending = False
        for handle in self._torch:
            handle.remove()
        opt = self.optimizer
        if opt.step_hook == self._on_step_hook:  # else a later hook chains onto ours: it passes through
            opt.step_hook = self._prev_step_hook
        if opt.__dict__.get(ATTR) is self:
            delattr(opt, ATTR)

    # -- the events -----------------------------------------------------------------------------------------
    def _emit(self, event: str, arg: Any) -> None:
        entries = self._subscribers[event]
        if not entries:
            return
        self._depth += 1
        try:
            for entry in list(entries):
                if entry in entries:  # not removed by an earlier subscriber of this event
                    entry[2](arg)
        finally:
            self._depth -= 1

    def _finish_pending(self) -> None:
        """A detach deferred from inside an inner-optimizer hook, done at the next optimizer call outside one."""
        if self._detach_pending and self._depth == 0:
            self._maybe_detach()

    def _on_pre_step(self, *args: Any, **kwargs: Any) -> Any:
        previous = self._previous.get(PHYSICAL_BATCH) or type(self.optimizer).pre_step.__get__(self.optimizer)
        self._finish_pending()
        self._emit(PHYSICAL_BATCH, self.optimizer)
        return previous(*args, **kwargs)

    def _on_add_noise(self, *args: Any, **kwargs: Any) -> Any:
        previous = self._previous.get(BEFORE_NOISE) or type(self.optimizer).add_noise.__get__(self.optimizer)
        self._emit(BEFORE_NOISE, self.optimizer)
        return previous(*args, **kwargs)

    def _on_step_hook(self, opt: DPOptimizer) -> None:
        self._finish_pending()
        if self._per_layer_ids is not None and [id(p) for p in opt.params] != self._per_layer_ids:
            raise RuntimeError(PER_LAYER_CHANGED)
        self._emit(BEFORE_ACCOUNTANT, opt)
        if self._prev_step_hook is not None:
            self._prev_step_hook(opt)
        if self.detached:
            return
        self._noised = True
        self._emit(AFTER_ACCOUNTANT, opt)

    def _on_inner_pre(self, inner: Any, args: Any, kwargs: Any) -> None:
        noised, self._noised = self._noised, False
        self._step = InnerStep(self.optimizer, noised)
        if not self.detached:
            self._emit(BEFORE_INNER_STEP, self._step)

    def _on_post(self, inner: Any, args: Any, kwargs: Any) -> None:
        step, self._step = self._step, None
        if not self.detached:
            self._emit(AFTER_STEP, step if step is not None else InnerStep(self.optimizer, False))


def find_attachment(dp_optimizer: Any) -> Attachment | None:
    """The live attachment of ``dp_optimizer``, or ``None``."""
    found = getattr(dp_optimizer, "__dict__", {}).get(ATTR)
    return found if isinstance(found, Attachment) and not found.detached else None


def attachment(dp_optimizer: DPOptimizer) -> Attachment:
    """``dp_optimizer``'s attachment, created on first use (install after ``make_private``: it chains onto the
    accountant's ``step_hook``, which ``make_private`` sets last; §1.3)."""
    if not isinstance(dp_optimizer, DPOptimizer):
        raise TypeError(f"needs an Opacus DPOptimizer (from make_private), got {type(dp_optimizer).__name__}")
    return find_attachment(dp_optimizer) or Attachment(dp_optimizer)
