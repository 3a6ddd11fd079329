"""``noise_mechanism=("bandmf", {"bands": b})``: banded matrix-factorization noise (``docs/mechanisms.md``; the
mathematics: :mod:`.bandmf_math`). Its strategy is b coefficients optimized for the run's length at κ = 1, or the
ones the caller gives (the engine computes their κ and refuses unstable ones, :class:`~.strategy.BandedToeplitz`).

Optimized coefficients are public (a function of T, b and the workload only), so they are kept on disk between runs:
``$OPACUS_SPECTRAL_CACHE`` (``off``: not kept), else ``$XDG_CACHE_HOME/opacus_spectral`` or
``~/.cache/opacus_spectral``. A cached file is used only when it parses to b finite, stable coefficients of unit norm;
an unwritable folder only costs the optimization again.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bandmf_math import optimal_coefficients
from .base import NoiseMechanism
from .strategy import BandedToeplitz

__all__ = ["BandMFMechanism", "prefix_sum_coefficients"]

#: the optimizer's version in the cache's file names (a new optimizer does not read an older one's files)
CACHE_VERSION = 2


class BandMFMechanism(NoiseMechanism):
    """BandMF with ``bands`` bands: coefficients optimized for the run's length, or ``coefficients`` as given."""

    name = "bandmf"

    def __init__(self, bands: int = 4, coefficients: Sequence[float] | None = None) -> None:
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"bandmf: bands must be an integer >= 1, got {bands!r}")
        self.bands = bands
        self._given = None if coefficients is None else BandedToeplitz(tuple(coefficients))
        if self._given is not None and self._given.bands != bands:
            raise ValueError(f"bandmf: {self._given.bands} coefficients for {bands} bands")

    def strategy(self, *, steps: int | None, sample_rate: float, dataset_size: int) -> BandedToeplitz:
        if self._given is not None:
            return self._given
        if steps is None:
            raise ValueError(
                "noise_mechanism='bandmf' needs the run's length: pass steps= (or epochs=) to make_private; the "
                "coefficients are optimized for it"
            )
        if self.bands > steps:
            raise ValueError(f"bandmf: bands={self.bands} exceeds the run's {steps} steps (b <= T)")
        coefficients = prefix_sum_coefficients(int(steps), self.bands)
        return BandedToeplitz(coefficients, {"objective": "prefix_sum", "steps": int(steps)})

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bands": self.bands}


def cache_dir() -> Path | None:
    """Where optimized coefficients are kept (module docstring); None when ``$OPACUS_SPECTRAL_CACHE`` is ``off``."""
    chosen = os.environ.get("OPACUS_SPECTRAL_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() == "off" else Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opacus_spectral"


@functools.lru_cache(maxsize=64)
def prefix_sum_coefficients(steps: int, bands: int) -> tuple[float, ...]:
    """:func:`~.bandmf_math.optimal_coefficients` for the prefix sums, from the disk cache when there (a tqdm bar
    when the optimization takes over 2 s)."""
    from tqdm.auto import tqdm

    folder = cache_dir()
    path = None if folder is None else folder / f"bandmf-v{CACHE_VERSION}-prefix_sum-T{steps}-b{bands}.json"
    cached = _read_cached(path, bands)
    if cached is not None:
        return cached
    with tqdm(desc=f"BandMF coefficients (T={steps}, b={bands})", unit="iter", delay=2.0, leave=False) as bar:
        coefficients = optimal_coefficients(steps, bands, progress=bar.update)
    _write_cached(path, coefficients)
    return coefficients


def _read_cached(path: Path | None, bands: int) -> tuple[float, ...] | None:
    try:
        values = json.loads(path.read_text()) if path is not None else None
        c = tuple(float(x) for x in values)
        ok = len(c) == bands and math.isclose(math.fsum(x * x for x in c), 1.0, rel_tol=1e-9)
        return BandedToeplitz(c).coefficients if ok else None  # finite, c_0 > 0, stable
    except (OSError, ValueError, TypeError):
        return None


def _write_cached(path: Path | None, coefficients: tuple[float, ...]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(list(coefficients)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full disk: the next run optimizes again
