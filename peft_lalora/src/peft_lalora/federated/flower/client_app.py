"""The Flower ``ClientApp`` of a federation (``peft_lalora.federated.flower.client_app:app``): one DP round per
``train`` message on the partition the server assigned (:mod:`~peft_lalora.federated.flower.strategy`).

Each node loads only its own data: the file in its ``node_config["data"]`` (a real deployment, all of it) or its
partition of the shared source in the run config (the local runner); a node whose data does not have the planned
size refuses. A reply carries the noisy adapter and the allowlisted accounting numbers only
(:mod:`~peft_lalora.federated.server.replies`); the noise-free training loss only with
``release-nonprivate-stats = true``. A node whose round fails replies with an error whose reason is only its
category (:data:`~peft_lalora.federated.server.replies.CLIENT_FAILURES`; the detail goes to the node's own log).

The deployment engine starts a fresh ClientApp process per message, so a client is rebuilt every round; its
accountant history and the last round it ran are kept in ``context.state`` (they never leave the node except as the
history the ledger needs). A train message for a round the node has already run is refused
(:class:`~peft_lalora.federated.client.dp_client.ReplayedRoundError`, an error reply). The DP noise is fresh OS
entropy by default; with ``reproducible-noise = true`` it is re-derived from the seeds, which is why both runners
then produce the same global adapter.
"""

from __future__ import annotations

from logging import ERROR
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from ..server.replies import history_of, number, reply_metrics
from .app_config import federation_config, set_threads
from .app_config import log as _log

# torch and the federated building blocks are imported inside the handlers: importing this module stays cheap
if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig

__all__ = ["app"]

_STATE_KEY = "lalora-client"

app = ClientApp()
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


@app.train()
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
    set_threads(context)
    cfg = _stage("client_setup_error", federation_config, context)
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
