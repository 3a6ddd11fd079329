"""Reading checkpoint files without executing code from them.

``torch.load(weights_only=False)`` — what Opacus 1.6's ``PrivacyEngine.load_checkpoint`` hard-codes
(``docs/upstream.md`` §1.6) — runs
whatever a pickle says, so a crafted checkpoint file executes code. Everything this project saves
(module / optimizer / accountant state, denoiser state) is tensors, numbers, strings and containers, which
``weights_only=True`` reads.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["load_checkpoint_file"]


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
