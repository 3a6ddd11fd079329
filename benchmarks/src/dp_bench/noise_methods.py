"""The grid's noise-mechanism methods (``docs/results.md`` §12): ``bandmf:<b>`` and ``cyclic:<b>``, the
``noise_mechanism`` each runs with and the (sample rate, steps) its accountant charges — one place for the grid
that trains them and the reports that compute an ε from their records."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["accounting", "bands_of", "mechanism_of_method", "sampler_of"]


def bands_of(method: str) -> int | None:
    """b of a method named ``bandmf:<b>`` (DP-SGD's clipping and the BandMF noise mechanism with b bands, no
    denoiser: ``docs/mechanisms.md``) or ``cyclic:<b>`` (the same cyclic Poisson sampler and accounting with
    uncorrelated noise: BandMF with coefficients (1, 0, …, 0), an ablation), else None."""
    kind, _, b = method.partition(":")
    if kind not in ("bandmf", "cyclic") or not b:
        return None
    bands = int(b)
    if bands < 1:
        raise ValueError(f"{kind}:<b> needs b >= 1, got {method!r}")
    return bands


def mechanism_of_method(method: str) -> tuple[str, dict[str, Any]] | None:
    """The ``noise_mechanism`` of a method: BandMF's for ``bandmf:<b>``, BandMF with M = I for ``cyclic:<b>``."""
    bands = bands_of(method)
    if bands is None:
        return None
    if method.startswith("cyclic:"):
        return ("bandmf", {"bands": bands, "coefficients": [1.0] + [0.0] * (bands - 1)})
    return ("bandmf", {"bands": bands})


def accounting(method: str, q: float, steps: int) -> tuple[float, int]:
    """The (sample rate, steps) the accountant charges a method at Poisson rate ``q`` over ``steps``: BandMF's
    (b·q, ⌈steps/b⌉) with cyclic Poisson sampling, DP-SGD's (q, steps) otherwise."""
    bands = bands_of(method) or 1
    return bands * q, math.ceil(steps / bands)


def sampler_of(method: str) -> dict[str, str]:
    """The batch sampler a method trains with and the adjacency its ε holds for: Poisson sampling (Opacus') for
    DP-SGD; for ``bandmf:<b>`` / ``cyclic:<b>`` the shipped cyclic Poisson sampler, each record's group drawn
    independently (``opacus_spectral.mechanisms.cyclic``) — both add/remove. (§12.1–§12.6 ran an earlier
    equal-split sampler, zero-out adjacency only; its runs carry no such record.)"""
    if bands_of(method) is None:
        return {"sampler": "poisson", "adjacency": "add/remove"}
    return {"sampler": "cyclic_poisson:independent_groups", "adjacency": "add/remove"}
