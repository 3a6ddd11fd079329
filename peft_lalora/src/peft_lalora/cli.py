"""``peft-lalora`` command line.

``peft-lalora federate`` runs DP federated fine-tuning with one of the four LoRA schemes of the LA-LoRA
paper (which are four ``LALoraConfig.alternation`` modes) and an optional low-pass filter, in-process
(default) or on a real local Flower federation, and writes a JSON result: test accuracy per round,
each client's ε at δ, and the full configuration.

Example::

    peft-lalora federate --algo la-lora --filter binomial5 --clients 8 --alpha 0.1 --epsilon 1 \\
        --rounds 10 --local-steps 5 --seed 0 --model tiny --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "config_from_args", "main"]


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .federated.federation import ALGORITHMS, FILTERS, PARTITIONS, TASKS

    parser = argparse.ArgumentParser(prog="peft-lalora", description="LA-LoRA tools")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser(
        "federate",
        help="DP federated LoRA fine-tuning (LA-LoRA and baselines)",
        description="DP federated LoRA fine-tuning; algorithms: "
        + ", ".join(f"{k} (alternation={v!r})" for k, v in ALGORITHMS.items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    f.add_argument("--algo", choices=sorted(ALGORITHMS), default="la-lora")
    f.add_argument("--filter", choices=sorted(FILTERS), default="none", help="post-noise low-pass filter")
    f.add_argument(
        "--model",
        choices=list(TASKS),
        default="tiny",
        help="tiny: random tiny BERT on generated data; minilm-rt: all-MiniLM-L6-v2 on Rotten Tomatoes (packaged)",
    )
    f.add_argument("--clients", type=_positive_int, default=8)
    f.add_argument("--partition", choices=list(PARTITIONS), default="dirichlet", help="group: by movie (minilm-rt)")
    f.add_argument("--alpha", type=float, default=0.1, help="Dirichlet label-skew concentration")
    f.add_argument("--epsilon", type=float, default=1.0, help="target ε per client (<= 0: use --noise-multiplier)")
    f.add_argument("--noise-multiplier", type=float, default=1.0)
    f.add_argument("--delta", type=float, default=1e-5)
    f.add_argument("--rounds", type=_positive_int, default=3)
    f.add_argument("--local-steps", type=_positive_int, default=5)
    f.add_argument("--fraction", type=float, default=1.0, help="fraction of clients per round")
    f.add_argument("--batch-size", type=_positive_int, default=16, help="expected Poisson batch size")
    f.add_argument("--lr", type=float, default=5e-3)
    f.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    f.add_argument("--max-grad-norm", type=float, default=1.0)
    f.add_argument("--server-lr", type=float, default=1.0)
    f.add_argument(
        "--max-update-norm",
        type=float,
        default=0.0,
        help="server-side bound on each client's update norm ||state - global|| (0: no bound)",
    )
    f.add_argument("--update-norm-policy", choices=["clip", "reject"], default="clip")
    f.add_argument(
        "--aggregation",
        choices=["mean", "trimmed_mean"],
        default="mean",
        help="weighted FedAvg, or Flower's coordinate-wise trimmed mean (robust to outlier clients)",
    )
    f.add_argument("--trim-fraction", type=float, default=0.1, help="trimmed_mean: share cut at each end")
    f.add_argument("--rank", type=_positive_int, default=4)
    f.add_argument("--lora-alpha", type=int, default=8)
    f.add_argument("--first-factor", choices=["B", "A"], default="B")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument(
        "--reproducible-noise",
        action="store_true",
        help="seed DP noise and Poisson sampling from (seed, client, round) instead of OS entropy — for "
        "experiments only: NOT private against whoever knows the seed",
    )
    f.add_argument("--n-train", type=int, default=512, help="training examples (minilm-rt: subsample, 0 = all)")
    f.add_argument("--n-test", type=int, default=256, help="test examples (minilm-rt: subsample, 0 = all)")
    f.add_argument("--seq-len", type=int, default=0, help="tokens per example (0: tiny 16, minilm-rt 64)")
    f.add_argument(
        "--frozen-layers",
        type=int,
        default=0,
        help="bottom encoder layers frozen without adapter and computed once per example (exact speed-up; "
        "LoRA goes on the layers above)",
    )
    f.add_argument(
        "--pooling",
        choices=["cls", "mean"],
        default="cls",
        help="sentence representation for the head: the model's [CLS] pooler, or the masked mean of the last "
        "hidden states (needs --frozen-layers >= 1)",
    )
    f.add_argument("--runner", choices=["simulation", "flower"], default="simulation")
    f.add_argument(
        "--insecure",
        action="store_true",
        help="flower runner: no TLS and no SuperNode authentication (local testing only; see docs/deployment.md)",
    )
    f.add_argument("--threads", type=int, default=0, help="torch threads per process (0: leave default)")
    f.add_argument("--timeout", type=float, default=3600.0, help="flower runner: seconds before giving up")
    f.add_argument("--out", type=Path, default=Path("results.json"))
    f.add_argument("--no-progress", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The ``FederationConfig`` of parsed ``federate`` arguments (also used by benchmarks/federated.py)."""
    from .federated.federation import FederationConfig

    return FederationConfig(
        task=args.model,
        algo=args.algo,
        filter=args.filter,
        first_factor=args.first_factor,
        num_clients=args.clients,
        partition=args.partition,
        alpha=args.alpha,
        rounds=args.rounds,
        local_steps=args.local_steps,
        fraction=args.fraction,
        server_lr=args.server_lr,
        max_update_norm=args.max_update_norm,
        update_norm_policy=args.update_norm_policy,
        aggregation=args.aggregation,
        trim_fraction=args.trim_fraction,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        max_grad_norm=args.max_grad_norm,
        epsilon=args.epsilon,
        noise_multiplier=args.noise_multiplier,
        delta=args.delta,
        rank=args.rank,
        lora_alpha=args.lora_alpha,
        seed=args.seed,
        reproducible_noise=args.reproducible_noise,
        n_train=args.n_train,
        n_test=args.n_test,
        seq_len=args.seq_len,
        frozen_layers=args.frozen_layers,
        pooling=args.pooling,
    )


def federate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the federation described by ``args`` and write ``args.out``; returns the JSON dict."""
    cfg = config_from_args(args)
    if cfg.reproducible_noise:
        from .federated.client import REPRODUCIBLE_NOISE_NOTE

        print(f"peft-lalora federate: warning: --reproducible-noise: {REPRODUCIBLE_NOISE_NOTE}", file=sys.stderr)
    if args.runner == "flower":
        from .federated.launcher import run_flower

        out = run_flower(cfg, threads=args.threads, timeout=args.timeout, insecure=args.insecure)
    else:
        import torch

        from .federated.simulation import run_simulation

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        out = run_simulation(cfg, progress=not args.no_progress).to_json()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``peft-lalora`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "federate":
        try:
            out = federate(args)
        except (ValueError, RuntimeError, TimeoutError) as err:
            print(f"peft-lalora federate: error: {err}", file=sys.stderr)
            return 2
        acc = out["accuracy"]
        print(
            f"{out['config']['algo']}/{out['config']['filter']}: accuracy {acc[0]:.4f} -> {acc[-1]:.4f} "
            f"after {len(acc) - 1} round(s); max ε = {out['max_epsilon']:.4f} at δ = {out['config']['delta']:g}; "
            f"wrote {args.out}"
        )
        if out.get("failed_rounds"):
            print(
                f"peft-lalora federate: warning: round(s) {out['failed_rounds']} kept the previous global state "
                "(no valid update; see 'error' in the result's rounds)",
                file=sys.stderr,
            )
        return 0
    return 1  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
