"""In-process federated runner: fast, deterministic, with a progress bar.

It drives the same :class:`~peft_lalora.federated.server.rounds.FederationServer` (sampling, privacy charges,
FedAvg, evaluation, records) and the same :class:`~peft_lalora.federated.client.dp_client.DPClient` as the Flower app,
so both runners give the same global adapter for the same configuration (with ``reproducible_noise``; by
default every round's noise is fresh OS entropy). Clients are built once, when first sampled, and keep
their Opacus engine and accountant for the whole run.

What a client hands the server is exactly what a Flower client sends
(:func:`~peft_lalora.federated.server.replies.reply_metrics`: the noisy state and the accountant history; the noise-free
training loss only with ``release_nonprivate_stats``). The runner holds the shared source, so the plan (partition sizes)
is computed from it.

A client that raises is recorded like a Flower error reply — a category (``client_setup_error`` when it could not
be built, ``training_error`` or ``replayed_round`` when it failed in a round) in the round's ``rejected``, its
exception logged on this process's ``peft_lalora.federated`` logger, never in the result — with the steps it took
before failing in the ledger, and the round goes on with the others; a round with no valid update keeps the
global adapter and records why (``error``) — as in the Flower app. This runner holds the client, so it can prove
that a failed client ran no DP step in the round (its accountant did not move): only then is the round's
charge withdrawn (:meth:`~peft_lalora.federated.server.rounds.FederationServer.reject`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .builders import build_client
from .client.dp_client import ReplayedRoundError
from .config import FederationConfig
from .data.task import Task
from .server.replies import history_of, reply_metrics
from .server.rounds import FederationResult, FederationServer, RoundRecord

__all__ = ["FederationResult", "RoundRecord", "run_simulation"]

_LOG = logging.getLogger("peft_lalora.federated.simulation")


def _dp_steps(client: Any) -> int:
    """DP steps in ``client``'s own accountant (0 for a client that was never built)."""
    return 0 if client is None else sum(int(h[2]) for h in client.history)


def _run_client(server: FederationServer, clients: dict[int, Any], make: Callable[[], Any], c: int, rnd: int) -> None:
    """Client ``c``'s round: its update to the server, or its failure as a category (the detail to the log)."""
    cfg = server.cfg
    before, stage = _dp_steps(clients.get(c)), "client_setup_error"
    try:
        if c not in clients:
            clients[c] = make()
        stage = "training_error"
        update = clients[c].fit(server.global_state, rnd)
    except Exception as exc:  # noqa: BLE001 - one client's failure is that client's, as in Flower
        category = "replayed_round" if isinstance(exc, ReplayedRoundError) else stage
        _LOG.warning(
            "round %s: client %s failed (%s); the result records only the category", rnd, c, category, exc_info=exc
        )
        client = clients.get(c)
        server.reject(
            c,
            f"client {c}: {category}",
            category=category,
            history=client.history if client is not None else None,
            no_dp_step=_dp_steps(client) == before,  # proof: its own accountant did not move
        )
        return
    reply = reply_metrics(update, cfg)
    server.receive(c, state=update.state, history=history_of(reply), loss=reply.get("train-loss"))


def run_simulation(
    cfg: FederationConfig,
    *,
    progress: bool = True,
    on_round: Callable[[RoundRecord, Mapping[str, torch.Tensor]], None] | None = None,
    task: Task | None = None,
) -> FederationResult:
    """Run ``cfg.rounds`` rounds of DP federated LA-LoRA in this process.

    Args:
        cfg: the experiment.
        progress: show a tqdm bar (accuracy and max ε in the postfix).
        on_round: called after every round with its record and the new global state.
        task: a task already built by :func:`~peft_lalora.federated.data.task.build_task` for a config with the same
            :meth:`~FederationConfig.task_key` (reused across runs, e.g. a grid that differs only in the
            algorithm). Read-only here.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    server, task, partition = FederationServer.build(cfg, task)
    clients: dict[int, Any] = {}
    bar = tqdm(range(1, cfg.rounds + 1), desc=f"{cfg.algo}/{cfg.filter}", disable=not progress, unit="round")
    for rnd in bar:
        for c in server.start_round(rnd):
            _run_client(server, clients, lambda c=c: build_client(cfg, task, partition, c), c, rnd)
        rec = server.finish_round()
        if rec.error is not None and progress:
            bar.write(f"round {rnd}: {rec.error}")
        bar.set_postfix(acc=f"{rec.accuracy:.3f}", eps=f"{rec.max_epsilon:.2f}")
        if on_round is not None:
            on_round(rec, server.global_state)
    return server.result("simulation", time.perf_counter() - t0)
