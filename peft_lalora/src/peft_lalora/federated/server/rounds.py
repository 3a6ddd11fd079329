"""The server side of a federation, shared by the in-process runner and the Flower strategy.

One round, whichever runner drives it::

    sampled = server.start_round(r)        # seeded sample; each sampled client is charged (σ, q, K) to the ledger
    server.receive(c, state=..., history=...)   # a client's update (its history goes to the ledger, bounded)
    server.reject(c, reason, category=...)  # a failed / malformed / refused reply (its spend is still recorded)
    record = server.finish_round()         # bound, FedAvg (or keep the global state), evaluate, record

The server owns the global adapter, the partition sizes of the operator's plan (the FedAvg weights — never
what a client reports; :mod:`~peft_lalora.federated.server.plan`), the (σ, q) of every partition (computed here with the
client's own function), the privacy ledger and the round records; :meth:`result` is the run's JSON-ready result. It
holds no client data: :meth:`FederationServer.from_plan` needs the plan, the task's model and, for evaluation, only
the operator's own evaluation data. A reply's accountant history is bounded (steps <= what was charged,
σ > 0, finite) before it reaches the ledger; a reply that claims more is refused with its reason. Every
update is bounded in norm before averaging — by default to the longest update an honest client of the run can
send (:mod:`~peft_lalora.federated.server.update_bound`); a server without any bound warns.

Every rejected reply is recorded as ``{client, node, category, reason}``: the category is one of
:data:`~peft_lalora.federated.server.replies.CLIENT_FAILURES` (what a failed node reports), ``client_error`` (any other
error reply) or one of :data:`SERVER_REJECTIONS`; the reason is the server's own text, never a client's error message. A
round's charge is withdrawn only with proof that the client ran no DP step (``reject(..., no_dp_step=True)``, which only
the in-process runner can give; :meth:`~peft_lalora.federated.server.ledger.PrivacyLedger.withdraw`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..builders import aggregate_updates, noise_record, sample_clients
from ..config import FederationConfig
from .aggregate import AggregationError
from .ledger import InadmissibleReport, PrivacyLedger, check_delta
from .plan import FederationPlan, partition_summary
from .update_bound import server_update_bound

__all__ = ["FederationResult", "FederationServer", "RoundRecord", "SERVER_REJECTIONS"]

State = dict[str, torch.Tensor]
#: why the server itself refused a reply (categories of a round record's ``rejected``)
SERVER_REJECTIONS = (
    "unattributable_reply",  # from a node not sent this round's message, or a second reply
    "inconsistent_reply",  # claims another partition than the one assigned
    "malformed_reply",  # a field or an array that does not parse (replies.state_from_arrays)
    "accountant_report_refused",  # a history beyond what was charged (ledger.report_problem)
    "invalid_update",  # refused by the aggregation (NaN/Inf, shapes, the update-norm bound)
)


@dataclass
class RoundRecord:
    """One round: who was asked, what was rejected, and the global model's test metrics afterwards."""

    round: int
    clients: list[int]
    accuracy: float
    loss: float
    rejected: list[dict[str, Any]] = field(default_factory=list)
    max_epsilon: float = 0.0
    #: why the round produced no new global state (kept the previous one); ``None`` if it aggregated
    error: str | None = None
    #: mean noise-free training loss of the clients: only with ``release_nonprivate_stats`` (NOT private)
    train_loss: float | None = None
    #: the bound on ``‖update‖₂`` applied this round (``None``: none) and the clients clipped to it
    update_bound: float | None = None
    clipped: list[int] = field(default_factory=list)


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
    noise: dict[str, Any] = field(default_factory=dict)  #: :func:`~peft_lalora.federated.builders.noise_record`
    evaluation: str = ""  #: which data the server evaluated on (or why it did not)

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
            "evaluation": self.evaluation,
            "failed_rounds": [r.round for r in self.rounds if r.error is not None],
            "wall_s": self.wall_s,
        }

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_json())


def write_json(path: str | Path, obj: Any) -> Path:
    """``obj`` as JSON (indent 2, NaN allowed) at ``path``, atomically: a temporary file in the same folder renamed
    over it, so a crash mid-write leaves the previous file (or none), never half a result."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=True))
    os.replace(tmp, p)
    return p


@dataclass
class _Round:
    index: int
    sampled: list[int]
    states: list[State] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    withdrawn: set[int] = field(default_factory=set)


class FederationServer:
    """Server-side state and round logic (see the module docstring).

    Args:
        cfg: the run.
        global_state: the initial global adapter.
        sizes: examples per partition, as the server computed them (FedAvg weights).
        privacy: ``{partition: (noise multiplier, q)}`` as the server computes them.
        evaluator: ``evaluator(state) -> {"accuracy", "loss"}`` after every round (``None``: not evaluated).
        partition_summary: what the result JSON says about the split.
        evaluation: what the result says about the evaluation data.
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
        evaluation: str = "",
    ) -> None:
        if len(sizes) != cfg.num_clients or sorted(privacy) != list(range(cfg.num_clients)):
            raise ValueError("sizes and privacy must cover every partition 0..num_clients-1")
        check_delta(cfg.delta, sizes)
        self.cfg = cfg
        self.global_state: State = dict(global_state)
        self.sizes = [int(n) for n in sizes]
        self.privacy = dict(privacy)
        self.evaluator = evaluator
        self.partition_summary = partition_summary or {"sizes": self.sizes}
        self.evaluation = evaluation or ("none" if evaluator is None else "the server's evaluator")
        if server_update_bound(cfg, self.global_state, self.sizes, self.privacy) is None and cfg.aggregation == "mean":
            warnings.warn(
                "no server-side update bound (max_update_norm=0, auto_update_norm=False, aggregation='mean'): one "
                "client can move the global adapter arbitrarily far; set max_update_norm or auto_update_norm",
                RuntimeWarning,
                stacklevel=2,
            )
        self.ledger = PrivacyLedger(cfg.delta, cfg.accountant)
        for c in range(cfg.num_clients):
            self.ledger.register(c)
        self.initial = self._evaluate()
        self.rounds: list[RoundRecord] = []
        self._round: _Round | None = None

    @classmethod
    def build(cls, cfg: FederationConfig, task: Any = None) -> tuple[FederationServer, Any, Any]:
        """``(server, task, partition)`` for the in-process runner, which holds the shared source: the plan is
        computed from its partition. ``task`` is reused when built for the same ``cfg.task_key()``."""
        from ..builders import build_partition, build_task

        if task is None:
            task = build_task(cfg)
        elif task.key != cfg.task_key():
            raise ValueError(f"task was built for {task.key}, but this run needs {cfg.task_key()}: build_task(cfg)")
        partition = build_partition(cfg, task)
        plan = FederationPlan.from_partition(partition)
        if cfg.planned_sizes() not in (None, list(plan.sizes)):
            raise ValueError(f"partition_sizes={cfg.partition_sizes!r} but the data splits into {list(plan.sizes)}")
        return cls.from_plan(cfg, task, plan, partition=partition, evaluate_held_out=True), task, partition

    @classmethod
    def from_plan(
        cls,
        cfg: FederationConfig,
        task: Any,
        plan: FederationPlan,
        *,
        partition: Any = None,
        evaluate_held_out: bool = False,
    ) -> FederationServer:
        """A server from the operator's ``plan`` and ``task``'s model — it never reads ``task.train``. It
        evaluates on ``task.test`` when that is the operator's own data; a test split carved from the clients'
        source (``task.test_from_train``) only with ``evaluate_held_out`` (the in-process runner, which holds
        that source anyway)."""
        from ..builders import build_evaluator, client_config, make_peft_model
        from ..client.adapter_state import adapter_state, trainable_parameters
        from ..client.dp_client import privacy_parameters

        if len(plan.sizes) != cfg.num_clients:
            raise ValueError(f"the plan has {len(plan.sizes)} partitions but the run has {cfg.num_clients}")
        check_delta(cfg.delta, plan.sizes)
        client_cfg = client_config(cfg)
        privacy = {p: privacy_parameters(client_cfg, n) for p, n in enumerate(plan.sizes)}
        if (evaluate_held_out or not task.test_from_train) and task.test is not None:  # never load a carved split
            evaluator = build_evaluator(cfg, task)
            initial = evaluator.initial_state()
            whose = "held out from the shared source" if task.test_from_train else "the operator's evaluation data"
            evaluation = f"{task.name}: {whose} ({len(task.test)} examples)"
        else:
            evaluator, initial = None, adapter_state(trainable_parameters(make_peft_model(cfg, task)))
            evaluation = "none: no evaluation data of the operator's own (test_data); accuracy is not measured"
        summary = partition_summary(cfg, plan, partition)
        return cls(
            cfg,
            initial,
            list(plan.sizes),
            privacy,
            evaluator=evaluator,
            partition_summary=summary,
            evaluation=evaluation,
        )

    def _evaluate(self) -> dict[str, float]:
        if self.evaluator is None:
            return {"accuracy": math.nan, "loss": math.nan}
        return self.evaluator(self.global_state)

    # -- one round ------------------------------------------------------------------------------------
    def start_round(self, server_round: int) -> list[int]:
        """Sample the clients of ``server_round`` (1-based, as Flower's) and charge each the (noise multiplier, q,
        local steps) it is asked for."""
        if self._round is not None:
            raise RuntimeError(f"round {self._round.index} was started but not finished")
        sampled = sample_clients(self.cfg, server_round)
        for c in sampled:
            noise_multiplier, q = self.privacy[c]
            self.ledger.charge(c, noise_multiplier, q, self.cfg.local_steps)  # spent once asked, whatever comes back
        self._round = _Round(server_round, sampled)
        return sampled

    def _current(self, client: int | None) -> _Round:
        if self._round is None:
            raise RuntimeError("no round in progress: call start_round first")
        if client is not None and client not in self._round.sampled:
            raise ValueError(f"client {client} was not sampled in round {self._round.index}")
        return self._round

    def _record(self, client: int, history: Sequence[Sequence[float]]) -> str | None:
        """Book a reply's history, bounded by what was charged; the reason when it is refused."""
        try:
            self.ledger.record(client, history, max_steps=self.ledger.clients[client].charged_steps)
        except InadmissibleReport as err:
            return f"accountant report refused: {err}"
        return None

    def receive(
        self,
        client: int,
        *,
        state: Mapping[str, torch.Tensor],
        history: Sequence[Sequence[float]],
        loss: float | None = None,
        node: int | None = None,
    ) -> None:
        """A client's update; its accountant history goes to the ledger first (spent even if rejected later).
        A history out of bounds rejects the whole reply; ``loss`` is kept only with ``release_nonprivate_stats``."""
        rnd = self._current(client)
        if client in rnd.ids:
            raise ValueError(f"client {client} already sent its update for round {rnd.index}")
        problem = self._record(client, history)
        if problem is not None:
            rnd.failures.append(_failure(client, node, "accountant_report_refused", problem))
            return
        rnd.states.append(dict(state))
        rnd.ids.append(client)
        if loss is not None and self.cfg.release_nonprivate_stats:
            rnd.losses.append(float(loss))

    def reject(
        self,
        client: int | None,
        reason: str,
        *,
        category: str,
        history: Sequence[Sequence[float]] | None = None,
        node: int | None = None,
        no_dp_step: bool = False,
    ) -> None:
        """A failed, malformed or refused reply (``client=None``: not attributable), recorded as its ``category``
        and the server's own ``reason`` (never a client's text); its history, when known, still goes to the ledger.
        ``no_dp_step=True`` — only with proof that the client ran no DP step this round (the in-process runner
        saw its accountant) — withdraws the round's charge."""
        rnd = self._current(None)
        if client is not None and history is not None:
            problem = self._record(client, history)
            reason = reason if problem is None else f"{reason}; {problem}"
        if no_dp_step and client is not None and client not in rnd.withdrawn:
            rnd.withdrawn.add(client)
            self.ledger.withdraw(client, *self.privacy[client], self.cfg.local_steps)
        rnd.failures.append(_failure(client, node, category, reason))

    def finish_round(self) -> RoundRecord:
        """FedAvg of the valid updates (or keep the global state, with the reason), evaluate, record."""
        rnd = self._current(None)
        error: str | None = None
        clipped: list[int] = []
        bound = server_update_bound(self.cfg, self.global_state, self.sizes, self.privacy)
        try:
            if not rnd.states:
                raise AggregationError("no client returned an update", [])
            sizes = [self.sizes[c] for c in rnd.ids]
            result = aggregate_updates(self.cfg, self.global_state, rnd.states, sizes, rnd.ids, update_bound=bound)
            self.global_state = result.state
            rejected, clipped = result.rejected, list(result.clipped)
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
            train_loss=(sum(good) / len(good) if good else math.nan) if self.cfg.release_nonprivate_stats else None,
            rejected=[_failure(r.client, None, "invalid_update", r.reason) for r in rejected] + rnd.failures,
            max_epsilon=self.ledger.max_epsilon,
            error=error,
            update_bound=bound,
            clipped=clipped,
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
            evaluation=self.evaluation,
        )


def _failure(client: int | None, node: int | None, category: str, reason: str) -> dict[str, Any]:
    """One entry of a round record's ``rejected``."""
    return {"client": client, "node": node, "category": category, "reason": reason}
