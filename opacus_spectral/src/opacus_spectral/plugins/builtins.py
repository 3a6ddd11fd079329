"""Built-in denoisers, registered through the ``opacus_spectral`` entry-point group like any plugin.

The classes are imported only when a user asks for them, so a problem in one never affects the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..hookspecs import hookimpl


def _rmt(**kwargs: Any) -> Any:
    from ..denoisers.rmt import RMTDenoiser

    return RMTDenoiser(**kwargs)


def _rmt_paper(**kwargs: Any) -> Any:
    """Paper A's exact setting (κ = 1.02 gate, rescale to the noisy norm); other options as ``"rmt"``."""
    from ..denoisers.rmt import PAPER_SETTING, RMTDenoiser

    return RMTDenoiser(**{**PAPER_SETTING, **kwargs})


def _ema(**kwargs: Any) -> Any:
    from ..denoisers.ema import EMADenoiser

    return EMADenoiser(**kwargs)


def _lowpass(**kwargs: Any) -> Any:
    from ..denoisers.lowpass import LowPassDenoiser

    return LowPassDenoiser(**kwargs)


@hookimpl
def opacus_spectral_denoisers() -> Mapping[str, Callable[..., Any]]:
    return {"rmt": _rmt, "rmt_paper": _rmt_paper, "lowpass": _lowpass, "ema": _ema}
