"""Lazy package exports (PEP 562): a package's names import their module on first use, so importing the package
pulls neither PEFT's model code nor Flower until something needs it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``name`` is imported from ``package.<table[name]>`` on first use and
    cached in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(import_module(f".{table[name]}", package), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
