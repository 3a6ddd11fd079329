"""``peft-lalora`` command line.

``peft-lalora federate`` runs DP federated fine-tuning of *your* sequence classifier on *your* data with one of
the four LoRA schemes of the LA-LoRA paper (four ``LALoraConfig.alternation`` modes) and an optional low-pass
filter, in-process (default) or on a real local Flower federation, and writes a JSON result: test accuracy
per round, each client's ε at δ, and the full configuration. Its flags are the fields of
:class:`~peft_lalora.federated.config.FederationConfig` (one flag per field, same name), plus how to run
it. Defaults are the library's except three, which follow what docs/results.md §9 measured best (FFA-LoRA
with SGD at lr 1; AdamW drove the federated training loss up): ``--algo ffa-lora --optimizer sgd --lr 1``.
``--save-adapter DIR`` writes the trained adapter (LALoRA in DIR, plain LoRA in DIR/lora).

Exit status: 0 when at least one round produced a new global adapter; 2 for an invalid flag or input (every number
is checked before training; the message names the flag) or a run that stopped; 1 when the run finished but every
round failed (the result JSON is still written: see ``failed_rounds`` and each round's ``rejected``).

Example::

    peft-lalora federate --model ./my-bert --data reviews.csv --text-column text --label-column label \\
        --num-clients 8 --alpha 0.1 --epsilon 1 --rounds 10 --out results.json --save-adapter adapter/
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CLI_DEFAULTS", "add_dataclass_arguments", "build_parser", "config_from_args", "dataclass_from_args", "main"]

_SECTION9 = "docs/results.md §9"
#: ``federate`` flags whose default is not the library's (``FederationConfig``): value and evidence
CLI_DEFAULTS: dict[str, tuple[Any, str]] = {
    "algo": (
        "ffa-lora",
        f"best scheme on both of {_SECTION9}'s splits (final accuracy 0.730 Dirichlet α=1, 0.734 "
        "by movie); LA-LoRA lost to DP-LoRA and FFA-LoRA by movie",
    ),
    "optimizer": ("sgd", f"{_SECTION9} used SGD; AdamW drove the federated training loss up in pilots (§6)"),
    "lr": (1.0, f"{_SECTION9}'s validation choice for FFA-LoRA and DP-LoRA (SGD grid 0.5, 1, 2, 4)"),
}


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: Sequence[str] = (),
    defaults: Mapping[str, tuple[Any, str]] | None = None,
) -> None:
    """One ``--field-name`` flag per field of the dataclass ``cls``: type and default from the field's default
    (or ``field.metadata["type"]``), help from ``metadata["help"]``, ``metadata["choices"]`` if any; booleans get
    ``--x / --no-x``, lists take one or more values. ``defaults``: ``{field: (value, why)}`` replaces a field's
    default on the command line and says why in its help."""
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help", "")}
        if defaults and f.name in defaults:
            value, why = defaults[f.name]
            kw.update(default=value, help=f"{kw['help']} [CLI default; the library's is {default!r}: {why}]")
            default = value
        if "choices" in f.metadata:
            kw["choices"] = list(f.metadata["choices"])
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(default, (list, tuple)):
            kind = f.metadata.get("type") or (type(default[0]) if default else str)
            parser.add_argument(flag, nargs="*", type=kind, **{**kw, "default": list(default)})
        else:
            parser.add_argument(flag, type=f.metadata.get("type") or type(default), **kw)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` from parsed arguments (fields not in ``args`` keep their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)})


def build_parser() -> argparse.ArgumentParser:
    from .federated.config import FederationConfig

    parser = argparse.ArgumentParser(prog="peft-lalora", description="LA-LoRA tools")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser(
        "federate",
        help="DP federated LoRA fine-tuning (LA-LoRA and baselines)",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_dataclass_arguments(f, FederationConfig, defaults=CLI_DEFAULTS)
    run = f.add_argument_group("how to run it")
    run.add_argument(
        "--runner",
        choices=["simulation", "flower"],
        default="simulation",
        help="simulation: every client in this process; flower: a local Flower federation on 127.0.0.1 (a SuperLink "
        "and one SuperNode per client, TLS and node authentication; docs/deployment.md)",
    )
    run.add_argument(
        "--insecure",
        action="store_true",
        help="flower runner: no TLS and no SuperNode authentication (local testing only; see docs/deployment.md)",
    )
    run.add_argument("--threads", type=int, default=0, help="torch threads per process (0: leave default)")
    run.add_argument("--timeout", type=float, default=3600.0, help="flower runner: seconds before giving up")
    run.add_argument("--out", type=Path, default=Path("results.json"), help="the result JSON (checked before the run)")
    run.add_argument(
        "--save-adapter",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the trained adapter: DIR loads with PeftModel.from_pretrained(base, DIR) after import peft_lalora, "
        "DIR/lora is a plain-PEFT LoRA copy (export_as_lora); identical logits",
    )
    run.add_argument(
        "--keep-workdir",
        action="store_true",
        help="flower runner: keep the private work folder (logs, app, CA and node keys) instead of deleting it",
    )
    run.add_argument(
        "--no-progress", action="store_true", help="simulation runner: no progress bar (rounds and clients) on stderr"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The ``FederationConfig`` of parsed ``federate`` arguments."""
    from .federated.config import FederationConfig

    return dataclass_from_args(FederationConfig, args)


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def check_run_flags(args: argparse.Namespace) -> None:
    """The "how to run it" numbers: ``--threads`` >= 0 (0: leave torch's default), ``--timeout`` finite and > 0."""
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: must be >= 0 (0 leaves torch's default)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout {_shown(args.timeout)}: must be finite and > 0 (seconds)")


def config_or_flag_error(args: argparse.Namespace) -> Any:
    """:func:`config_from_args`, with a :class:`~peft_lalora.federated.config.ConfigError` reworded to name the flag."""
    from .federated.config import ConfigError

    try:
        return config_from_args(args)
    except ConfigError as err:
        raise ValueError(f"--{err.field.replace('_', '-')} {_shown(err.value)}: must be {err.rule}") from None


def check_model_flag(cfg: Any) -> None:
    """``--model`` names a folder (or a hub id): a missing folder is named before anything loads."""
    from .federated.data.inputs import model_folder_problem

    problem = model_folder_problem(cfg.model) if cfg.task == "text" and cfg.model else None
    if problem is not None:
        raise ValueError(f"--model {cfg.model}: {problem}")


def federate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the federation described by ``args`` and write ``args.out``; returns the JSON dict. A partition the
    flags cannot make is a ``ValueError`` naming the flags to change."""
    from .federated.data.partition import PartitionError

    try:
        return _federate(args)
    except PartitionError as err:
        raise ValueError(err.worded(flags=True)) from None


def _federate(args: argparse.Namespace) -> dict[str, Any]:
    from .federated.client.save import check_out_file, check_target_dir
    from .federated.server.rounds import write_json

    check_run_flags(args)
    cfg = config_or_flag_error(args)
    check_model_flag(cfg)
    check_out_file(args.out)  # before training: a bad --out must not cost the run
    if args.save_adapter is not None:
        check_target_dir(args.save_adapter)
    if cfg.reproducible_noise:
        from .federated.client.dp_client import REPRODUCIBLE_NOISE_NOTE

        print(f"peft-lalora federate: warning: --reproducible-noise: {REPRODUCIBLE_NOISE_NOTE}", file=sys.stderr)
    for flag, on in (
        ("--release-nonprivate-stats", cfg.release_nonprivate_stats),
        ("--publish-label-counts", cfg.publish_label_counts),
    ):
        if on:
            print(
                f"peft-lalora federate: warning: {flag}: the result holds noise-free statistics of the clients' "
                "data (NOT differentially private)",
                file=sys.stderr,
            )
    if args.runner == "flower":
        from .federated.launcher.run import run_flower

        out = run_flower(
            cfg,
            threads=args.threads,
            timeout=args.timeout,
            insecure=args.insecure,
            keep_workdir=args.keep_workdir,
            save_adapter=args.save_adapter,
        )
    else:
        out = _simulate(cfg, args)
    write_json(args.out, out)  # atomic: a crash mid-write never leaves half a federation's result
    return out


def _simulate(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The in-process runner (and ``--save-adapter``) for ``federate``."""
    import torch

    from .federated.data.task import build_task
    from .federated.simulation import run_simulation

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    task = build_task(cfg)
    result = run_simulation(cfg, progress=not args.no_progress, task=task)
    out = result.to_json()
    if args.save_adapter is not None:
        from .federated.client.save import save_adapter

        out["adapter"] = save_adapter(cfg, task, result.state, args.save_adapter, out["privacy"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``peft-lalora`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "federate":
        try:
            out = federate(args)
        except (ValueError, RuntimeError, TimeoutError, OSError) as err:
            print(f"peft-lalora federate: error: {err}", file=sys.stderr)
            return 2
        acc = out["accuracy"]
        if out.get("evaluation", "").startswith("none"):
            print(f"peft-lalora federate: warning: evaluation {out['evaluation']}", file=sys.stderr)
        print(
            f"{out['config']['algo']}/{out['config']['filter']}: accuracy {acc[0]:.4f} -> {acc[-1]:.4f} "
            f"after {len(acc) - 1} round(s); max ε = {out['max_epsilon']:.4f} at δ = {out['config']['delta']:g}; "
            f"wrote {args.out}"
        )
        if out.get("adapter"):
            print(f"adapter: {out['adapter']['adapter']} (LALoRA; plain LoRA copy: {out['adapter']['lora']})")
        if out.get("workdir"):
            print(f"work folder kept (holds private keys; delete it when done): {out['workdir']}")
        failed = out.get("failed_rounds") or []
        if failed and len(failed) == len(out.get("rounds", [])):
            print(
                f"peft-lalora federate: error: every round failed ({len(failed)} of {len(failed)}): no client update "
                "was aggregated; see each round's 'rejected' (categories) in the result and the clients' own logs",
                file=sys.stderr,
            )
            return 1
        if failed:
            print(
                f"peft-lalora federate: warning: round(s) {failed} kept the previous global state "
                "(no valid update; see 'error' in the result's rounds)",
                file=sys.stderr,
            )
        return 0
    return 1  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
