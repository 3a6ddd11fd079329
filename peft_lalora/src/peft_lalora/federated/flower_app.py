"""The Flower app: ``ServerApp`` + ``ClientApp`` + a FedAvg strategy for LA-LoRA (Flower ≥ 1.42 Message API).

Same client, sampling and aggregation code as the in-process runner (:mod:`.simulation`); the run is
described by a :class:`~peft_lalora.federated.federation.FederationConfig` passed as Flower
``run_config``, and each SuperNode's ``node_config`` carries ``partition-id``.

Protocol:

1. **handshake** (only with partial client sampling) — the server sends a ``query`` message to every
   node and gets back its ``partition-id``, so the seeded sample of :func:`sample_clients` (partition
   ids) can be routed to node ids; with full participation every node gets every train message and the
   replies identify their partition;
2. **rounds** — :meth:`Strategy.start`: ``train`` messages carry the global adapter (``ArrayRecord``)
   and the round; replies carry the client's adapter, ``num-examples``, ``partition-id``, its ε and its
   accountant history (``dp-sigma`` / ``dp-q`` / ``dp-steps``) for the server's privacy ledger;
   ``aggregate_train`` runs :func:`aggregate_updates` (validation + FedAvg of A, B and head);
   centralized evaluation on the server's test set after every round. A round in which every reply
   failed, was malformed or was rejected keeps the previous global adapter and records why (``error``
   and ``rejected`` in its result record); the run goes on.

The deployment engine starts a fresh ClientApp process per message, so a client is rebuilt every
round; its accountant history and the last round it ran are kept in ``context.state`` (they never leave
the node except as the history the ledger needs). A train message for a round the node has already run
is refused (:class:`~peft_lalora.federated.client.ReplayedRoundError`, an error reply). The DP noise is
fresh OS entropy by default; with ``reproducible-noise = true`` it is re-derived from the seeds, which
is why both runners then produce the same global adapter.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

# Only flwr and the standard library at import time: the launcher copies this file into the Flower app
# as a top-level module, so that the handshake's ClientApp processes start in about a second; torch
# and peft_lalora are imported (with absolute imports) inside the handlers that need them.
if TYPE_CHECKING:  # pragma: no cover
    import torch

    from peft_lalora.federated.federation import FederationConfig
    from peft_lalora.federated.ledger import PrivacyLedger

__all__ = ["LALoraStrategy", "client_app", "server_app"]

_STATE_KEY = "lalora-client"
#: run_config keys that are not FederationConfig fields
RESULT_PATH_KEY = "result-path"
STATE_PATH_KEY = "state-path"
THREADS_KEY = "threads"


def _log(level: int, msg: str, *args: Any) -> None:
    from flwr.supercore import log

    log(level, msg, *args)


def _set_threads(context: Context) -> None:
    n = int(context.run_config.get(THREADS_KEY, 0) or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)


# ================================================================================================ client
client_app = ClientApp()
#: clients built in this process, by (run_id, partition id): a process that serves several messages
#: (process isolation) keeps one DPClient — one PrivacyEngine — per partition.
_CLIENTS: dict[tuple[int, int], Any] = {}


def _number(record: Any, key: str) -> float:
    """``record[key]`` as a number; ``TypeError`` naming the key otherwise (replies are remote input)."""
    v = record[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{key!r}: expected a number, got {type(v).__name__}")
    return v


def _numbers(record: Any, key: str) -> list[float]:
    """``record[key]`` as a list of numbers (``TypeError`` otherwise)."""
    v = record[key]
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise TypeError(f"{key!r}: expected a list of numbers, got {v!r}")
    return [float(x) for x in v]


def _history(record: Any) -> list[tuple[float, float, int]]:
    """The accountant history ``[(σ, q, steps)]`` stored as three parallel lists in ``record``."""
    sigma, q, steps = _numbers(record, "dp-sigma"), _numbers(record, "dp-q"), _numbers(record, "dp-steps")
    return [(s, r, int(n)) for s, r, n in zip(sigma, q, steps, strict=True)]


def _partition_id(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise ValueError("SuperNode needs --node-config 'partition-id=<i> num-partitions=<n>'")
    return int(context.node_config["partition-id"])


def _client_for(cfg: FederationConfig, context: Context) -> Any:
    from peft_lalora.federated.federation import build_client, build_partition, build_task

    pid = _partition_id(context)
    key = (int(context.run_id), pid)
    client = _CLIENTS.get(key)
    if client is None:
        task = build_task(cfg)
        partition = build_partition(cfg, task)
        client = build_client(cfg, task, partition, pid)
        saved = context.state.config_records.get(_STATE_KEY)
        if saved is not None:
            client.load_state_dict(
                {
                    "history": _history(saved),
                    "rounds_run": int(_number(saved, "rounds-run")),
                    "total_steps": int(_number(saved, "total-steps")),
                    "last_round": int(_number(saved, "last-round")),
                }
            )
        _CLIENTS[key] = client
    return client


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    """Handshake: report this node's partition id."""
    pid = _partition_id(context)
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    """One DP round on this node's partition, starting from the received global adapter."""
    from peft_lalora.federated.federation import FederationConfig

    _set_threads(context)
    cfg = FederationConfig.from_dict(context.run_config)
    client = _client_for(cfg, context)
    global_state = msg.content.array_records["arrays"].to_torch_state_dict()
    round_index = int(_number(msg.content.config_records["config"], "server-round"))
    update = client.fit(global_state, round_index)
    hist = client.history
    context.state[_STATE_KEY] = ConfigRecord(
        {
            "dp-sigma": [h[0] for h in hist],
            "dp-q": [h[1] for h in hist],
            "dp-steps": [h[2] for h in hist],
            "rounds-run": client.rounds_run,
            "total-steps": client.total_steps,
            "last-round": client.last_round,
        }
    )
    metrics = MetricRecord(
        {
            "num-examples": update.num_examples,
            "partition-id": update.client,
            "train-loss": update.loss,
            "epsilon": update.epsilon,
            "dp-sigma": [h[0] for h in hist],
            "dp-q": [h[1] for h in hist],
            "dp-steps": [h[2] for h in hist],
        }
    )
    return Message(RecordDict({"arrays": ArrayRecord(update.state), "metrics": metrics}), reply_to=msg)


# ================================================================================================ server
class LALoraStrategy(FedAvg):
    """FedAvg over LALoRA adapters with validation, seeded partition-id sampling and a privacy ledger.

    Args:
        cfg: the run.
        node_of: ``{partition_id: node_id}`` from the handshake, or ``None`` when every client trains
            every round (then all ``nodes`` get every train message and the replies say who is who).
        nodes: the connected node ids (used when ``node_of`` is ``None``).
        global_state: the initial global adapter (the strategy tracks the current one, because the
            server learning rate and the validation need it).
        ledger: per-client privacy ledger (updated from the replies).
    """

    def __init__(
        self,
        cfg: FederationConfig,
        node_of: dict[int, int] | None,
        global_state: dict[str, torch.Tensor],
        ledger: PrivacyLedger,
        nodes: list[int] | None = None,
    ) -> None:
        super().__init__(
            fraction_train=cfg.fraction,
            fraction_evaluate=0.0,
            min_train_nodes=cfg.min_clients,
            min_evaluate_nodes=0,
            min_available_nodes=cfg.num_clients,
        )
        self.cfg = cfg
        if node_of is None and (nodes is None or len(nodes) != cfg.num_clients):
            raise ValueError("without a handshake (node_of=None) exactly num_clients nodes must be given")
        self.node_of = None if node_of is None else dict(node_of)
        self.nodes = list(nodes or [])
        self.global_state = dict(global_state)
        self.ledger = ledger
        self.records: list[dict[str, Any]] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        from peft_lalora.federated.federation import sample_clients

        sampled = sample_clients(self.cfg, server_round)
        cfg_record = ConfigRecord(dict(config))
        cfg_record["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg_record})
        _log(INFO, "configure_train: round %s, partitions %s", server_round, sampled)
        if self.node_of is None:  # every partition trains: address every node
            if len(sampled) != len(self.nodes):
                raise RuntimeError("partial client sampling needs the partition-id handshake")
            return self._construct_messages(record, self.nodes, MessageType.TRAIN)
        return self._construct_messages(record, [self.node_of[p] for p in sampled], MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg of the valid replies. Error replies, malformed replies and invalid updates are dropped
        with their reasons; if none is left (``AggregationError``) the previous global adapter is kept and
        the round's record carries ``error`` — one bad round does not end the run."""
        from peft_lalora.federated.aggregate import AggregationError
        from peft_lalora.federated.federation import aggregate_updates

        states, sizes, ids, losses = [], [], [], []
        errors = []
        for msg in replies:
            src = msg.metadata.src_node_id
            if msg.has_error():
                errors.append(f"node {src}: {msg.error.reason}")
                continue
            try:  # replies are remote input: any malformed field rejects that reply only
                m = next(iter(msg.content.metric_records.values()))
                a = next(iter(msg.content.array_records.values()))
                pid = int(_number(m, "partition-id"))
                if pid in ids:
                    errors.append(f"node {src}: duplicate partition-id {pid} (update ignored)")
                    continue
                state = a.to_torch_state_dict()
                size = int(_number(m, "num-examples"))
                loss = float(_number(m, "train-loss"))
                hist = _history(m)
                self.ledger.record(pid, hist)  # privacy was spent even if the update is rejected below
            except (StopIteration, KeyError, TypeError, ValueError) as err:
                errors.append(f"node {src}: malformed reply ({type(err).__name__}: {err})")
                continue
            states.append(state)
            sizes.append(size)
            ids.append(pid)
            losses.append(loss)
        for e in errors:
            _log(WARNING, "round %s: client error %s", server_round, e)
        error: str | None = None
        try:
            result = aggregate_updates(self.cfg, self.global_state, states, sizes, ids)
            rejected = result.rejected
            self.global_state = result.state
        except AggregationError as err:
            error = f"aggregation failed, global state kept: {err}"
            rejected = err.rejected
            _log(WARNING, "round %s: %s", server_round, error)
        for r in rejected:
            _log(WARNING, "round %s: rejected update of partition %s: %s", server_round, r.client, r.reason)
        good = [x for x in losses if not math.isnan(x)]
        self.records.append(
            {
                "round": server_round,
                "clients": sorted(ids),
                "train_loss": sum(good) / len(good) if good else math.nan,
                "rejected": [{"client": r.client, "reason": r.reason} for r in rejected]
                + [{"client": None, "reason": e} for e in errors],
                "max_epsilon": self.ledger.max_epsilon,
                "error": error,
            }
        )
        metrics = MetricRecord(
            {
                "max-epsilon": self.ledger.max_epsilon,
                "num-rejected": len(rejected) + len(errors),
                "round-failed": int(error is not None),
            }
        )
        return ArrayRecord(self.global_state), metrics


def wait_for_nodes(grid: Grid, num_nodes: int, timeout: float = 120.0) -> list[int]:
    """Block until at least ``num_nodes`` SuperNodes are connected; return their ids."""
    t0 = time.monotonic()
    while len(nodes := list(grid.get_node_ids())) < num_nodes:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} of {num_nodes} SuperNodes connected after {timeout:.0f}s")
        time.sleep(0.2)
    return sorted(nodes)


def handshake(grid: Grid, nodes: list[int], num_clients: int, timeout: float = 120.0) -> dict[int, int]:
    """Ask every node for its ``partition-id`` (a ``query`` message); return ``{partition_id: node_id}``."""
    msgs = [
        Message(
            RecordDict({"config": ConfigRecord({"ask": "partition-id"})}), dst_node_id=n, message_type=MessageType.QUERY
        )
        for n in nodes
    ]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    node_of: dict[int, int] = {}
    for r in replies:
        if r.has_error():
            raise RuntimeError(f"handshake failed on node {r.metadata.src_node_id}: {r.error.reason}")
        pid = int(_number(next(iter(r.content.metric_records.values())), "partition-id"))
        if pid in node_of:
            raise ValueError(f"two SuperNodes claim partition-id {pid}")
        node_of[pid] = r.metadata.src_node_id
    missing = sorted(set(range(num_clients)) - set(node_of))
    if missing:
        raise ValueError(f"no SuperNode serves partition(s) {missing} (connected: {sorted(node_of)})")
    return node_of


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    """Run the federation described by ``context.run_config``; write the result JSON / final adapter
    to ``result-path`` / ``state-path`` when given."""
    import torch

    from peft_lalora.federated.federation import (
        FederationConfig,
        build_evaluator,
        build_partition,
        build_task,
        noise_record,
        sample_clients,
    )
    from peft_lalora.federated.ledger import PrivacyLedger
    from peft_lalora.federated.simulation import FederationResult, RoundRecord

    t0 = time.perf_counter()
    _set_threads(context)
    cfg = FederationConfig.from_dict(context.run_config)
    noise = noise_record(cfg)
    if cfg.reproducible_noise:
        _log(WARNING, "reproducible-noise is on: %s", noise["note"])
    nodes = wait_for_nodes(grid, cfg.num_clients)
    # The handshake (one extra message round trip, i.e. one ClientApp process per node) is only needed
    # to route a *partial* sample of partitions; with full participation the train replies identify
    # their partition themselves.
    full = len(sample_clients(cfg, 1)) == cfg.num_clients and len(nodes) == cfg.num_clients
    node_of = None if full else handshake(grid, nodes, cfg.num_clients)
    task = build_task(cfg)
    partition = build_partition(cfg, task)
    evaluator = build_evaluator(cfg, task)
    initial_state = evaluator.initial_state()
    ledger = PrivacyLedger(cfg.delta, cfg.accountant)
    for c in range(cfg.num_clients):
        ledger.register(c)
    strategy = LALoraStrategy(cfg, node_of, initial_state, ledger, nodes)
    evals: dict[int, dict[str, float]] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        evals[server_round] = m = evaluator(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": m["accuracy"], "loss": m["loss"]})

    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_state), num_rounds=cfg.rounds, evaluate_fn=evaluate_fn)
    rounds = [
        RoundRecord(
            round=rec["round"],
            clients=rec["clients"],
            accuracy=evals[rec["round"]]["accuracy"],
            loss=evals[rec["round"]]["loss"],
            train_loss=rec["train_loss"],
            rejected=rec["rejected"],
            max_epsilon=rec["max_epsilon"],
            error=rec["error"],
        )
        for rec in strategy.records
    ]
    result = FederationResult(
        config=cfg.to_dict(),
        runner="flower",
        initial=evals[0],
        rounds=rounds,
        privacy=ledger.report(),
        partition=partition.summary(),
        state=strategy.global_state,
        wall_s=time.perf_counter() - t0,
        noise=noise,
    )
    out = str(context.run_config.get(RESULT_PATH_KEY, "") or "")
    if out:
        result.save(out)
    state_out = str(context.run_config.get(STATE_PATH_KEY, "") or "")
    if state_out:
        Path(state_out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(result.state, state_out)
    _log(
        INFO,
        "LA-LoRA federation done: %s",
        json.dumps({"accuracy": result.accuracy, "max_epsilon": ledger.max_epsilon}),
    )
