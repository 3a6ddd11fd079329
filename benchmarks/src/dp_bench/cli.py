"""``dp-bench <command> [flags]``: the benchmark commands (``dp-bench <command> --help`` lists the flags)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any

#: command -> module (each has ``main(argv)``)
COMMANDS = {
    "demo": "dp_bench.commands.demo",
    "centralized": "dp_bench.commands.centralized",
    "regime-map": "dp_bench.commands.regime_map",
    "regime-map-llm": "dp_bench.commands.regime_map_llm",
    "federated": "dp_bench.commands.federated",
    "overhead": "dp_bench.commands.overhead",
    "overhead-llm": "dp_bench.commands.overhead_llm",
    "noise-std": "dp_bench.commands.noise_std",
    "isolation-cost": "dp_bench.commands.isolation_cost",
    "batch-check-cost": "dp_bench.commands.batch_check_cost",
    "fingerprint-cost": "dp_bench.commands.fingerprint_cost",
    "mechanism-cost": "dp_bench.commands.mechanism_cost",
    "mechanism-setup": "dp_bench.commands.mechanism_setup",
    "mf-proxy": "dp_bench.commands.mf_proxy",
    "audit": "dp_bench.commands.audit",
    "grid": "dp_bench.commands.grid",
}


def run(argv: Sequence[str]) -> Any:
    """Run ``argv[0]`` with the flags ``argv[1:]``; returns what the command returns (its result)."""
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: dp-bench {{{','.join(COMMANDS)}}} [flags]   (dp-bench <command> --help)")
    return import_module(COMMANDS[argv[0]]).main(list(argv[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dp-bench`` console script."""
    run(list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
