"""The server side of a federation, shared by the in-process runner and the Flower strategy.

One round, whichever runner drives it::

    sampled = server.start_round(r)        # seeded sample; each sampled client is charged (σ, q, K) to the ledger
    server.receive(c, state=..., history=..., loss=...)   # a client's update (its history goes to the ledger)
    server.reject(c, reason, history=...)  # a failed / malformed / refused reply (its spend is still recorded)
    record = server.finish_round()         # FedAvg (or keep the global state), evaluate, record

The server owns the global adapter, the partition sizes it assigned (the FedAvg weights — never what a client
reports), the (σ, q) of every partition (computed here with the client's own function), the privacy ledger
and the round records; :meth:`result` is the run's JSON-ready result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .aggregate import AggregationError
from .federation import FederationConfig, aggregate_updates, noise_record, sample_clients
from .ledger import PrivacyLedger

__all__ = ["FederationResult", "FederationServer", "RoundRecord"]

State = dict[str, torch.Tensor]


@dataclass
class RoundRecord:
    """One round: who was asked, what was rejected, and the global model's test metrics afterwards."""

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
    state: State
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


@dataclass
class _Round:
    index: int
    sampled: list[int]
    states: list[State] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)


class FederationServer:
    """Server-side state and round logic (see the module docstring).

    Args:
        cfg: the run.
        global_state: the initial global adapter.
        sizes: examples per partition, as the server computed them (FedAvg weights).
        privacy: ``{partition: (σ, q)}`` as the server computes them.
        evaluator: ``evaluator(state) -> {"accuracy", "loss"}`` after every round (``None``: not evaluated).
        partition_summary: what the result JSON says about the split.
    """

    def __init__(
        self,
        cfg: FederationConfig,
        global_state: Mapping[str, torch.Tensor],
        sizes: Sequence[int],
        privacy: Mapping[int, tuple[float, float]],
        *,
        evaluator: Callable[[Mapping[str, torch.Tensor]], dict[str, float]] | None = None,
        partition_summary: dict[str, Any] | None = None,
    ) -> None:
        if len(sizes) != cfg.num_clients or sorted(privacy) != list(range(cfg.num_clients)):
            raise ValueError("sizes and privacy must cover every partition 0..num_clients-1")
        self.cfg = cfg
        self.global_state: State = dict(global_state)
        self.sizes = [int(n) for n in sizes]
        self.privacy = dict(privacy)
        self.evaluator = evaluator
        self.partition_summary = partition_summary or {"sizes": self.sizes}
        self.ledger = PrivacyLedger(cfg.delta, cfg.accountant)
        for c in range(cfg.num_clients):
            self.ledger.register(c)
        self.initial = self._evaluate()
        self.rounds: list[RoundRecord] = []
        self._round: _Round | None = None

    @classmethod
    def build(cls, cfg: FederationConfig, task: Any = None) -> tuple[FederationServer, Any, Any]:
        """``(server, task, partition)`` for ``cfg``; ``task`` is reused when it was built for the same
        ``cfg.task_key()`` (``ValueError`` otherwise)."""
        from .client import privacy_parameters
        from .federation import build_evaluator, build_partition, build_task

        if task is None:
            task = build_task(cfg)
        elif task.key != cfg.task_key():
            raise ValueError(f"task was built for {task.key}, but this run needs {cfg.task_key()}: build_task(cfg)")
        partition = build_partition(cfg, task)
        evaluator = build_evaluator(cfg, task)
        client_cfg = cfg.client_config()
        privacy = {p: privacy_parameters(client_cfg, n) for p, n in enumerate(partition.sizes)}
        server = cls(
            cfg,
            evaluator.initial_state(),
            partition.sizes,
            privacy,
            evaluator=evaluator,
            partition_summary=partition.summary(),
        )
        return server, task, partition

    def _evaluate(self) -> dict[str, float]:
        if self.evaluator is None:
            return {"accuracy": math.nan, "loss": math.nan}
        return self.evaluator(self.global_state)

    # -- one round ------------------------------------------------------------------------------------
    def start_round(self, round_index: int) -> list[int]:
        """Sample the round's clients and charge each the (σ, q, local steps) it is asked for."""
        if self._round is not None:
            raise RuntimeError(f"round {self._round.index} was started but not finished")
        sampled = sample_clients(self.cfg, round_index)
        for c in sampled:
            sigma, q = self.privacy[c]
            self.ledger.charge(c, sigma, q, self.cfg.local_steps)  # spent once asked, whatever comes back
        self._round = _Round(round_index, sampled)
        return sampled

    def _current(self, client: int | None) -> _Round:
        if self._round is None:
            raise RuntimeError("no round in progress: call start_round first")
        if client is not None and client not in self._round.sampled:
            raise ValueError(f"client {client} was not sampled in round {self._round.index}")
        return self._round

    def receive(self, client: int, *, state: Mapping[str, torch.Tensor], history: Sequence[Sequence[float]],
                loss: float = math.nan) -> None:  # fmt: skip
        """A client's update; its accountant history goes to the ledger first (spent even if rejected later)."""
        rnd = self._current(client)
        if client in rnd.ids:
            raise ValueError(f"client {client} already sent its update for round {rnd.index}")
        self.ledger.record(client, history)
        rnd.states.append(dict(state))
        rnd.ids.append(client)
        rnd.losses.append(float(loss))

    def reject(self, client: int | None, reason: str, *, history: Sequence[Sequence[float]] | None = None) -> None:
        """A failed, malformed or refused reply (``client=None``: not attributable); its history, when known,
        still goes to the ledger."""
        rnd = self._current(None)
        if client is not None and history is not None:
            self.ledger.record(client, history)
        rnd.failures.append({"client": client, "reason": reason})

    def finish_round(self) -> RoundRecord:
        """FedAvg of the valid updates (or keep the global state, with the reason), evaluate, record."""
        rnd = self._current(None)
        error: str | None = None
        try:
            if not rnd.states:
                raise AggregationError("no client returned an update", [])
            sizes = [self.sizes[c] for c in rnd.ids]
            result = aggregate_updates(self.cfg, self.global_state, rnd.states, sizes, rnd.ids)
            self.global_state = result.state
            rejected = result.rejected
        except AggregationError as err:  # keep the previous global state and go on
            error = f"aggregation failed, global state kept: {err}"
            rejected = err.rejected
        metrics = self._evaluate()
        good = [x for x in rnd.losses if not math.isnan(x)]
        record = RoundRecord(
            round=rnd.index,
            clients=list(rnd.sampled),
            accuracy=metrics["accuracy"],
            loss=metrics["loss"],
            train_loss=sum(good) / len(good) if good else math.nan,
            rejected=[{"client": r.client, "reason": r.reason} for r in rejected] + rnd.failures,
            max_epsilon=self.ledger.max_epsilon,
            error=error,
        )
        self.rounds.append(record)
        self._round = None
        return record

    def result(self, runner: str, wall_s: float) -> FederationResult:
        return FederationResult(
            config=self.cfg.to_dict(),
            runner=runner,
            initial=self.initial,
            rounds=list(self.rounds),
            privacy=self.ledger.report(),
            partition=self.partition_summary,
            state=self.global_state,
            wall_s=wall_s,
            noise=noise_record(self.cfg),
        )
