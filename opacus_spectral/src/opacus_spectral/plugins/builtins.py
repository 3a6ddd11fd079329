"""Built-in denoisers and noise mechanisms, registered through the ``opacus_spectral`` entry-point group like any
plugin.

The classes are imported only when a user asks for them, so a problem in one never affects the others. Each factory's
signature is its class's — with the settings ``rmt`` takes as keywords in place of its ``**options`` — so the registry
names a misspelt keyword with the valid ones.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..hookspecs import hookimpl

_RMT_FIELDS = ("..denoisers.rmt.settings", "FIELDS")  # what RMTDenoiser's **options accept


class _Lazy:
    """``cls`` of ``module`` (relative to this package) built with ``preset`` — the name of a settings mapping in that
    module — under the caller's keywords; ``options``: ``(module, attribute)`` of the names its ``**options`` take."""

    def __init__(
        self, module: str, cls: str, *, preset: str | None = None, options: tuple[str, str] | None = None
    ) -> None:
        self._module, self._cls, self._preset, self._options = module, cls, preset, options

    def _attr(self, name: str, module: str | None = None) -> Any:
        return getattr(importlib.import_module(module or self._module, __package__), name)

    def __call__(self, **kwargs: Any) -> Any:
        preset = self._attr(self._preset) if self._preset else {}
        return self._attr(self._cls)(**{**preset, **kwargs})

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self._attr(self._cls))
        if self._options is None:
            return signature
        module, attr = self._options
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in sorted(self._attr(attr, module))]
        return signature.replace(parameters=own + extra)


@hookimpl
def opacus_spectral_denoisers() -> Mapping[str, Callable[..., Any]]:
    return {
        "rmt": _Lazy("..denoisers.rmt", "RMTDenoiser", options=_RMT_FIELDS),
        # paper A's exact setting (κ = 1.02 gate, rescale to the noisy norm); other options as "rmt"
        "rmt_paper": _Lazy("..denoisers.rmt", "RMTDenoiser", preset="PAPER_SETTING", options=_RMT_FIELDS),
        "lowpass": _Lazy("..denoisers.lowpass", "LowPassDenoiser"),
        "ema": _Lazy("..denoisers.ema", "EMADenoiser"),
    }


@hookimpl
def opacus_spectral_noise_mechanisms() -> Mapping[str, Callable[..., Any]]:
    return {
        "gaussian": _Lazy("..mechanisms.base", "GaussianMechanism"),
        "bandmf": _Lazy("..mechanisms.bandmf", "BandMFMechanism"),
    }
