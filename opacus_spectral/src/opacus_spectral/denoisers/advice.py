"""Advice on denoiser/optimizer combinations that our measurements found harmful (``docs/denoisers.md``).

These are warnings, not errors: a combination can still be right on another task. Each message names what was
measured and where. The check is pure (optimizer + denoisers in, messages out); the engine warns once per
installation with :class:`DenoiserAdviceWarning`, which users can filter like any warning category.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ..errors import DenoiserAdviceWarning
from .base import denoiser_name

__all__ = ["ADAPTIVE_OPTIMIZERS", "DenoiserAdviceWarning", "combination_advice", "external_stacklevel"]

#: optimizers that divide each coordinate by a running RMS of its gradient
ADAPTIVE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


def combination_advice(optimizer: torch.optim.Optimizer, denoisers: Sequence[object]) -> list[str]:
    """Messages for the harmful combinations of ``optimizer`` (the inner, non-DP one) with ``denoisers``.

    * a temporal filter (a denoiser with ``temporal = True``) in front of an adaptive optimizer — measured on the
      Fashion-MNIST MLP with AdamW: ``ema`` −3.2 / −9.6 and ``doppler`` −2.4 / −7.9 accuracy points at
      B = 256 / 1024, ε = 3, each at its own tuned learning rate (``docs/results.md`` §7.5);
    * a temporal filter in front of SGD with momentum > 0 — two averages stacked; the filters were designed and
      measured as a replacement for momentum (SGD with ``momentum=0``, ``docs/results.md`` §7.2–§7.4).
    """
    temporal = [denoiser_name(d) for d in denoisers if getattr(d, "temporal", False) is True]
    if not temporal:
        return []
    names = ", ".join(repr(n) for n in temporal)
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        return [
            f"temporal denoiser(s) {names} in front of {type(optimizer).__name__}: measured with AdamW on the "
            "Fashion-MNIST MLP, 'ema' and 'doppler' lost 2.4-9.6 accuracy points against no denoiser at every "
            "learning rate tried (docs/denoisers.md); the optimizer already averages the gradient. Prefer no "
            "temporal denoiser with an adaptive optimizer, or SGD with momentum=0, and check on a validation split."
        ]
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0.0) > 0 for g in optimizer.param_groups):
        return [
            f"temporal denoiser(s) {names} in front of SGD with momentum > 0: two averages of the gradient are "
            "stacked. These denoisers replace momentum (use SGD with momentum=0 and tune the learning rate; "
            "docs/denoisers.md)."
        ]
    return []


def external_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the calling function point at the first frame outside
    ``opacus_spectral`` and ``opacus`` (the user's ``make_private`` line, whatever the call path inside)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("opacus_spectral", "opacus"):
        frame = frame.f_back
        level += 1
    return level
