"""In-process federated runner: fast, deterministic, with a progress bar.

It uses exactly the client (:class:`~peft_lalora.federated.client.DPClient`), sampling
(:func:`~peft_lalora.federated.federation.sample_clients`) and aggregation
(:func:`~peft_lalora.federated.federation.aggregate_updates`) of the Flower app, so both runners give the
same global adapter for the same configuration (with ``reproducible_noise``; by default every round's
noise is fresh OS entropy). Clients are built once, when first sampled, and keep their Opacus engine and
accountant for the whole run.

A round whose updates are all rejected (fewer than ``min_clients`` valid) does not end the run: the
global adapter stays as it was, the round's record carries ``error`` and the rejection reasons, and the
next round starts — as in the Flower app. A client that raises is recorded like a Flower error reply (its
reason in ``rejected``) and the round goes on with the others. Privacy is booked before any aggregation:
the server charges every sampled client for the steps it asked for, and takes each client's accountant
history, also from a client that failed half-way (see :mod:`.ledger`). FedAvg weights are the partition sizes
the server assigned, not what a client reports.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .aggregate import AggregationError
from .federation import (
    FederationConfig,
    Task,
    aggregate_updates,
    build_client,
    build_evaluator,
    build_partition,
    build_task,
    noise_record,
    sample_clients,
)
from .ledger import PrivacyLedger

__all__ = ["FederationResult", "RoundRecord", "run_simulation"]


@dataclass
class RoundRecord:
    """One round: who trained, what was rejected, and the global model's test metrics afterwards."""

    round: int
    clients: list[int]
    accuracy: float
    loss: float
    train_loss: float
    rejected: list[dict[str, Any]] = field(default_factory=list)
    max_epsilon: float = 0.0
    #: why the round produced no new global state (kept the previous one); ``None`` if it aggregated
    error: str | None = None


@dataclass
class FederationResult:
    """Everything a run produced; :meth:`to_json` is the CLI's result file."""

    config: dict[str, Any]
    runner: str
    initial: dict[str, float]
    rounds: list[RoundRecord]
    privacy: dict[str, Any]
    partition: dict[str, Any]
    state: dict[str, torch.Tensor]
    wall_s: float = 0.0
    noise: dict[str, Any] = field(default_factory=dict)  #: :func:`~.federation.noise_record`

    @property
    def accuracy(self) -> list[float]:
        """Test accuracy before training (index 0) and after every round."""
        return [self.initial["accuracy"], *(r.accuracy for r in self.rounds)]

    def to_json(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "config": self.config,
            "accuracy": self.accuracy,
            "rounds": [asdict(r) for r in self.rounds],
            "epsilon": {k: v["epsilon"] for k, v in self.privacy["clients"].items()},
            "max_epsilon": self.privacy["max_epsilon"],
            "privacy": self.privacy,
            "partition": self.partition,
            "noise": self.noise,
            "failed_rounds": [r.round for r in self.rounds if r.error is not None],
            "wall_s": self.wall_s,
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2, allow_nan=True))
        return p


def _mean(xs: list[float]) -> float:
    good = [x for x in xs if not math.isnan(x)]
    return sum(good) / len(good) if good else math.nan


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
        task: a task already built by :func:`build_task` for a config with the same
            :meth:`~FederationConfig.task_key` (reused across runs, e.g. a grid that differs only in the
            algorithm: the data, tokenization and frozen-layer cache are computed once). Read-only here.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    if task is None:
        task = build_task(cfg, progress=progress)
    elif task.config.task_key() != cfg.task_key():
        raise ValueError(
            f"task was built for {task.config.task_key()}, but this run needs {cfg.task_key()}: build it with "
            "build_task(cfg)"
        )
    partition = build_partition(cfg, task)
    evaluator = build_evaluator(cfg, task)
    global_state = evaluator.initial_state()
    initial = evaluator(global_state)
    ledger = PrivacyLedger(cfg.delta, cfg.accountant)
    for c in range(cfg.num_clients):
        ledger.register(c)
    clients: dict[int, Any] = {}
    records: list[RoundRecord] = []
    bar = tqdm(range(1, cfg.rounds + 1), desc=f"{cfg.algo}/{cfg.filter}", disable=not progress, unit="round")
    sizes = partition.sizes
    for rnd in bar:
        sampled = sample_clients(cfg, rnd)
        updates, failures = [], []
        for c in sampled:
            try:
                if c not in clients:
                    clients[c] = build_client(cfg, task, partition, c)
                client = clients[c]
                ledger.charge(c, client.noise_multiplier, client.sample_rate, cfg.local_steps)
                updates.append(client.fit(global_state, rnd))
            except Exception as exc:  # noqa: BLE001 - one client's failure is that client's, as in Flower
                failures.append({"client": c, "reason": f"client raised {type(exc).__name__}: {exc}"})
                if c in clients:
                    ledger.record(c, clients[c].history)  # the steps it did take before failing
                continue
            ledger.record(c, updates[-1].history)
        error: str | None = None
        try:
            if not updates:
                raise AggregationError("no client returned an update", [])
            result = aggregate_updates(
                cfg,
                global_state,
                [u.state for u in updates],
                [sizes[u.client] for u in updates],
                [u.client for u in updates],
            )
            global_state = result.state
            rejected = result.rejected
        except AggregationError as err:  # keep the previous global state and go on
            error = f"aggregation failed, global state kept: {err}"
            rejected = err.rejected
            if progress:
                bar.write(f"round {rnd}: {error}")
        metrics = evaluator(global_state)
        rec = RoundRecord(
            round=rnd,
            clients=sampled,
            accuracy=metrics["accuracy"],
            loss=metrics["loss"],
            train_loss=_mean([u.loss for u in updates]),
            rejected=[{"client": r.client, "reason": r.reason} for r in rejected] + failures,
            max_epsilon=ledger.max_epsilon,
            error=error,
        )
        records.append(rec)
        bar.set_postfix(acc=f"{rec.accuracy:.3f}", eps=f"{rec.max_epsilon:.2f}")
        if on_round is not None:
            on_round(rec, global_state)
    return FederationResult(
        config=cfg.to_dict(),
        runner="simulation",
        initial=initial,
        rounds=records,
        privacy=ledger.report(),
        partition=partition.summary(),
        state=global_state,
        wall_s=time.perf_counter() - t0,
        noise=noise_record(cfg),
    )
