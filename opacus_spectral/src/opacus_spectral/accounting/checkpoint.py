"""Reading checkpoint files without executing code from them, and refusing DP state that disagrees with the run.

``torch.load(weights_only=False)`` — what Opacus 1.6's ``PrivacyEngine.load_checkpoint`` hard-codes
(``docs/upstream.md`` §1.6) — runs
whatever a pickle says, so a crafted checkpoint file executes code. Everything this project saves
(module / optimizer / accountant state, denoiser state) is tensors, numbers, strings and containers, which
``weights_only=True`` reads. The accountant's history in a checkpoint is data too: :func:`verify_accountant_history`
refuses one that disagrees with the optimizer it is loaded into (docs/engine.md, "Safety rails").
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import torch

__all__ = [
    "COUNT_KEY",
    "load_checkpoint_file",
    "optimizer_step_count",
    "read_engine_count",
    "verify_accountant_history",
]

#: the key of the engine's own step count in a checkpoint (``PrivacyEngine.save_checkpoint``)
COUNT_KEY = "opacus_spectral_accounting"
_COUNT_FIELDS = ("dp_steps", "charged_steps", "history_steps")


def load_checkpoint_file(path: Any, *, trusted: bool = False, **torch_load_kwargs: Any) -> dict[str, Any]:
    """``torch.load(path, weights_only=not trusted)``; a refused object raises ``pickle.UnpicklingError``
    that says how to opt in."""
    if "weights_only" in torch_load_kwargs:
        raise TypeError("pass trusted=True instead of weights_only (checkpoint loading is weights-only by default)")
    if trusted:
        return torch.load(path, weights_only=False, **torch_load_kwargs)
    try:
        return torch.load(path, weights_only=True, **torch_load_kwargs)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"refusing to unpickle {path!s}: it holds objects other than tensors, numbers, strings and containers, "
            "and unpickling them can execute code. Pass trusted=True only for a file you created yourself. "
            f"(torch: {str(err).splitlines()[0]})"
        ) from err


def verify_accountant_history(
    history: Any,
    *,
    noise_multiplier: float | None,
    sample_rate: float | None,
    steps: int | None = None,
    min_steps: int = 0,
    where: str = "checkpoint",
    sigma_divisors: bool = False,
) -> int:
    """Refuse an accountant history ``[(σ, q, n), ...]`` (as Opacus' RDP / PRV / GDP accountants keep it) that
    does not agree with the run it is loaded into; returns its step count.

    Every σ must equal ``noise_multiplier`` (``None``: not checked, e.g. under a noise scheduler); every q must be
    ``sample_rate`` times a whole number (Opacus records ``q × accumulated_iterations``; ``None``: not checked);
    the steps must add up to ``steps`` when given, and to at least ``min_steps`` (a step counter beside the
    history, e.g. Adam's ``step``: every counted update was an accounted DP step). ``ValueError`` names the
    mismatch: a history edited down (σ raised, q lowered, steps removed) would under-report ε.
    """
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"{where}: the accountant history is a {type(history).__name__}, not a list of (σ, q, steps)")
    total = 0
    for i, entry in enumerate(history):
        sigma, q, n = _entry(entry, i, where)
        if noise_multiplier is not None and not _same_sigma(sigma, noise_multiplier, sigma_divisors):
            raise ValueError(
                f"{where}: accountant history entry {i} records noise_multiplier {sigma!r}, but the optimizer it is "
                f"loaded into uses {noise_multiplier!r}: refusing a history that would misreport epsilon"
            )
        if sample_rate is not None and not _whole_multiple(q, sample_rate):
            raise ValueError(
                f"{where}: accountant history entry {i} records sample rate {q!r}, which is not a whole multiple of "
                f"this run's sample rate {sample_rate!r}: refusing a history that would misreport epsilon"
            )
        total += n
    if steps is not None and total != steps:
        raise ValueError(
            f"{where}: the accountant history counts {total} DP steps but the run it belongs to took {steps}: "
            "refusing a history that would misreport epsilon"
        )
    if total < min_steps:
        raise ValueError(
            f"{where}: the accountant history counts {total} DP steps"
            f"{' (it is empty)' if not history else ''}, but the state saved beside it records {min_steps} "
            "updates: refusing a history that would under-report epsilon"
        )
    return total


def _entry(entry: Any, i: int, where: str) -> tuple[float, float, int]:
    bad = ValueError(f"{where}: accountant history entry {i} is {entry!r}, not (noise_multiplier, sample_rate, steps)")
    if not isinstance(entry, (list, tuple)) or len(entry) != 3:
        raise bad
    sigma, q, n = entry
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in (sigma, q)) or not isinstance(n, int):
        raise bad
    if isinstance(n, bool) or n < 1 or not math.isfinite(sigma) or sigma < 0 or not (0 < q <= 1):
        raise bad
    return float(sigma), float(q), n


def _same_sigma(sigma: float, noise_multiplier: float, divisors: bool) -> bool:
    if divisors and sigma > 0 and noise_multiplier > 0:
        return _whole_multiple(noise_multiplier, sigma)
    return math.isclose(sigma, noise_multiplier, rel_tol=1e-9, abs_tol=1e-12)


def read_engine_count(block: Any, *, where: str) -> dict[str, Any]:
    """The engine's step count saved beside a checkpoint's accountant history (:data:`COUNT_KEY`), validated:
    ``dp_steps`` (noisy DP steps), ``charged_steps`` (steps its accountant hooks added to the history),
    ``history_steps`` (the history's step count when saved) and ``sampling`` (``"poisson"`` or ``"shuffle"``)."""
    if block is None:
        raise ValueError(
            f"{where}: the file holds no step count of the engine that saved it ({COUNT_KEY}): it was not written "
            "by opacus_spectral's PrivacyEngine.save_checkpoint (e.g. by opacus.PrivacyEngine), or the count was "
            "removed, so its accountant history cannot be cross-checked: refusing a history that could under-report "
            "epsilon"
        )
    ok = isinstance(block, dict) and set(block) == {*_COUNT_FIELDS, "sampling"}
    ok = ok and all(type(block[k]) is int and block[k] >= 0 for k in _COUNT_FIELDS)
    if not ok or block["sampling"] not in ("poisson", "shuffle"):
        raise ValueError(f"{where}: {COUNT_KEY} is malformed (expected {', '.join(_COUNT_FIELDS)} >= 0 and sampling)")
    if block["charged_steps"] > block["history_steps"]:
        raise ValueError(
            f"{where}: the engine charged {block['charged_steps']} steps but the history counted "
            f"{block['history_steps']} when saved: refusing an edited count"
        )
    return block


def _whole_multiple(q: float, sample_rate: float) -> bool:
    ratio = q / sample_rate
    return round(ratio) >= 1 and math.isclose(ratio, round(ratio), rel_tol=1e-9)


def optimizer_step_count(optimizer_state: Any) -> int:
    """The largest per-parameter ``step`` in a torch optimizer ``state_dict()`` (Adam, AdamW, ...; 0 when the
    optimizer keeps none, e.g. SGD): the number of updates that parameter received."""
    state = optimizer_state.get("state", {}) if isinstance(optimizer_state, dict) else {}
    counts = [0]
    for entry in state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            counts.append(int(step.item()))
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            counts.append(int(step))
    return max(counts)
