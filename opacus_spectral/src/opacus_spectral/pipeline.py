"""The post-noise pipeline: runs the user's denoisers, in order, on the step's noisy gradients.

It builds one :class:`NoisyGradient` per parameter that has a gradient, calls each denoiser, validates
its output (shape, dtype, device, finite where the input was finite) and writes the result to ``p.grad``.
Invalid output either raises :class:`DenoiserError` naming the denoiser and the parameter (default,
``on_error="raise"``; the step is aborted and the affected ``p.grad`` are cleared so no weight is updated
from them) or, with ``on_error="fallback"``, keeps that denoiser's input for the bad tensors, warns once and
counts it (the inputs are copied before each denoiser in this mode: one extra copy of the gradients).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .denoiser import DenoiserProtocol, denoiser_name
from .records import NoisyGradient
from .roles import ParamInfo

OnError = Literal["raise", "fallback"]


class DenoiserError(RuntimeError):
    """A denoiser raised or returned an invalid gradient."""


@dataclass
class StepDiagnostics:
    """What happened in one logical step."""

    step: int
    sigma: float
    n_tensors: int
    seconds: float = 0.0
    denoisers: dict[str, dict[str, Any]] = field(default_factory=dict)
    oracle: dict[str, Any] | None = None


@dataclass
class PipelineDiagnostics:
    """Counters over the run plus the last ``maxlen`` steps."""

    steps: int = 0
    seconds: float = 0.0
    calls: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    skipped: int = 0  #: inner-optimizer steps without Opacus noise (post hooks not run)
    history: deque = field(default_factory=lambda: deque(maxlen=1000))

    @property
    def last(self) -> StepDiagnostics | None:
        return self.history[-1] if self.history else None


def _max_abs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor max |x| in one fused call (inf/nan propagate; finite values never overflow)."""
    if not tensors:
        return torch.zeros(0)
    norms = torch._foreach_norm([t if t.numel() else t.new_zeros(1) for t in tensors], float("inf"))
    return torch.stack([n.float().to(tensors[0].device) for n in norms])


def _cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    num = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return num / (na * nb) if na > 0 and nb > 0 else float("nan")


class PostNoisePipeline:
    """Applies ``denoisers`` in order to noisy gradients; see the module docstring for the error policy."""

    def __init__(
        self,
        denoisers: Sequence[DenoiserProtocol],
        *,
        on_error: OnError = "raise",
        oracle: bool = False,
        history: int = 1000,
    ) -> None:
        if on_error not in ("raise", "fallback"):
            raise ValueError(f"on_error must be 'raise' or 'fallback', got {on_error!r}")
        self.denoisers = list(denoisers)
        self.names = self._unique_names(self.denoisers)
        self.on_error: OnError = on_error
        self.oracle = oracle
        self.diagnostics = PipelineDiagnostics(history=deque(maxlen=history))
        self._warned: set[tuple[str, str]] = set()
        self.step = 0

    @staticmethod
    def _unique_names(denoisers: Sequence[DenoiserProtocol]) -> list[str]:
        names, seen = [], Counter()
        for d in denoisers:
            n = denoiser_name(d)
            seen[n] += 1
            names.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
        return names

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
        for d, s in zip(self.denoisers, states):
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
    ) -> list[torch.Tensor]:
        """Denoise ``grads`` (noisy gradient tensors, not Parameters). Returns the tensors to use as grads."""
        t_start = time.perf_counter()
        diag = StepDiagnostics(step=self.step, sigma=sigma, n_tensors=len(grads))
        current = [g.detach() for g in grads]
        noisy_ref = [g.clone() for g in current] if self.oracle else None
        in_finite = torch.isfinite(_max_abs(current)) if self.denoisers and current else None
        for d, dname in zip(self.denoisers, self.names):
            t0 = time.perf_counter()
            inputs = [t.clone() for t in current] if self.on_error == "fallback" else current
            records = [
                NoisyGradient(name=i.name, role=i.role, tensor=t, sigma=sigma, step=self.step, layer=i.layer)
                for i, t in zip(infos, inputs)
            ]
            self.diagnostics.calls[dname] += 1
            entry: dict[str, Any] = {"fallbacks": 0}
            try:
                result = d(records)
            except Exception as exc:  # noqa: BLE001 - every denoiser failure is handled by the policy
                self.diagnostics.errors[dname] += 1
                self._bad(dname, None, f"raised {type(exc).__name__}: {exc}", exc)
                entry["fallbacks"] = len(current)
                entry["error"] = f"{type(exc).__name__}: {exc}"
                diag.denoisers[dname] = entry
                continue
            new = self._collect(dname, records, result, current)
            self._check_finite(dname, new, current, in_finite, infos)
            n_fb = sum(1 for a, b in zip(new, current) if a is b) if self.on_error == "fallback" else 0
            entry["fallbacks"] = n_fb
            current = new
            entry["seconds"] = time.perf_counter() - t0
            extra = getattr(d, "diagnostics", None)
            if isinstance(extra, dict) and extra:
                entry.update(extra)
            diag.denoisers[dname] = entry
        if self.oracle and clean is not None and noisy_ref is not None:
            diag.oracle = self._oracle(infos, noisy_ref, current, clean)
        diag.seconds = time.perf_counter() - t_start
        self.diagnostics.seconds += diag.seconds
        self.diagnostics.steps += 1
        self.diagnostics.history.append(diag)
        self.step += 1
        return current

    def _collect(
        self,
        dname: str,
        records: Sequence[NoisyGradient],
        result: Any,
        current: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        if result is None:
            outs: list[Any] = [r.tensor for r in records]
        else:
            outs = list(result)
            if len(outs) != len(records):
                self._bad(dname, None, f"returned {len(outs)} tensors for {len(records)} gradients")
                return list(current)
            outs = [r.tensor if o is None else o for o, r in zip(outs, records)]
        new: list[torch.Tensor] = []
        for o, ref, r in zip(outs, current, records):
            problem = None
            if not isinstance(o, torch.Tensor):
                problem = f"returned {type(o).__name__} instead of a tensor"
            elif o.shape != ref.shape:
                problem = f"changed the shape {tuple(ref.shape)} -> {tuple(o.shape)}"
            elif o.dtype != ref.dtype:
                problem = f"changed the dtype {ref.dtype} -> {o.dtype}"
            elif o.device != ref.device:
                problem = f"moved the gradient from {ref.device} to {o.device}"
            if problem is not None:
                self._bad(dname, r.name, problem)
                new.append(ref)
            else:
                new.append(o.detach())
        return new

    def _check_finite(
        self,
        dname: str,
        new: list[torch.Tensor],
        current: list[torch.Tensor],
        in_finite: torch.Tensor | None,
        infos: Sequence[ParamInfo],
    ) -> None:
        if in_finite is None or not new:
            return
        bad = in_finite & ~torch.isfinite(_max_abs(new))
        if bool(bad.any()):  # one host-device sync per denoiser and step
            for i in bad.nonzero().flatten().tolist():
                self._bad(dname, infos[i].name, "produced non-finite values from a finite gradient")
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
            i.name: (_cosine([n], [c]), _cosine([d], [c])) for i, n, d, c in zip(infos, noisy, denoised, clean)
        }
        return {
            "per_param": per,
            "global": (_cosine(noisy, clean), _cosine(denoised, clean)),
        }
