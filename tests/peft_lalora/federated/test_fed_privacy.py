"""What the federated server may hold and what a client may send it.

* the Flower ServerApp runs from the operator's plan (partition sizes) and the model: a task whose training-data
  loader raises on the server runs to the end (before, the server built the whole task and its partition);
* every reply a client sends — the in-process runner's and the Flower ClientApp's — carries only the noisy state
  and the allowlisted accounting numbers: no training loss, example count or ε unless
  ``release_nonprivate_stats`` (before: ``train-loss``, ``num-examples``, ``epsilon`` went to the server);
* results publish no per-client label counts unless ``publish_label_counts``;
* a reply's accountant history is bounded before it reaches the ledger: 1e9 steps under PRV return at once
  (before: MemoryError out of ``aggregate_train``), 1e12 under RDP, σ = 0, NaN, ∞ and negative counts are refused
  with a reason and leave ε at what the server charged.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.server.ledger import InadmissibleReport, PrivacyLedger, epsilon_from_history  # noqa: E402
from peft_lalora.federated.server.replies import NONPRIVATE_METRICS, REPLY_METRICS  # noqa: E402

pytestmark = pytest.mark.slow

DELTA = 1e-5
CFG = dict(
    task="test_fed_privacy:guarded_task",
    num_clients=3,
    alpha=1.0,
    rounds=2,
    local_steps=2,
    batch_size=8,
    n_train=72,
    n_test=24,
    epsilon=5.0,
    seed=3,
)
#: who is running: the guarded task's training data may be loaded by anyone but the server
ROLE = {"now": "operator"}


def guarded_task(cfg):
    """``fed_tiny:tiny`` whose training split raises when loaded while ``ROLE`` is ``"server"``."""
    from fed_tiny import tiny
    from peft_lalora.federated.data.task import Task

    base = tiny(cfg)

    def train():
        if ROLE["now"] == "server":
            raise AssertionError("the server loaded the clients' training data")
        return base.train

    return Task("guarded-tiny", train, lambda: base.test, base.num_labels, base.columns, base.model_factory)


class _Loopback:
    """A Flower ``Grid`` that runs the ClientApp in-process (a fresh ClientApp per message, as the deployment
    engine does), switching ``ROLE`` to ``"client"`` while it does, and keeps every reply."""

    def __init__(self, contexts):
        self.contexts, self.replies = contexts, []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from peft_lalora.federated.flower import client_app

        out = []
        for m in messages:
            client_app._CLIENTS.clear()
            ROLE["now"] = "client"
            try:
                out.append(client_app.app(m, self.contexts[m.metadata.dst_node_id]))
            finally:
                ROLE["now"] = "server"
        self.replies.extend(out)
        return out


def _run_server_app(tmp_path, monkeypatch, cfg):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.data.task import build_task
    from peft_lalora.federated.flower import server_app
    from peft_lalora.federated.server.plan import planned_config

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    grid_cls = type(
        "LoopbackGrid",
        (_Loopback, Grid),
        {
            "set_run": lambda s, r: None,
            "run": None,
            "create_message": None,
            "push_messages": None,
            "pull_messages": None,
        },
    )
    planned, _ = planned_config(cfg, build_task(cfg))  # the operator's process computes the plan
    run_config = {**planned.to_dict(), "result-path": str(tmp_path / "r.json"), "state-path": str(tmp_path / "s.pt")}
    contexts = {
        n: Context(run_id=7, node_id=n, node_config={}, state=RecordDict(), run_config=run_config) for n in (11, 12, 13)
    }
    grid = grid_cls(contexts)
    ROLE["now"] = "server"
    try:
        server_app.app(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    finally:
        ROLE["now"] = "operator"
    return grid, json.loads((tmp_path / "r.json").read_text()), torch.load(tmp_path / "s.pt")


@pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")
def test_server_app_runs_without_ever_loading_client_data(tmp_path, monkeypatch):
    from peft_lalora.federated.simulation import run_simulation

    torch.set_num_threads(1)
    cfg = FederationConfig(**CFG, reproducible_noise=True)
    grid, res, state = _run_server_app(tmp_path, monkeypatch, cfg)
    sim = run_simulation(cfg, progress=False)
    assert len(grid.replies) == cfg.rounds * cfg.num_clients and not any(r.has_error() for r in grid.replies)
    for k, v in sim.state.items():  # the same federation as the in-process runner, which holds the source
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6)
    assert res["accuracy"] == sim.accuracy and res["epsilon"] == sim.to_json()["epsilon"]
    # every Flower reply: the noisy adapter and the allowlisted accounting, nothing else
    for reply in grid.replies:
        (metrics,) = reply.content.metric_records.values()
        (arrays,) = reply.content.array_records.values()
        assert set(metrics) == REPLY_METRICS, set(metrics) - REPLY_METRICS
        assert set(arrays.to_torch_state_dict()) == set(sim.state)
    assert "label_histograms" not in res["partition"] and res["partition"]["sizes"] == sim.partition["sizes"]
    assert all(r["train_loss"] is None for r in res["rounds"])


def test_server_app_without_a_plan_is_refused(tmp_path, monkeypatch):
    from peft_lalora.federated.server.plan import FederationPlan

    with pytest.raises(ValueError, match="no federation plan: set partition_sizes"):
        FederationPlan.from_config(FederationConfig(**CFG))
    with pytest.raises(ValueError, match="partition_sizes needs 3 integers"):
        FederationConfig(**CFG, partition_sizes="10,20")


def test_the_plan_can_name_which_node_trains_which_partition():
    pytest.importorskip("flwr")
    from peft_lalora.federated.flower.strategy import assign_partitions

    cfg = FederationConfig(**{**CFG, "partition_nodes": "905,17,342"})
    assert assign_partitions([17, 342, 905, 1000], 3, cfg.planned_nodes()) == {0: 905, 1: 17, 2: 342}
    with pytest.raises(ValueError, match=r"the plan's SuperNodes \[905\] are not connected"):
        assign_partitions([17, 342, 7], 3, cfg.planned_nodes())
    assert assign_partitions([17, 342, 905], 3) == {0: 17, 1: 342, 2: 905}  # no plan: sorted ids
    with pytest.raises(ValueError, match="partition_nodes must be distinct"):
        FederationConfig(**{**CFG, "partition_nodes": "1,1,2"})


def test_a_node_whose_data_is_not_the_planned_size_refuses(tmp_path, monkeypatch):
    """The plan is what the server weights and accounts with; a node with other data replies with an error that
    names the plan, not the node's own count."""
    from peft_lalora.federated.server.plan import check_local_size

    cfg = FederationConfig(**{**CFG, "partition_sizes": "30,20,22"})
    check_local_size(cfg, 1, 20)
    with pytest.raises(ValueError, match="does not have the 20 examples the plan") as err:
        check_local_size(cfg, 1, 21)
    assert "21" not in str(err.value)


def _simulation_replies(monkeypatch, cfg):
    """Run the in-process simulation and keep every reply handed to the server."""
    from peft_lalora.federated.server.rounds import FederationServer
    from peft_lalora.federated.simulation import run_simulation

    seen = []
    receive = FederationServer.receive

    def spy(self, client, **reply):
        seen.append(reply)
        return receive(self, client, **reply)

    monkeypatch.setattr(FederationServer, "receive", spy)
    return run_simulation(cfg, progress=False), seen


def test_simulation_replies_carry_no_noise_free_statistic_by_default(monkeypatch):
    res, seen = _simulation_replies(monkeypatch, FederationConfig(**{**CFG, "task": "fed_tiny:tiny"}))
    assert len(seen) == 2 * 3
    for reply in seen:
        assert set(reply) == {"state", "history", "loss"} and reply["loss"] is None
        assert [tuple(h)[:2] for h in reply["history"]] and all(float(h[2]).is_integer() for h in reply["history"])
    out = res.to_json()
    assert all(r["train_loss"] is None for r in out["rounds"])
    assert set(out["partition"]) == {"scheme", "num_clients", "sizes"}


def test_release_nonprivate_stats_and_publish_label_counts_are_opt_ins(monkeypatch, tmp_path):
    from peft_lalora.federated.server.replies import reply_metrics

    cfg = FederationConfig(
        **{**CFG, "task": "fed_tiny:tiny", "release_nonprivate_stats": True, "publish_label_counts": True}
    )
    res, seen = _simulation_replies(monkeypatch, cfg)
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in seen)
    out = res.to_json()
    assert all(math.isfinite(r["train_loss"]) for r in out["rounds"])
    assert sum(map(sum, out["partition"]["label_histograms"])) == sum(out["partition"]["sizes"]) == 72
    assert "not private" in out["partition"]["note"]

    class _Update:
        client, loss, history = 1, 0.25, [(1.0, 0.1, 2)]

    assert set(reply_metrics(_Update, cfg)) == REPLY_METRICS | NONPRIVATE_METRICS
    assert set(reply_metrics(_Update, FederationConfig(**CFG))) == REPLY_METRICS


# ---------------------------------------------------------------------------------------------- bounded reports
@pytest.fixture
def strategy(monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import strategy as flower_strategy
    from peft_lalora.federated.server.rounds import FederationServer

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    def make(accountant):
        cfg = FederationConfig(
            task="fed_tiny:tiny",
            num_clients=2,
            local_steps=3,
            epsilon=0,
            noise_multiplier=1.0,
            accountant=accountant,
            max_update_norm=1e3,
        )  # synthetic +1 updates
        g0 = {"a": torch.zeros(2, 3), "b": torch.ones(3)}
        server = FederationServer(cfg, g0, sizes=[30, 10], privacy={0: (1.0, 0.1), 1: (1.0, 0.25)})
        strat = flower_strategy.LALoraStrategy(server, {0: 12, 1: 77})
        sent = {m.metadata.dst_node_id: m for m in strat.configure_train(1, ArrayRecord(g0), ConfigRecord(), None)}
        return strat, sent, g0

    return make


def _reply(sent_msg, state, pid, sigma, q, steps):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    metrics = MetricRecord({"partition-id": pid, "dp-noise-multiplier": [sigma], "dp-q": [q], "dp-steps": [steps]})
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=sent_msg)


@pytest.mark.parametrize(
    ("accountant", "sigma", "steps", "reason"),
    [
        ("prv", 1.0, 1e9, "reports 1000000000 DP steps but the server charged only 3"),
        ("rdp", 1.0, 1e12, "reports 1000000000000 DP steps but the server charged only 3"),
        ("rdp", 0.0, 3, "noise_multiplier <= 0"),
        ("rdp", math.nan, 3, "noise_multiplier must be finite"),
        ("rdp", 1.0, -5, "num_steps must be a non-negative int"),
        ("rdp", 1.0, math.inf, "malformed accountant history"),
    ],
)
def test_a_reply_claiming_unbounded_or_noise_free_steps_is_refused_before_the_ledger(
    strategy, accountant, sigma, steps, reason
):
    strat, sent, g0 = strategy(accountant)
    shifted = {k: v + 1 for k, v in g0.items()}
    t0 = time.perf_counter()
    arrays, metrics = strat.aggregate_train(
        1,
        [
            _reply(sent[12], shifted, 0, 1.0, 0.1, 3),
            _reply(sent[77], {k: v + 9 for k, v in g0.items()}, 1, sigma, 0.25, steps),
        ],
    )
    assert time.perf_counter() - t0 < 20  # no accountant ran on the claimed count (PRV on 1e9 steps: MemoryError)
    for k in g0:  # only the honest update
        torch.testing.assert_close(arrays.to_torch_state_dict()[k], shifted[k])
    (rejected,) = strat.server.rounds[-1].rejected
    assert rejected["client"] == 1 and reason in rejected["reason"] and metrics["num-rejected"] == 1
    info = strat.server.ledger.clients[1]
    assert info.history == [] and reason in info.anomalies[-1]
    charged = epsilon_from_history([(1.0, 0.25, 3)], DELTA, accountant)
    assert info.epsilon == pytest.approx(charged, rel=1e-9) and math.isfinite(strat.server.ledger.max_epsilon)


def test_ledger_bound_is_checked_before_any_accountant_call(monkeypatch):
    import opacus.accountants as accountants

    ledger = PrivacyLedger(DELTA, "prv")
    ledger.charge(0, 1.0, 0.1, 5)
    monkeypatch.setattr(accountants, "create_accountant", lambda **k: pytest.fail("accountant called"))
    bad_reports = ([(1.0, 0.1, 10**9)], [(1.0, 0.1, 1)] * 6, [(0.0, 0.1, 5)], [("x", 0.1, 1)], [(1e-300, 0.1, 5)])
    for bad in bad_reports:  # the last: σ = 1e-300 made the federation's largest ε infinite
        with pytest.raises(InadmissibleReport):
            ledger.record(0, bad, max_steps=ledger.clients[0].charged_steps)
    assert ledger.clients[0].history == [] and len(ledger.clients[0].anomalies) == 5
    assert "below 0.1" in ledger.clients[0].anomalies[-1] and math.isfinite(ledger.max_epsilon)


# ---------------------------------------------------------------------------------------------- text task, nodes
def test_text_task_for_the_server_never_reads_the_clients_data(tmp_path):
    """Built with ``server=True`` the user's text task reads the model and the operator's ``test_data`` only:
    ``data`` may not even exist on the server's machine."""
    from fed_support import user_model_and_data
    from peft_lalora.federated.data.task import build_task
    from peft_lalora.federated.server.plan import FederationPlan
    from peft_lalora.federated.server.rounds import FederationServer

    model_dir, csv = user_model_and_data(tmp_path, "csv")
    text = dict(model=str(model_dir), text_column="review", label_column="sentiment", seq_len=8, num_clients=2)
    absent = str(tmp_path / "clients-only" / "data.csv")
    task = build_task(FederationConfig(**text, data=absent, test_data=str(csv)), server=True)
    assert task.num_labels == 2 and len(task.test) == 60 and not task.loaded("train") and not task.test_from_train
    with pytest.raises(FileNotFoundError):
        task.train  # noqa: B018 - the clients' file is not there: proof that nothing above read it
    task = build_task(FederationConfig(**text, data=absent, num_labels=2), server=True)  # no evaluation data
    assert task.test_from_train and task.model().config.num_labels == 2
    cfg = FederationConfig(**text, num_labels=2)
    task = build_task(cfg, server=True)  # a server is given no data at all
    assert task.test_from_train and task.num_labels == 2
    server = FederationServer.from_plan(cfg, task, FederationPlan((30, 30)))  # what the ServerApp runs
    assert server.evaluation.startswith("none") and math.isnan(server.initial["accuracy"])
    assert not task.loaded("train") and not task.loaded("test")
    task = build_task(FederationConfig(**text, data=str(csv), test_data=str(csv)), server=True)
    assert FederationServer.from_plan(cfg, task, FederationPlan((30, 30))).evaluation.endswith("(60 examples)")
    assert not task.loaded("train")
    with pytest.raises(ValueError, match="set num_labels"):
        build_task(FederationConfig(**text, data=absent), server=True)


def test_a_node_with_its_own_data_trains_on_all_of_it(tmp_path, monkeypatch):
    """``data`` in a SuperNode's node_config (a real deployment) is that node's partition, all of it; a
    shared-source node takes its partition of the run's data. Both must match the plan."""
    pytest.importorskip("flwr")
    from fed_support import user_model_and_data
    from flwr.app import Context, RecordDict
    from peft_lalora.federated.flower import client_app

    model_dir, csv = user_model_and_data(tmp_path, "csv")
    own = tmp_path / "node.csv"
    own.write_text("\n".join(csv.read_text().splitlines()[:26]))  # header + 25 rows
    cfg = FederationConfig(
        model=str(model_dir),
        data=str(csv),
        text_column="review",
        label_column="sentiment",
        seq_len=8,
        num_clients=2,
        partition="iid",
        partition_sizes="25,24",
    )
    ctx = Context(run_id=1, node_id=5, node_config={"data": str(own)}, state=RecordDict(), run_config={})
    _, rows = client_app._local_data(cfg, ctx, 0)
    assert len(rows) == 25
    with pytest.raises(ValueError, match="does not have the 24 examples the plan"):
        client_app._local_data(cfg, ctx, 1)
    shared = Context(run_id=1, node_id=6, node_config={}, state=RecordDict(), run_config={})
    _, rows = client_app._local_data(cfg, shared, 1)  # 48 training rows of the shared source (12 held out), iid
    assert len(rows) == 24
