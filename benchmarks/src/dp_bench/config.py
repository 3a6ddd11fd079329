"""Every command's configuration is one dataclass: its CLI flags, defaults and help are generated from it
(:func:`peft_lalora.cli.add_dataclass_arguments`), and the result JSON stores it as ``config``."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from peft_lalora.cli import add_dataclass_arguments, dataclass_from_args

__all__ = ["as_json", "command_line", "opt", "parse_config", "same_config"]

C = TypeVar("C")


def opt(default: Any, help: str, **metadata: Any) -> Any:
    """A config field: default, help text and optional ``choices`` / ``type`` for its flag."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def parse_config(cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str) -> C:
    """``cls`` from command-line arguments; its ``validate()`` (if any) reports errors as argparse errors."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_dataclass_arguments(parser, cls)
    cfg = dataclass_from_args(cls, parser.parse_args(argv))
    check = getattr(cfg, "validate", None)
    if check is not None:
        try:
            check()
        except ValueError as err:
            parser.error(str(err))
    return cfg


def as_json(cfg: Any) -> dict[str, Any]:
    """The config as JSON-ready values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}


def same_config(
    stored: dict[str, Any], now: dict[str, Any], *, defaults: dict[str, Any], ignore: frozenset[str] | set[str]
) -> bool:
    """Whether a stored result's ``config`` is ``now`` for ``--resume``: keys in ``ignore`` (execution settings,
    and for some commands the lists a resume may extend) are not compared, and an option added since the result
    was stored matches when ``now`` keeps its default (``defaults``: the command's default config as JSON)."""
    for key in (set(stored) | set(now)) - set(ignore):
        if key not in stored:
            if now[key] != defaults.get(key):
                return False
        elif stored[key] != now.get(key):
            return False
    return True


def command_line(name: str, argv: Sequence[str] | None) -> str:
    return " ".join(["dp-bench", name, *(shlex.quote(a) for a in (argv or []))])
