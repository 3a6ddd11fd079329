"""The Flower ``ServerApp`` of a federation (``peft_lalora.federated.flower.server_app:app``): it waits for the
SuperNodes, assigns them partitions and runs :class:`~peft_lalora.federated.flower.strategy.LALoraStrategy` for the
configured rounds; the run is described by a :class:`~peft_lalora.federated.config.FederationConfig` passed as Flower
``run_config``, which carries the operator's plan (``partition-sizes``, :mod:`~peft_lalora.federated.server.plan`).

What the server holds: the plan, the base model and, for evaluation, only the operator's own evaluation data
(``test_data`` or a factory's separate test set) — it builds the task with ``server=True`` and never loads a
training row. Centralized evaluation on that data (when there is any) after every round.
"""

from __future__ import annotations

import json
import os
import time
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from .app_config import RESULT_PATH_KEY, STATE_PATH_KEY, federation_config, set_threads
from .app_config import log as _log
from .strategy import LALoraStrategy, assign_partitions

__all__ = ["app", "wait_for_nodes"]


def wait_for_nodes(grid: Grid, num_nodes: int, timeout: float = 120.0) -> list[int]:
    """Block until at least ``num_nodes`` SuperNodes are connected; return their ids."""
    t0 = time.monotonic()
    while len(nodes := list(grid.get_node_ids())) < num_nodes:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} of {num_nodes} SuperNodes connected after {timeout:.0f}s")
        time.sleep(0.2)
    return sorted(nodes)


app = ServerApp()


@app.main()
def _server_main(grid: Grid, context: Context) -> None:
    """Run the federation described by ``context.run_config``; write the result JSON / final adapter
    to ``result-path`` / ``state-path`` when given."""
    import torch

    from ..builders import build_task, noise_record
    from ..server.plan import FederationPlan
    from ..server.rounds import FederationServer

    t0 = time.perf_counter()
    set_threads(context)
    cfg = federation_config(context)
    if cfg.reproducible_noise:
        _log(WARNING, "reproducible-noise is on: %s", noise_record(cfg)["note"])
    nodes = wait_for_nodes(grid, cfg.num_clients)
    node_of = assign_partitions(nodes, cfg.num_clients, cfg.planned_nodes())
    _log(INFO, "partition assignment {partition: node}: %s", node_of)
    # the operator's plan and the model only: the server never loads a training row (.plan)
    server = FederationServer.from_plan(cfg, build_task(cfg, server=True), FederationPlan.from_config(cfg))
    strategy = LALoraStrategy(server, node_of)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        m = (
            server.initial
            if server_round == 0
            else {"accuracy": server.rounds[-1].accuracy, "loss": server.rounds[-1].loss}
        )
        return MetricRecord({"accuracy": m["accuracy"], "loss": m["loss"]})

    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(server.global_state), num_rounds=cfg.rounds, evaluate_fn=evaluate_fn
    )
    result = server.result("flower", time.perf_counter() - t0)
    out = str(context.run_config.get(RESULT_PATH_KEY, "") or "")
    if out:
        result.save(out)
        os.chmod(out, 0o600)  # the run's folder is private (.workdir); so are its files
    state_out = str(context.run_config.get(STATE_PATH_KEY, "") or "")
    if state_out:
        Path(state_out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(result.state, state_out)
        os.chmod(state_out, 0o600)
    _log(
        INFO,
        "LA-LoRA federation done: %s",
        json.dumps({"accuracy": result.accuracy, "max_epsilon": server.ledger.max_epsilon}),
    )
