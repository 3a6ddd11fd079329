"""The settings of RMT denoising, validated once (``docs/denoisers.md``, ``docs/math.md`` §1).

:class:`RMTSettings` holds what :func:`~opacus_spectral.denoisers.rmt.rmt_denoise` computes with: the gate, the
shrinkage and norm correction, the decomposition path and its controls. Its defaults are the library's (the registered
``"rmt"``): a Tracy–Widom gate at a false-alarm rate of 1e-3 and the clean-norm estimate (measured in
``docs/results.md`` §7). Paper A's setting (``"rmt_paper"``) is :data:`PAPER_SETTING` on top of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .spectral import Gate
from .tracy_widom import tracy_widom_quantile

__all__ = [
    "NORM_CORRECTIONS",
    "PAPER_SETTING",
    "PAPER_SETTINGS",
    "Method",
    "NormCorrection",
    "RMTSettings",
    "Screen",
    "resolve_dtype",
    "resolve_norm_correction",
    "resolve_residual",
]

Method = Literal["auto", "gram", "truncated", "full"]
Screen = Literal["auto", "krylov", "cholesky"]
NormCorrection = Literal["noisy", "clean_estimate", "none"]
NORM_CORRECTIONS: tuple[str, ...] = ("noisy", "clean_estimate", "none")
METHODS: tuple[str, ...] = ("auto", "gram", "truncated", "full")
SCREENS: tuple[str, ...] = ("auto", "krylov", "cholesky")


def resolve_norm_correction(value: bool | str) -> str:
    """``True`` → ``"noisy"`` (paper A), ``False`` → ``"none"``; a string must be one of :data:`NORM_CORRECTIONS`."""
    if value is True:
        return "noisy"
    if value is False:
        return "none"
    if value not in NORM_CORRECTIONS:
        raise ValueError(f"norm_correction must be one of {NORM_CORRECTIONS} (or True/False), got {value!r}")
    return str(value)


def resolve_residual(value: float | str) -> float | str:
    """``residual``: a factor in [0, 1] for the sub-threshold part, or ``"james_stein"`` (estimated per matrix)."""
    if value == "james_stein":
        return "james_stein"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"residual must be a number in [0, 1] or 'james_stein', got {value!r}")
    return float(value)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` / ``torch.float64``, also accepted as strings (config files)."""
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {dtype!r}")
    return resolved  # type: ignore[return-value]


def _positive_int(key: str, val: Any, *, optional: bool = False) -> None:
    if optional and val is None:
        return
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{key} must be a positive int{' or None' if optional else ''}, got {val!r}")


@dataclass(frozen=True)
class RMTSettings:
    """How each matrix is denoised (``docs/math.md`` §1); every value is checked once, here.

    Args:
        gate: ``"tracy_widom"`` (default: a stated false-alarm rate on pure noise) or ``"kappa"`` (paper A:
            ``λ~₁ > κ·s(√m+√n)``); §1.7.
        kappa: the factor of ``gate="kappa"`` (paper A: 1.02).
        false_alarm: the Tracy–Widom gate's false-alarm rate on pure noise, in [1e-8, 0.5].
        tw_centering: ``"johnstone"`` (Johnstone 2001, conservative on thin shapes) or ``"ma"`` (Ma 2012).
        norm_correction: ``"clean_estimate"`` (default: rescale to ``sqrt(max(‖G~‖² − mn·s², 0))``), ``"noisy"``
            (paper A: to ``‖G~‖_F``; also ``True``) or ``"none"`` (also ``False``); §1.8.
        residual: the sub-threshold part of a gated matrix: ``0`` (paper A: dropped), a factor ``ρ ∈ (0, 1]``
            or ``"james_stein"`` (ρ estimated per matrix); §1.11.
        method: ``"auto"`` (``"gram"`` for ``min(m, n) <= gram_max``, else ``"truncated"``), ``"gram"``,
            ``"truncated"`` or ``"full"`` (a batched full SVD, the reference); §1.10, §1.12.
        gram_max, screen, krylov_min, oversample, max_iter, tol, false_shut: the fast paths' controls, see
            :func:`~opacus_spectral.denoisers.rmt.rmt_denoise`.
        compute_dtype: ``torch.float32`` (default) or ``torch.float64`` (also as strings); promoted with the input.
        seed: seed of the Krylov start block (deterministic on every rank).
    """

    gate: Gate = "tracy_widom"
    kappa: float = 1.02
    false_alarm: float = 1e-3
    tw_centering: Literal["johnstone", "ma"] = "johnstone"
    norm_correction: NormCorrection = "clean_estimate"
    residual: float | str = 0.0
    method: Method = "auto"
    gram_max: int = 64
    screen: Screen = "auto"
    krylov_min: int = 2048
    oversample: int = 16
    max_iter: int = 60
    tol: float | None = None
    false_shut: float = 1e-12
    compute_dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        kappa = self.kappa
        if isinstance(kappa, bool) or not (isinstance(kappa, (int, float)) and math.isfinite(kappa) and kappa > 0):
            raise ValueError(f"kappa must be a positive finite number, got {kappa!r}")
        if self.gate not in ("kappa", "tracy_widom"):
            raise ValueError(f"gate must be 'kappa' or 'tracy_widom', got {self.gate!r}")
        tracy_widom_quantile(self.false_alarm)  # validates the range
        if self.tw_centering not in ("johnstone", "ma"):
            raise ValueError(f"tw_centering must be 'johnstone' or 'ma', got {self.tw_centering!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be 'auto', 'gram', 'truncated' or 'full', got {self.method!r}")
        if self.screen not in SCREENS:
            raise ValueError(f"screen must be 'auto', 'krylov' or 'cholesky', got {self.screen!r}")
        if not (isinstance(self.false_shut, float) and 0.0 < self.false_shut < 1e-3):
            raise ValueError(f"false_shut must be a float in (0, 1e-3), got {self.false_shut!r}")
        for key in ("gram_max", "krylov_min", "oversample", "max_iter"):
            _positive_int(key, getattr(self, key))
        tol = self.tol
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1):
            raise ValueError(f"tol must be a number in (0, 1) or None, got {tol!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        fix = {
            "kappa": float(kappa),
            "false_alarm": float(self.false_alarm),
            "norm_correction": resolve_norm_correction(self.norm_correction),
            "residual": resolve_residual(self.residual),
            "compute_dtype": resolve_dtype(self.compute_dtype),
        }
        for key, val in fix.items():
            object.__setattr__(self, key, val)

    def replace(self, **changes: Any) -> RMTSettings:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


#: paper A's setting over the defaults (κ = 1.02 gate, rescale to the noisy norm):
#: ``RMTDenoiser(**PAPER_SETTING)`` = the registered ``"rmt_paper"``
PAPER_SETTING: dict[str, Any] = {"gate": "kappa", "kappa": 1.02, "norm_correction": "noisy"}
#: the same as an :class:`RMTSettings`
PAPER_SETTINGS = RMTSettings(**PAPER_SETTING)
#: the names :class:`RMTSettings` accepts (``RMTDenoiser`` forwards these keyword arguments to it)
FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(RMTSettings))
