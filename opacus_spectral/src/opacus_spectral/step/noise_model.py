"""The noise each record carries through the pipeline, as the denoisers declare it.

Every record starts isotropic with the step's ``noise_std``; after each denoiser, its
:meth:`~opacus_spectral.Denoiser.output_noise` declaration is applied (a gain scales the std of isotropic
noise; ``"colored"`` / ``"unknown"`` change the kind). A record made ``"unknown"`` by a callable that declares
nothing is remembered, so that a denoiser needing isotropic noise placed after it is reported instead of
skipping those records silently (:meth:`NoiseState.switch_off`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..denoisers.base import Denoiser, DenoiserProtocol
from .parameters import ParamInfo
from .records import NOISE_COLORED, NOISE_ISOTROPIC, NOISE_UNKNOWN, NoisyGradient

__all__ = ["NoiseState"]


class NoiseState:
    """Per-record noise std and kind during one step, plus which undeclared callable made a record unknown."""

    def __init__(self, n: int, sigma: float) -> None:
        self.sigmas = [float(sigma)] * n
        self.kinds = [NOISE_ISOTROPIC] * n
        self.undeclared: list[str | None] = [None] * n

    def records(self, infos: Sequence[ParamInfo], tensors: Sequence[torch.Tensor], step: int) -> list[NoisyGradient]:
        return [
            NoisyGradient(name=i.name, role=i.role, tensor=t, sigma=s, step=step, layer=i.layer, noise=k)
            for i, t, s, k in zip(infos, tensors, self.sigmas, self.kinds, strict=True)
        ]

    def apply(
        self,
        d: DenoiserProtocol,
        dname: str,
        records: Sequence[NoisyGradient],
        kept: Sequence[bool],
        index: Sequence[int] | None = None,
    ) -> str:
        """Apply ``d``'s declaration to the records it was handed (``records``, at ``index`` in the step; ``None``:
        all) and changed (not ``kept``); returns a warning ('' if none).

        A callable that declares nothing makes the noise of the records it was not handed unknown as well, as it
        did when every callable was handed every record (its outputs count as ``"unknown"``).
        """
        values, problem = _declaration(d, records)
        silent = not declares_noise(d)
        positions = range(len(records)) if index is None else index
        for k, v, keep in zip(positions, values, kept, strict=True):
            if not keep:
                self._declare(k, v, silent, dname)
        if index is not None and silent:
            for k in sorted(set(range(len(self.kinds))).difference(index)):
                self._declare(k, NOISE_UNKNOWN, silent, dname)
        return f"denoiser {dname!r}: output_noise {problem}; noise unknown" if problem else ""

    def _declare(self, k: int, v: Any, silent: bool, dname: str) -> None:
        """Record ``k`` after a declared value ``v``: a gain scales its std, a kind changes its kind."""
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            self.sigmas[k] *= float(v)  # kinds other than isotropic stay as they are
        elif isinstance(v, str) and v == NOISE_COLORED:
            if self.kinds[k] == NOISE_ISOTROPIC:
                self.kinds[k] = NOISE_COLORED
        else:
            if silent and self.kinds[k] != NOISE_UNKNOWN:
                self.undeclared[k] = dname
            self.kinds[k] = NOISE_UNKNOWN

    def switch_off(self, dname: str, infos: Sequence[ParamInfo], index: Sequence[int] | None) -> str:
        """Why the denoiser ``dname`` (``needs_isotropic_noise``), handed the records at ``index`` (its selection;
        ``None``: all), will skip records an undeclared callable made unknown ('' if not)."""
        handed = range(len(infos)) if index is None else index
        hit = [infos[k].name for k in handed if self.undeclared[k] is not None]
        if not hit:
            return ""
        earlier = ", ".join(repr(n) for n in dict.fromkeys(by for by in self.undeclared if by is not None))
        return (
            f"denoiser {dname!r} acts only on isotropic noise of known std, but {earlier} before it declares no "
            f"output_noise, so the noise of {len(hit)} parameter(s) it selects (e.g. {hit[0]!r}) counts as 'unknown' "
            f"and {dname!r} skips them every step. A logger that leaves the gradients unchanged: pass it as "
            "opacus_spectral.observer(fn); a denoiser: give it an output_noise(records) method (docs/plugins.md)"
        )


def declares_noise(d: object) -> bool:
    """Whether ``d`` declares its output noise: it has an ``output_noise`` other than :class:`Denoiser`'s default."""
    declare = getattr(d, "output_noise", None)
    return declare is not None and getattr(declare, "__func__", None) is not Denoiser.output_noise


def _declaration(d: DenoiserProtocol, records: Sequence[NoisyGradient]) -> tuple[list[Any], str]:
    """One declared value per record, and what was wrong with the declaration ('' if nothing)."""
    declare = getattr(d, "output_noise", None)
    if declare is None:
        return [NOISE_UNKNOWN] * len(records), ""
    try:
        raw = declare(records)
        if isinstance(raw, (str, int, float)):
            return [raw] * len(records), ""
        if isinstance(raw, Sequence) and len(raw) == len(records):
            return [v if isinstance(v, (str, int, float)) else NOISE_UNKNOWN for v in raw], ""
        return [NOISE_UNKNOWN] * len(records), f"returned {raw!r}"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a broken declaration only costs the noise knowledge
        return [NOISE_UNKNOWN] * len(records), f"raised {exc!r}"
