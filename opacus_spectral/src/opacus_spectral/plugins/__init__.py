"""The plugin system: entry-point loading guarded per plugin (``registry``), the built-in plugin, the
conformance kit plugin authors run (``testing``). The hooks themselves: :mod:`opacus_spectral.hookspecs`."""

from ..step.records import ParameterRole
from .registry import (
    DenoiserInfo,
    DenoiserSpec,
    LoadError,
    available_denoisers,
    get_registry,
    load_errors,
    reload_registry,
)

__all__ = [
    "DenoiserInfo",
    "DenoiserSpec",
    "LoadError",
    "ParameterRole",
    "available_denoisers",
    "get_registry",
    "load_errors",
    "reload_registry",
]
