"""peft-lalora: LA-LoRA (LoRA with step-wise alternating factor updates) as a PEFT tuner.

Importing this package registers the PEFT type ``"LALORA"`` (idempotent) with PEFT — at once when ``peft`` is
already imported, otherwise the moment it is (before any PEFT call can look the type up) — so ``get_peft_model``,
``PeftModel.from_pretrained``, ``AutoPeftModel*``, ``save_pretrained`` and ``merge_and_unload`` work with
:class:`LALoraConfig`. Every name below is imported on first use: ``import peft_lalora`` alone imports no torch
(``peft-lalora federate --help`` answers at once). DP parts (``opacus_spectral``) are imported lazily, behind the
``[dp]`` extra.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib import import_module
from typing import Any

from ._lazy import lazy_getattr

__version__ = "0.2.0"

_LAZY = {
    "AlternationController": "alternation.controller",
    "LALoraTrainerCallback": "alternation.controller",
    "phase_at": "alternation.controller",
    "LoraFactor": "alternation.factors",
    "find_lora_factors": "alternation.factors",
    "lalora_param_groups": "alternation.factors",
    "AlternationSchedule": "alternation.schedule",
    "ALTERNATION_MODES": "tuners.lalora.config",
    "LALoraConfig": "tuners.lalora.config",
    "LALoraPeftType": "tuners.lalora.config",
    "export_as_lora": "tuners.lalora.export",
    "to_lora_config": "tuners.lalora.export",
    "LALoraModel": "tuners.lalora.model",
    "is_registered": "tuners.lalora.registration",
    "register": "tuners.lalora.registration",
}
__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)


class _RegisterAfterPeft(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``peft`` with the other finders, executes it, then registers ``LALORA`` (removes itself when it runs).

    A probe (``importlib.util.find_spec("peft")``, as transformers' availability checks do) gets a spec and leaves
    the finder in place: only executing ``peft`` consumes it."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "peft" or self._finding:
            return None
        self._finding = True  # the other finders answer the inner lookup
        try:
            spec = importlib.util.find_spec("peft")
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = self._loader
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self._loader.exec_module(module)
        import_module(".tuners.lalora.registration", __name__).register()


if "peft" in sys.modules:
    import_module(".tuners.lalora.registration", __name__).register()
elif not any(isinstance(f, _RegisterAfterPeft) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterPeft())
