"""Every command's configuration is one dataclass: its CLI flags, defaults and help are generated from it
(:func:`peft_lalora.cli.add_dataclass_arguments`), and the result JSON stores it as ``config``. What every command
does with it before it measures anything is written once here: :func:`parse_config` (``dp-bench <name> --help``)
and :func:`start` (warnings, threads, and the result's header: command line, config, versions, machine).

A setting that only one bed reads says so (``opt(..., only={"model": ("minilm",)})``): the config records it as
``None`` for the other beds (:func:`as_json`), and :func:`recorded_config` corrects a stored record the same way
(before, a SmolLM2 grid recorded the MiniLM-only ``trainable: lora:qv:8, top_layers: 1`` at their defaults for a
bed that trains LoRA r = 32 on every layer's ``q_proj`` / ``v_proj``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from peft_lalora.cli import add_dataclass_arguments, dataclass_from_args

__all__ = [
    "as_json",
    "command_line",
    "opt",
    "parse_config",
    "recorded_config",
    "same_config",
    "start",
]

C = TypeVar("C")


def opt(default: Any, help: str, *, only: Mapping[str, Sequence[Any]] | None = None, **metadata: Any) -> Any:
    """A config field: default, help text and optional ``choices`` / ``type`` for its flag; ``only``: the
    settings under which the field is read at all (``{"model": ("minilm",)}``), else it is recorded as ``None``."""
    if only is not None:
        metadata["only"] = {k: tuple(v) for k, v in only.items()}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def parse_config(cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str) -> C:
    """``cls`` from command-line arguments; its ``validate()`` (if any) reports errors as argparse errors.
    ``prog``: ``dp-bench <command>``; ``description``: its module docstring (the first line is used)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
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


def _unused(only: Mapping[str, Sequence[Any]] | None, values: Mapping[str, Any]) -> bool:
    return only is not None and any(values.get(k) not in allowed for k, allowed in only.items())


def as_json(cfg: Any) -> dict[str, Any]:
    """The config as JSON-ready values (paths as strings); a setting the run does not read (``only``) is None."""
    values = dataclasses.asdict(cfg)
    return {
        f.name: None
        if _unused(f.metadata.get("only"), values)
        else (str(values[f.name]) if isinstance(values[f.name], Path) else values[f.name])
        for f in dataclasses.fields(cfg)
    }


def recorded_config(stored: dict[str, Any], cls: type) -> dict[str, Any]:
    """A stored ``config`` as :func:`as_json` records it now: the settings its run did not read set to None."""
    fixed = dict(stored)
    for f in dataclasses.fields(cls):
        if f.name in fixed and _unused(f.metadata.get("only"), stored):
            fixed[f.name] = None
    return fixed


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


def start(name: str, cfg: Any, argv: Sequence[str] | None, *, threads: int | None = None) -> dict[str, Any]:
    """What every command does first: upstream warnings that apply to no benchmark silenced, torch's threads set
    (``threads``, else ``cfg.threads`` when the config has it; 0: torch's choice), and the result's header:
    ``command`` (the command line), ``config`` (:func:`as_json`), ``versions``, ``machine``."""
    import torch

    from .meta import machine, quiet_warnings, versions

    quiet_warnings()
    n = threads if threads is not None else getattr(cfg, "threads", 0)
    if n:
        torch.set_num_threads(n)
    return {"command": command_line(name, argv), "config": as_json(cfg), "versions": versions(), "machine": machine()}
