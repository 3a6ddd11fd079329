"""The server's strategy (:class:`LALoraStrategy`, Flower's ``FedAvg`` on the Message API) and the partition
assignment (:func:`assign_partitions`). Same sampling, validation and aggregation code as the in-process runner
(:mod:`~peft_lalora.federated.simulation`): the strategy drives a
:class:`~peft_lalora.federated.server.rounds.FederationServer`.

Protocol:

1. **assignment** — the server assigns partitions to the connected node ids (:func:`assign_partitions`:
   the plan's ``partition-nodes``, else sorted node ids get partitions 0..N-1) and never asks a node which
   partition it is: a node cannot claim another node's partition (or its weight, or its place in the privacy
   ledger);
2. **rounds** — :meth:`LALoraStrategy.start`: ``train`` messages carry the global adapter (``ArrayRecord``), the
   round and the *assigned* ``partition-id``; a node trains on that partition (a node whose own
   ``node_config`` names a different partition refuses, an error reply). Replies are attributed by the
   sending node id (which Flower's transport, with SuperNode authentication, vouches for), never by what
   they say: a reply from a node that was not sent this round's message, a second reply from a node, or one
   whose self-reported ``partition-id`` disagrees with the assignment is rejected with its reason. FedAvg
   weights are the plan's partition sizes. Privacy: the server charges each sampled partition's (σ, q,
   local steps) to its ledger when it sends the message, and adds the accountant history the reply carries
   (``dp-noise-multiplier`` / ``dp-q`` / ``dp-steps``), bounded first (no more steps than charged, σ > 0, finite; else
   the reply is refused with its reason); the reported ε is the larger of the two
   (:mod:`~peft_lalora.federated.server.ledger`). A reply's arrays are parsed against the global adapter's keys,
   shapes and dtypes before anything is allocated (:func:`~peft_lalora.federated.server.replies.state_from_arrays`);
   any malformed field rejects that reply only. An error reply is recorded by its category and the node id only,
   never by an error text. ``aggregate_train`` finishes the round (validation, update-norm bound, FedAvg of A, B and
   head); a round in which every reply failed, was malformed or was rejected keeps the previous global adapter and
   records why (``error`` and ``rejected`` in its result record); the run goes on.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from ..server.replies import failure_category, history_of, number, state_from_arrays
from .app_config import log as _log

if TYPE_CHECKING:  # pragma: no cover
    from ..server.rounds import FederationServer

__all__ = ["LALoraStrategy", "assign_partitions"]


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
