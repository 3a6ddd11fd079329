"""The Flower app: ``ServerApp`` + ``ClientApp`` + a FedAvg strategy for LA-LoRA (Flower ≥ 1.42 Message API).

Same client, sampling and aggregation code as the in-process runner (:mod:`~peft_lalora.federated.simulation`); the run
is described by a :class:`~peft_lalora.federated.config.FederationConfig` passed as Flower
``run_config``, which carries the operator's plan (``partition-sizes``, :mod:`~peft_lalora.federated.server.plan`).

What the server holds: the plan, the base model and, for evaluation, only the operator's own evaluation data
(``test_data`` or a factory's separate test set) — it builds the task with ``server=True`` and never loads a
training row. Each node loads only its own data: the file in its ``node_config["data"]`` (a real deployment,
all of it) or its partition of the shared source in the run config (the local runner); a node whose data does
not have the planned size refuses. A reply carries the noisy adapter and the allowlisted accounting numbers
only (:mod:`~peft_lalora.federated.server.replies`); the noise-free training loss only with ``release-nonprivate-stats =
true``.

Protocol:

1. **assignment** — the server assigns partitions to the connected node ids (:func:`assign_partitions`:
   the plan's ``partition-nodes``, else sorted node ids get partitions 0..N-1) and never asks a node which
   partition it is: a node cannot claim another node's partition (or its weight, or its place in the privacy
   ledger);
2. **rounds** — :meth:`Strategy.start`: ``train`` messages carry the global adapter (``ArrayRecord``), the
   round and the *assigned* ``partition-id``; a node trains on that partition (a node whose own
   ``node_config`` names a different partition refuses, an error reply). Replies are attributed by the
   sending node id (which Flower's transport, with SuperNode authentication, vouches for), never by what
   they say: a reply from a node that was not sent this round's message, a second reply from a node, or one
   whose self-reported ``partition-id`` disagrees with the assignment is rejected with its reason. FedAvg
   weights are the plan's partition sizes. Privacy: the server charges each sampled partition's (σ, q,
   local steps) to its ledger when it sends the message, and adds the accountant history the reply carries
   (``dp-noise-multiplier`` / ``dp-q`` / ``dp-steps``), bounded first (no more steps than charged, σ > 0, finite; else
   the reply is refused with its reason); the reported ε is the
   larger of the two (:mod:`~peft_lalora.federated.server.ledger`). A reply's arrays are parsed against the global
   adapter's keys, shapes and dtypes before anything is allocated
   (:func:`~peft_lalora.federated.server.replies.state_from_arrays`); any malformed field rejects that reply only. A
   node whose round fails replies with an error whose reason is only its category
   (:data:`~peft_lalora.federated.server.replies.CLIENT_FAILURES`; the detail goes to the node's own log), and the
   server records only a category and the node id, never an error text. ``aggregate_train`` runs
   :func:`aggregate_updates` (validation, update-norm bound, FedAvg of A, B and head); centralized evaluation on the
   operator's evaluation data (when there is any) after every round. A round in which every reply failed, was malformed
   or was rejected keeps the previous global adapter and records why (``error`` and ``rejected`` in its result record);
   the run goes on.

The deployment engine starts a fresh ClientApp process per message, so a client is rebuilt every
round; its accountant history and the last round it ran are kept in ``context.state`` (they never leave
the node except as the history the ledger needs). A train message for a round the node has already run
is refused (:class:`~peft_lalora.federated.client.dp_client.ReplayedRoundError`, an error reply). The DP noise is
fresh OS entropy by default; with ``reproducible-noise = true`` it is re-derived from the seeds, which
is why both runners then produce the same global adapter.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from ..server.replies import failure_category, history_of, number, reply_metrics, state_from_arrays
from .app_config import RESULT_PATH_KEY, STATE_PATH_KEY, THREADS_KEY

# The Flower app is loaded by module path (``peft_lalora.federated.flower.app:server_app`` /
# ``:client_app``) from the installed package; torch and the federated building blocks are imported inside
# the handlers, so importing this module stays cheap.
if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig
    from ..server.rounds import FederationServer

__all__ = ["LALoraStrategy", "assign_partitions", "client_app", "server_app"]

_STATE_KEY = "lalora-client"


def _log(level: int, msg: str, *args: Any, **kwargs: Any) -> None:
    from flwr.supercore import log

    log(level, msg, *args, **kwargs)


def _set_threads(context: Context) -> None:
    n = int(context.run_config.get(THREADS_KEY, 0) or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)


def _config(context: Context) -> FederationConfig:
    from ..config import FederationConfig

    return FederationConfig.from_dict(context.run_config, extra_keys=(RESULT_PATH_KEY, STATE_PATH_KEY, THREADS_KEY))


# ================================================================================================ client
client_app = ClientApp()
#: clients built in this process, by (run_id, partition id): a process that serves several messages
#: (process isolation) keeps one DPClient — one PrivacyEngine — per partition.
_CLIENTS: dict[tuple[int, int], Any] = {}


def _assigned_partition(msg: Message, context: Context) -> int:
    """The partition the server assigned in ``msg``; a node configured for another partition refuses."""
    pid = int(number(msg.content.config_records["config"], "partition-id"))
    own = context.node_config.get("partition-id")
    if own is not None and int(own) != pid:
        raise ValueError(
            f"the server assigned partition {pid} but this SuperNode is configured for partition-id={own}; "
            "partitions are assigned by the server: drop partition-id from --node-config"
        )
    return pid


def _local_data(cfg: FederationConfig, context: Context, pid: int) -> tuple[Any, Any]:
    """``(task, this node's training rows)``: with ``data`` in the node's ``node_config`` (a real deployment), all
    of that file; otherwise partition ``pid`` of the shared source named in the run config (the local runner).
    Either way they must have the plan's size."""
    import dataclasses

    from ..builders import build_partition, build_task
    from ..server.plan import check_local_size

    own = str(context.node_config.get("data", "") or "")
    if own:  # the node's own file is its partition (test_data set: nothing is carved from it)
        task = build_task(dataclasses.replace(cfg, data=own, test_data=cfg.test_data or own))
        rows = task.tensors("train")
    else:
        task = build_task(cfg)
        rows = task.tensors("train", build_partition(cfg, task).indices[pid])
    check_local_size(cfg, pid, len(rows))
    return task, rows


class _Failed(Exception):
    """A round failed at a stage whose category the node reports (the cause stays on the node)."""

    def __init__(self, category: str) -> None:
        super().__init__(category)
        self.category = category


def _stage(category: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; any exception becomes :class:`_Failed` ``(category)`` with the original as its cause."""
    try:
        return fn(*args)
    except _Failed:
        raise
    except Exception as err:  # noqa: BLE001 - classified here, logged in full on the node by _train
        raise _Failed(category) from err


def _client_for(cfg: FederationConfig, context: Context, pid: int) -> Any:
    from ..builders import make_client

    key = (int(context.run_id), pid)
    client = _CLIENTS.get(key)
    if client is None:
        task, rows = _stage("data_error", _local_data, cfg, context, pid)
        client = _stage("client_setup_error", make_client, cfg, task, rows, pid)
        saved = context.state.config_records.get(_STATE_KEY)
        if saved is not None:
            if int(number(saved, "partition-id")) != pid:
                raise ValueError(
                    f"this node trained partition {int(number(saved, 'partition-id'))} earlier in the run and is now "
                    f"assigned partition {pid}; a node keeps its partition for the whole run"
                )
            client.load_state_dict(
                {
                    "history": history_of(saved),
                    "rounds_run": int(number(saved, "rounds-run")),
                    "total_steps": int(number(saved, "total-steps")),
                    "last_round": int(number(saved, "last-round")),
                }
            )
        _CLIENTS[key] = client
    return client


def _save_state(context: Context, client: Any, pid: int) -> None:
    """The client's accountant history, counters and last round, in the node's ``context.state``."""
    hist = client.history
    context.state[_STATE_KEY] = ConfigRecord(
        {
            "dp-noise-multiplier": [h[0] for h in hist],
            "dp-q": [h[1] for h in hist],
            "dp-steps": [h[2] for h in hist],
            "partition-id": pid,
            "rounds-run": client.rounds_run,
            "total-steps": client.total_steps,
            "last-round": client.last_round,
        }
    )


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    """One DP round on this node's partition; a failure is an error reply naming only its category
    (:data:`~peft_lalora.federated.server.replies.CLIENT_FAILURES`), logged in full here, on the node."""
    from ..client.dp_client import ReplayedRoundError

    try:
        return _train_round(msg, context)
    except Exception as err:  # noqa: BLE001 - every failure becomes a category; the detail stays in this log
        cause = err.__cause__ if isinstance(err, _Failed) and err.__cause__ is not None else err
        category = err.category if isinstance(err, _Failed) else "training_error"
        category = "replayed_round" if isinstance(cause, ReplayedRoundError) else category
        _log(ERROR, "train message failed: %s (the server is told only this category)", category, exc_info=cause)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=category), reply_to=msg)


def _train_round(msg: Message, context: Context) -> Message:
    """One DP round on this node's partition, starting from the received global adapter."""
    _set_threads(context)
    cfg = _stage("client_setup_error", _config, context)
    pid = _stage("assignment_refused", _assigned_partition, msg, context)
    client = _stage("client_setup_error", _client_for, cfg, context, pid)
    global_state = msg.content.array_records["arrays"].to_torch_state_dict()
    server_round = int(number(msg.content.config_records["config"], "server-round"))
    try:
        update = client.fit(global_state, server_round=server_round)
    finally:  # also after a failed fit: the steps it ran and its consumed round survive the process
        _save_state(context, client, pid)
    metrics = MetricRecord(reply_metrics(update, cfg))  # the allowlist (.replies): nothing noise-free by default
    return Message(RecordDict({"arrays": ArrayRecord(update.state), "metrics": metrics}), reply_to=msg)


# ================================================================================================ server
class LALoraStrategy(FedAvg):
    """Flower's FedAvg driving a :class:`~peft_lalora.federated.server.rounds.FederationServer`: server-side partition
    assignment, replies attributed by sender, validation, the privacy ledger and the round records.

    Args:
        server: the federation's server state (global adapter, sizes, σ/q, ledger, records).
        node_of: ``{partition_id: node_id}`` as the server assigned it (:func:`assign_partitions`).
    """

    def __init__(self, server: FederationServer, node_of: dict[int, int]) -> None:
        cfg = server.cfg
        super().__init__(
            fraction_train=cfg.fraction,
            fraction_evaluate=0.0,
            min_train_nodes=cfg.min_clients,
            min_evaluate_nodes=0,
            min_available_nodes=cfg.num_clients,
        )
        if sorted(node_of) != list(range(cfg.num_clients)) or len(set(node_of.values())) != cfg.num_clients:
            raise ValueError(f"node_of must map partitions 0..{cfg.num_clients - 1} to distinct nodes, got {node_of}")
        self.server = server
        self.node_of = dict(node_of)
        self.partition_of = {n: p for p, n in self.node_of.items()}
        self._sent: dict[int, set[int]] = {}  #: round -> partitions sent a train message

    @property
    def global_state(self) -> dict[str, Any]:
        return self.server.global_state

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        sampled = self.server.start_round(server_round)  # charges the ledger
        _log(INFO, "configure_train: round %s, partitions %s", server_round, sampled)
        self._sent[server_round] = set(sampled)
        messages = []
        for pid in sampled:
            cfg_record = ConfigRecord(dict(config))
            cfg_record["server-round"] = server_round
            cfg_record["partition-id"] = pid
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg_record})
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=self.node_of[pid]))
        return messages

    def _attribute(self, server_round: int, msg: Message, seen: set[int]) -> int:
        """The partition a reply belongs to, from its sender's node id; ``ValueError`` if it is not admissible."""
        src = msg.metadata.src_node_id
        pid = self.partition_of.get(src)
        if pid is None or pid not in self._sent.get(server_round, set()):
            raise ValueError(f"reply from node {src}, which was not sent a train message for round {server_round}")
        if pid in seen:
            raise ValueError(f"second reply from node {src} (partition {pid}) in round {server_round}")
        seen.add(pid)
        return pid

    def _admit(self, pid: int, msg: Message) -> None:
        """Check one reply against the assignment and hand it to the server (``ValueError``/... if malformed)."""
        m = next(iter(msg.content.metric_records.values()))
        a = next(iter(msg.content.array_records.values()))
        history = history_of(m)
        claimed = int(number(m, "partition-id"))
        src = msg.metadata.src_node_id
        if claimed != pid:
            problem = f"claims partition {claimed} but was assigned partition {pid}"
            reason = f"node {src}: rejected reply ({problem})"
            self.server.reject(pid, reason, category="inconsistent_reply", history=history, node=src)
            return
        try:
            state = state_from_arrays(a, self.server.global_state)  # checked before anything is allocated
            loss = float(number(m, "train-loss")) if self.server.cfg.release_nonprivate_stats else None
        except (KeyError, TypeError, ValueError, OverflowError) as err:  # its well-formed history is still booked
            reason = f"node {src}: rejected reply ({type(err).__name__}: {err})"
            self.server.reject(pid, reason, category="malformed_reply", history=history, node=src)
            return
        self.server.receive(pid, state=state, history=history, loss=loss, node=src)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand every admissible reply to the server and finish the round. Error replies, malformed or
        inconsistent replies and invalid updates are recorded with their reasons; a round with no valid update
        keeps the previous global adapter (``error`` in its record) — one bad round does not end the run."""
        seen: set[int] = set()
        for msg in replies:
            src = msg.metadata.src_node_id
            try:
                pid = self._attribute(server_round, msg, seen)
            except ValueError as err:
                self.server.reject(None, str(err), category="unattributable_reply", node=src)
                continue
            if msg.has_error():  # only its category is kept: an error text may quote the node's data
                category = failure_category(msg.error.reason)
                self.server.reject(pid, f"node {src}: error reply ({category})", category=category, node=src)
                continue
            try:  # replies are remote input: any malformed field rejects that reply only
                self._admit(pid, msg)
            except (StopIteration, KeyError, TypeError, ValueError, OverflowError) as err:
                reason = f"node {src}: rejected reply ({type(err).__name__}: {err})"
                self.server.reject(pid, reason, category="malformed_reply", node=src)
        rec = self.server.finish_round()
        for r in rec.rejected:
            _log(WARNING, "round %s: client %s: %s: %s", server_round, r["client"], r["category"], r["reason"])
        if rec.error is not None:
            _log(WARNING, "round %s: %s", server_round, rec.error)
        metrics = MetricRecord(
            {
                "max-epsilon": rec.max_epsilon,
                "num-rejected": len(rec.rejected),
                "round-failed": int(rec.error is not None),
            }
        )
        return ArrayRecord(self.server.global_state), metrics


def assign_partitions(nodes: Iterable[int], num_clients: int, planned: list[int] | None = None) -> dict[int, int]:
    """``{partition_id: node_id}``: the plan's node ids in partition order (``partition_nodes``; each must be
    connected, others get nothing), else the i-th smallest node id trains partition i — then exactly
    ``num_clients`` nodes must be connected: an extra node is refused rather than silently left out."""
    if planned is not None:
        missing = sorted(set(planned) - set(nodes))
        if missing:
            raise ValueError(f"the plan's SuperNodes {missing} are not connected (partition_nodes)")
        return dict(enumerate(planned))
    ordered = sorted(set(nodes))
    if len(ordered) != num_clients:
        raise ValueError(f"{len(ordered)} SuperNodes are connected but the run has {num_clients} partitions")
    return dict(enumerate(ordered))


def wait_for_nodes(grid: Grid, num_nodes: int, timeout: float = 120.0) -> list[int]:
    """Block until at least ``num_nodes`` SuperNodes are connected; return their ids."""
    t0 = time.monotonic()
    while len(nodes := list(grid.get_node_ids())) < num_nodes:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} of {num_nodes} SuperNodes connected after {timeout:.0f}s")
        time.sleep(0.2)
    return sorted(nodes)


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    """Run the federation described by ``context.run_config``; write the result JSON / final adapter
    to ``result-path`` / ``state-path`` when given."""
    import torch

    from ..builders import build_task, noise_record
    from ..server.plan import FederationPlan
    from ..server.rounds import FederationServer

    t0 = time.perf_counter()
    _set_threads(context)
    cfg = _config(context)
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
