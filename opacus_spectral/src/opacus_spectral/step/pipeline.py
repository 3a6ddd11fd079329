"""The post-noise pipeline: runs the user's denoisers (the ``post_hooks`` list), in order, on the step's
noisy gradients.

It builds one :class:`NoisyGradient` per parameter that has a gradient, calls each denoiser and validates
what comes back (:mod:`~opacus_spectral.step.validation`), metadata first, before reading any value: ``None``
(edited in place) or one tensor (or ``None``) per record, each a plain dense (``torch.strided``) tensor with the
step's shape, dtype and device and storage that holds it, finite where the input was finite, and with a norm of
at most ``max_output_ratio`` (default 1000; ``None`` disables the bound) times that tensor's own reference
``max(‖g̃_i‖, s·√numel_i)`` — its noisy gradient norm before any denoiser, or the expected norm of its noise if
that is larger (also for tensors whose noisy gradient is non-finite, under ``on_nonfinite_grad="ignore"``).
Anything else — a sparse or nested tensor, a tensor subclass, freed storage, an exception (any ``BaseException``
but ``KeyboardInterrupt``), a non-sequence such as ``True``, a generator that raises, a wrong length — goes
through the same error policy:

* ``on_error="raise"`` (default): :class:`DenoiserError` naming the denoiser and the parameter; the step is
  aborted and the caller clears the affected ``p.grad``, so no weight moves and no partial in-place edit
  survives;
* ``on_error="fallback"``: that denoiser's input is kept for the bad tensors, one warning per kind of problem,
  counted in :class:`PipelineDiagnostics` (inputs are copied before each denoiser in this mode).

Before any denoiser runs, non-finite noisy gradients (NaN/Inf, e.g. from a poisoned example) follow
``on_nonfinite_grad``: ``"raise"`` (default, :class:`NonFiniteGradientError`), ``"skip_step"`` (no parameter
moves this step; warned once, counted in ``diagnostics.nonfinite_steps``) or ``"ignore"`` (Opacus' own
behaviour: they reach the optimizer). Privacy is spent either way — the accountant already counted the step.
The same fused per-tensor norms serve the finiteness check and the norm bound: one host sync per denoiser.

A denoiser that needs isotropic noise (``needs_isotropic_noise``, e.g. ``rmt``) placed after a callable that
declares no output noise would skip those records every step; the pipeline warns once about it, naming both.

Record selection is the pipeline's (:mod:`~opacus_spectral.step.selection`): a denoiser that declares a ``selector``
is handed only the records it selects, in step order; the other records keep their tensor and their noise (a
callable that declares no output noise still makes their noise unknown, as it does for the records it was
handed). A callable without a selector is handed every record.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..denoisers.base import DenoiserProtocol, GradientEstimator, denoiser_name
from ..errors import DenoiserError, NonFiniteGradientError
from .noise_model import NoiseState
from .oracle import cosine
from .parameters import ParamInfo
from .records import NoisyGradient
from .selection import declared_selector
from .validation import TensorSpec, noise_norms, output_bounds, output_problem, stacked_norms

OnError = Literal["raise", "fallback"]
OnNonFinite = Literal["raise", "skip_step", "ignore"]

#: default bound on a denoiser's output norm, per tensor, in units of max(its noisy gradient norm, its noise norm)
DEFAULT_MAX_OUTPUT_RATIO = 1e3
_FAILED = object()  #: a denoiser whose selection raised (it falls back as a whole)


@dataclass
class StepDiagnostics:
    """What happened in one logical step."""

    step: int
    sigma: float
    n_tensors: int
    seconds: float = 0.0
    denoisers: dict[str, dict[str, Any]] = field(default_factory=dict)
    oracle: dict[str, Any] | None = None
    skipped: bool = False  #: non-finite noisy gradient, step skipped (``on_nonfinite_grad="skip_step"``)


@dataclass
class PipelineDiagnostics:
    """Counters over the run plus the last ``maxlen`` steps."""

    steps: int = 0
    seconds: float = 0.0
    calls: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    skipped: int = 0  #: inner-optimizer steps without Opacus noise (pipeline not run)
    nonfinite_steps: int = 0  #: steps whose noisy gradient held NaN/Inf
    history: deque = field(default_factory=lambda: deque(maxlen=1000))

    @property
    def last(self) -> StepDiagnostics | None:
        return self.history[-1] if self.history else None


def _splice(current: Sequence[torch.Tensor], index: Sequence[int], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``current`` with ``outs[j]`` at ``index[j]``."""
    new = list(current)
    for k, o in zip(index, outs, strict=True):
        new[k] = o
    return new


class PostNoisePipeline:
    """Applies ``denoisers`` in order to noisy gradients; see the module docstring for the policies."""

    def __init__(
        self,
        denoisers: Sequence[DenoiserProtocol],
        *,
        on_error: OnError = "raise",
        oracle: bool = False,
        history: int = 1000,
        max_output_ratio: float | None = DEFAULT_MAX_OUTPUT_RATIO,
        on_nonfinite_grad: OnNonFinite = "raise",
    ) -> None:
        if on_error not in ("raise", "fallback"):
            raise ValueError(f"on_error must be 'raise' or 'fallback', got {on_error!r}")
        if on_nonfinite_grad not in ("raise", "skip_step", "ignore"):
            raise ValueError(f"on_nonfinite_grad must be 'raise', 'skip_step' or 'ignore', got {on_nonfinite_grad!r}")
        if max_output_ratio is not None and not (
            isinstance(max_output_ratio, (int, float))
            and max_output_ratio >= 1
            and max_output_ratio == max_output_ratio
        ):
            raise ValueError(f"max_output_ratio must be a number >= 1 or None, got {max_output_ratio!r}")
        self.denoisers = list(denoisers)
        self.names = self._unique_names(self.denoisers)
        self.on_error: OnError = on_error
        self.on_nonfinite_grad: OnNonFinite = on_nonfinite_grad
        self.max_output_ratio = None if max_output_ratio is None else float(max_output_ratio)
        self.oracle = oracle
        self.diagnostics = PipelineDiagnostics(history=deque(maxlen=history))
        self._warned: set[tuple[str, str]] = set()
        self.step = 0
        #: diagnostics of the most recent :meth:`run` that completed (kept even when ``history=0``)
        self.last_step: StepDiagnostics | None = None
        #: (record set and noise std, their expected noise norms on the device): reused while they stay the same
        self._noise_norms: tuple[tuple[Any, ...], torch.Tensor] | None = None

    @staticmethod
    def _unique_names(denoisers: Sequence[DenoiserProtocol]) -> list[str]:
        names, seen = [], Counter()
        for d in denoisers:
            n = denoiser_name(d)
            seen[n] += 1
            names.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
        return names

    def check_selection(self, infos: Sequence[ParamInfo]) -> None:
        """Warn once per denoiser whose declared selector (:func:`~opacus_spectral.step.selection.declared_selector`)
        matches none of ``infos``."""
        for d, dname in zip(self.denoisers, self.names, strict=True):
            selector = declared_selector(d)
            if not infos or selector is None or any(selector.matches(i.name, i.role) for i in infos):
                continue
            roles = sorted({i.role for i in infos})
            warnings.warn(
                f"denoiser {dname!r} selects none of the {len(infos)} parameters of this optimizer (their roles: "
                f"{roles}); its selector is {selector}. It will do nothing.",
                RuntimeWarning,
                stacklevel=4,
            )

    def selection(self, d: DenoiserProtocol, infos: Sequence[ParamInfo]) -> list[int] | None:
        """Indices of the records ``d`` is handed (its declared selector); ``None``: every record."""
        selector = declared_selector(d)
        if selector is None or selector.everything:
            return None
        index = [k for k, i in enumerate(infos) if selector.matches(i.name, i.role)]
        return None if len(index) == len(infos) else index

    def gradient_estimator(self, module: torch.nn.Module) -> GradientEstimator | None:
        """The pre-clip gradient estimator one of the denoisers offers for ``module`` (``gradient_estimator``,
        ``docs/plugins.md``), or ``None``; two denoisers offering one is a ``ValueError``."""
        found: list[tuple[str, GradientEstimator]] = []
        for d, dname in zip(self.denoisers, self.names, strict=True):
            offer = getattr(d, "gradient_estimator", None)
            estimator = offer(module) if callable(offer) else None
            if estimator is not None:
                if not callable(getattr(estimator, "backward", None)):
                    raise TypeError(
                        f"denoiser {dname!r}: gradient_estimator returned {type(estimator).__name__}, which has no "
                        "backward(loss_fn) method (opacus_spectral.denoisers.GradientEstimator)"
                    )
                found.append((dname, estimator))
        if len(found) > 1:
            names = ", ".join(repr(n) for n, _ in found)
            raise ValueError(
                f"denoisers {names} each replace the training loop's backward with a gradient estimator; a step has "
                "one backward: keep one of them in post_hooks"
            )
        return found[0][1] if found else None

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "denoisers": [d.state_dict() if hasattr(d, "state_dict") else {} for d in self.denoisers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state["denoisers"]
        if len(states) != len(self.denoisers):
            raise ValueError(f"state has {len(states)} denoisers, pipeline has {len(self.denoisers)}")
        for d, s in zip(self.denoisers, states, strict=True):
            if hasattr(d, "load_state_dict"):
                d.load_state_dict(s)
            elif s:
                raise ValueError(f"denoiser {denoiser_name(d)} has no load_state_dict but state was saved")
        self.step = int(state["step"])

    def reset(self) -> None:
        for d in self.denoisers:
            if hasattr(d, "reset"):
                d.reset()

    # -- one step -----------------------------------------------------------------------------------
    def run(
        self,
        grads: Sequence[torch.Tensor],
        infos: Sequence[ParamInfo],
        sigma: float,
        clean: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor] | None:
        """Denoise ``grads`` (noisy gradient tensors, not Parameters).

        Returns the tensors to use as gradients, or ``None`` when the step is skipped (non-finite noisy
        gradient under ``on_nonfinite_grad="skip_step"``). The returned tensors may be tensors a denoiser
        saw or keeps: the caller copies them into fresh memory before a backward can write into them.
        """
        t_start = time.perf_counter()
        self.last_step = None
        diag = StepDiagnostics(step=self.step, sigma=sigma, n_tensors=len(grads))
        current = [g.detach() for g in grads]
        specs = [TensorSpec.of(t) for t in current]  # what every denoiser's outputs must match
        checked = bool(current) and (bool(self.denoisers) or self.on_nonfinite_grad != "ignore")
        in_finite = torch.isfinite(stacked_norms(current, float("inf"))) if checked else None
        if in_finite is not None and self.on_nonfinite_grad != "ignore" and not bool(in_finite.all()):  # one sync
            return self._nonfinite(diag, infos, in_finite, t_start)
        checks = None
        if self.denoisers and in_finite is not None:
            checks = (in_finite, self._bound(current, specs, in_finite, sigma))
        noisy_ref = [g.clone() for g in current] if self.oracle else None
        noise = NoiseState(len(current), sigma)  # the noise each record carries, as the denoisers declare it
        for d, dname in zip(self.denoisers, self.names, strict=True):
            current = self._run_one(d, dname, noise, current, specs, checks, infos, diag)
        if self.oracle and clean is not None and noisy_ref is not None:
            diag.oracle = self._oracle(infos, noisy_ref, current, clean)
        self._finish(diag, t_start)
        return current

    def _run_one(
        self,
        d: DenoiserProtocol,
        dname: str,
        noise: NoiseState,
        current: list[torch.Tensor],
        specs: Sequence[TensorSpec],
        checks: tuple[torch.Tensor, torch.Tensor] | None,
        infos: Sequence[ParamInfo],
        diag: StepDiagnostics,
    ) -> list[torch.Tensor]:
        """One denoiser on the step's tensors — its selection (made here, once), its call, the noise it declares —
        and the tensors after it (``current`` when it falls back as a whole)."""
        t0 = time.perf_counter()
        self.diagnostics.calls[dname] += 1
        entry: dict[str, Any] = {"fallbacks": len(current)}  # a whole-denoiser fallback unless it completes
        diag.denoisers[dname] = entry
        index = self._selected(d, dname, infos, entry)
        if index is _FAILED:
            return current
        if getattr(d, "needs_isotropic_noise", False) and ("", "switch-off") not in self._warned:
            self._warn_once("", "switch-off", noise.switch_off(dname, infos, index))
        inputs = [t.clone() for t in current] if self.on_error == "fallback" else current
        records = noise.records(infos, inputs, self.step)
        new = self._apply(d, dname, records, index, current, specs, checks, infos, entry)
        if new is None:
            return current
        handed = range(len(current)) if index is None else index
        kept = [new[k] is current[k] for k in handed]  # fallback: the input was kept
        entry["fallbacks"] = sum(kept) if self.on_error == "fallback" else 0
        self._warn_once(dname, "declare", noise.apply(d, dname, [records[k] for k in handed], kept, index))
        entry["seconds"] = time.perf_counter() - t0
        stats = getattr(d, "stats", None)  # the per-step numbers it published
        entry.update(stats if isinstance(stats, dict) else {})
        return new

    def _selected(self, d: DenoiserProtocol, dname: str, infos: Sequence[ParamInfo], entry: dict[str, Any]) -> Any:
        """:meth:`selection`, the step's one selection for ``d``; a selector that raises goes through the error
        policy (``_FAILED``: the whole denoiser falls back)."""
        try:
            return self.selection(d, infos)
        except (DenoiserError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken selector is a denoiser failure
            self._failed(dname, exc, entry)
            return _FAILED

    def _failed(self, dname: str, exc: BaseException, entry: dict[str, Any]) -> None:
        self.diagnostics.errors[dname] += 1
        self._bad(dname, None, f"raised {type(exc).__name__}: {exc}", exc)
        entry["error"] = f"{type(exc).__name__}: {exc}"

    def _apply(
        self,
        d: DenoiserProtocol,
        dname: str,
        records: Sequence[NoisyGradient],
        index: list[int] | None,
        current: list[torch.Tensor],
        specs: Sequence[TensorSpec],
        checks: tuple[torch.Tensor, torch.Tensor] | None,
        infos: Sequence[ParamInfo],
        entry: dict[str, Any],
    ) -> list[torch.Tensor] | None:
        """Hand ``d`` the records at ``index`` (its selection; ``None``: all) and validate what it returns: the step's
        tensors after it; ``None`` when the whole denoiser falls back."""
        try:
            if index is None:
                handed, refs, spec = records, current, specs
            else:
                handed = [records[k] for k in index]
                refs, spec = [current[k] for k in index], [specs[k] for k in index]
            outs = self._outputs(dname, handed, d(handed))
            if outs is None:
                return None
            new = self._validate(dname, handed, outs, refs, spec)
            if index is not None:  # the records it was not handed keep their tensor
                new = _splice(current, index, new)
            if checks is not None:
                self._check_values(dname, new, current, *checks, infos)
            return new
        except (DenoiserError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - every denoiser failure goes through the policy
            self._failed(dname, exc, entry)
            return None

    def _warn_once(self, dname: str, key: str, msg: str) -> None:
        if msg and (dname, key) not in self._warned:
            self._warned.add((dname, key))
            warnings.warn(msg, RuntimeWarning, stacklevel=6)

    def _finish(self, diag: StepDiagnostics, t_start: float) -> None:
        diag.seconds = time.perf_counter() - t_start
        self.diagnostics.seconds += diag.seconds
        self.diagnostics.steps += 1
        self.diagnostics.history.append(diag)
        self.last_step = diag
        self.step += 1

    def _nonfinite(
        self, diag: StepDiagnostics, infos: Sequence[ParamInfo], in_finite: torch.Tensor, t_start: float
    ) -> None:
        names = [infos[i].name for i in (~in_finite).nonzero().flatten().tolist()]
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        msg = f"the noisy gradient of step {self.step} is non-finite (NaN/Inf) for {len(names)} parameter(s): {shown}"
        self.diagnostics.nonfinite_steps += 1
        if self.on_nonfinite_grad == "raise":
            raise NonFiniteGradientError(
                msg + "; the step was aborted (on_nonfinite_grad='raise'; use 'skip_step' to skip such steps)"
            )
        if ("", "nonfinite") not in self._warned:
            self._warned.add(("", "nonfinite"))
            warnings.warn(msg + "; skipping the step (on_nonfinite_grad='skip_step')", RuntimeWarning, stacklevel=4)
        diag.skipped = True
        self._finish(diag, t_start)
        return None

    def _bound(
        self, current: Sequence[torch.Tensor], specs: Sequence[TensorSpec], in_finite: torch.Tensor, sigma: float
    ) -> torch.Tensor:
        """Largest admissible output norm per tensor (:func:`~opacus_spectral.step.validation.output_bounds`); the
        expected noise norms are computed once per record set and noise std, then reused."""
        if self.max_output_ratio is None:
            return torch.full_like(in_finite, float("inf"), dtype=torch.float32)
        key = (tuple(specs), float(sigma))
        if self._noise_norms is None or self._noise_norms[0] != key:
            numels = [t.numel() for t in current]
            self._noise_norms = (key, noise_norms(numels, sigma, in_finite.device))
        return output_bounds(stacked_norms(current, 2.0), in_finite, self._noise_norms[1], self.max_output_ratio)

    def _outputs(self, dname: str, records: Sequence[NoisyGradient], result: Any) -> list[Any] | None:
        """One output per record (``None`` entries keep the record's tensor); ``None`` if unusable (fallback)."""
        if result is None:
            return [r.tensor for r in records]
        if isinstance(result, (torch.Tensor, str, bytes, Mapping)) or not isinstance(result, Iterable):
            expected = "expected None or one tensor (or None) per gradient"
            self._bad(dname, None, f"returned {type(result).__name__}; {expected}")
            return None
        outs = list(result)  # a generator may raise here: handled by the caller like any denoiser exception
        if len(outs) != len(records):
            self._bad(dname, None, f"returned {len(outs)} tensors for {len(records)} gradients")
            return None
        return [r.tensor if o is None else o for o, r in zip(outs, records, strict=True)]

    def _validate(
        self,
        dname: str,
        records: Sequence[NoisyGradient],
        outs: Sequence[Any],
        current: list[torch.Tensor],
        specs: Sequence[TensorSpec],
    ) -> list[torch.Tensor]:
        """Metadata checks (:func:`~opacus_spectral.step.validation.output_problem`) before any value is read."""
        new: list[torch.Tensor] = []
        for o, ref, r, spec in zip(outs, current, records, specs, strict=True):
            problem = output_problem(o, spec)
            if problem is not None:
                self._bad(dname, r.name, problem)
                new.append(ref)
            else:
                new.append(o.detach())
        return new

    def _check_values(
        self,
        dname: str,
        new: list[torch.Tensor],
        current: list[torch.Tensor],
        in_finite: torch.Tensor,
        bound: torch.Tensor,
        infos: Sequence[ParamInfo],
    ) -> None:
        """Non-finite outputs of finite inputs, and finite outputs above their tensor's norm bound (also where the
        input was non-finite, under ``on_nonfinite_grad="ignore"``), fall under the policy."""
        if not new:
            return
        out_finite = torch.isfinite(stacked_norms(new, float("inf")))
        out_norm = stacked_norms(new, 2.0)
        bad = (in_finite & ~out_finite) | (out_finite & (out_norm > bound))
        if bool(bad.any()):  # one host-device sync per denoiser and step
            for i in bad.nonzero().flatten().tolist():
                if not bool(out_finite[i]):
                    problem = "produced non-finite values from a finite gradient"
                else:
                    ratio = float(self.max_output_ratio or 1)
                    problem = (
                        f"produced an output of norm {float(out_norm[i]):.3g}"
                        f"{'' if bool(in_finite[i]) else ' from a non-finite gradient'}, more than max_output_ratio="
                        f"{ratio:g} x {float(bound[i]) / ratio:.3g}, this tensor's max(noisy gradient norm, "
                        "expected noise norm sigma*sqrt(numel))"
                    )
                self._bad(dname, infos[i].name, problem)
                new[i] = current[i]

    def _bad(self, dname: str, pname: str | None, problem: str, exc: BaseException | None = None) -> None:
        where = f" for parameter {pname!r}" if pname else ""
        msg = f"denoiser {dname!r} {problem}{where} (step {self.step})"
        if self.on_error == "raise":
            raise DenoiserError(msg + "; the optimizer step was aborted") from exc
        self.diagnostics.fallbacks[dname] += 1
        key = (dname, problem.split(" ", 1)[0])
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg + "; keeping its input gradient (on_error='fallback')", RuntimeWarning, stacklevel=4)

    @staticmethod
    def _oracle(
        infos: Sequence[ParamInfo],
        noisy: Sequence[torch.Tensor],
        denoised: Sequence[torch.Tensor],
        clean: Sequence[torch.Tensor],
    ) -> dict[str, Any]:
        """cos(noisy, clean) vs cos(denoised, clean), per parameter and over all parameters (benchmarks only)."""
        per = {
            i.name: (cosine([n], [c]), cosine([d], [c]))
            for i, n, d, c in zip(infos, noisy, denoised, clean, strict=False)
        }
        return {
            "per_param": per,
            "global": (cosine(noisy, clean), cosine(denoised, clean)),
        }
