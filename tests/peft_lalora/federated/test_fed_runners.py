"""The two runners: in-process simulation and a real Flower federation (SuperLink + 2 SuperNodes on
127.0.0.1) give the same global adapter (with the reproducible_noise opt-in), which is the FedAvg of the
clients' results; nothing is left running afterwards. RoLoRA's first federated round trains first_factor;
a round without any valid update keeps the global state and the run goes on; replayed rounds are refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from fed_support import CFG, assert_states_equal, replay  # noqa: E402
from peft_lalora.federated import simulation as simulation_mod  # noqa: E402
from peft_lalora.federated.builders import build_evaluator, build_task  # noqa: E402
from peft_lalora.federated.client.dp_client import REPRODUCIBLE_NOISE_NOTE  # noqa: E402
from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.server.plan import planned_config  # noqa: E402
from peft_lalora.federated.simulation import run_simulation  # noqa: E402

# Runner equality needs noise that is a function of the seeds: opt in (experiments only).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning"),
]


def test_simulation_equals_hand_replay():
    torch.set_num_threads(1)
    cfg = FederationConfig(**CFG)
    g0, g_ref, eps = replay(cfg)
    res = run_simulation(cfg, progress=False)
    assert_states_equal(res.state, g_ref)
    assert not all(torch.equal(res.state[k], g0[k]) for k in g0)
    assert [res.privacy["clients"][str(i)]["epsilon"] for i in range(2)] == pytest.approx(eps, rel=1e-12)
    assert max(eps) <= 5.0 + 0.05
    assert len(res.accuracy) == 3 and all(0.0 <= a <= 1.0 for a in res.accuracy)
    noise = res.to_json()["noise"]
    assert noise["reproducible"] is True and noise["note"] == REPRODUCIBLE_NOISE_NOTE


def _factors_moved(before, after):
    return {f for f in "AB" if not all(torch.equal(before[k], after[k]) for k in before if f".lora_{f}." in k)}


def test_rolora_first_federated_round_trains_first_factor():
    """Runners number rounds from 1: round 1 must train first_factor (B) only, round 2 the other one."""
    first, other = "B", "A"
    cfg = FederationConfig(
        **{
            **CFG,
            "algo": "rolora",
            "first_factor": first,
            "filter": "none",
            "local_steps": 1,
            "n_train": 48,
            "n_test": 16,
            "reproducible_noise": False,
        }
    )
    g0 = build_evaluator(cfg, build_task(cfg)).initial_state()
    states = []
    res = run_simulation(cfg, progress=False, on_round=lambda rec, s: states.append(dict(s)))
    assert _factors_moved(g0, states[0]) == {first}
    assert _factors_moved(states[0], states[1]) == {other}
    assert res.to_json()["noise"]["reproducible"] is False


def test_round_without_valid_updates_keeps_global_state_and_run_continues(monkeypatch):
    """Every update of round 1 is NaN (rejected): no AggregationError escapes, the global state stays,
    the round records why, privacy spent is still counted, and round 2 aggregates normally."""
    cfg = FederationConfig(**{**CFG, "filter": "none", "local_steps": 1, "n_train": 48, "n_test": 16})
    real_build = simulation_mod.build_client

    def poisoned_build(*a, **k):
        client = real_build(*a, **k)
        fit = client.fit

        def poisoned_fit(g, rnd, *fa, **fk):
            u = fit(g, rnd, *fa, **fk)
            if rnd == 1:
                u.state = {n: torch.full_like(t, float("nan")) for n, t in u.state.items()}
            return u

        client.fit = poisoned_fit
        return client

    monkeypatch.setattr(simulation_mod, "build_client", poisoned_build)
    g0 = build_evaluator(cfg, build_task(cfg)).initial_state()
    states = []
    res = run_simulation(cfg, progress=False, on_round=lambda rec, s: states.append(dict(s)))
    r1, r2 = res.rounds
    assert r1.error is not None and "aggregation failed, global state kept" in r1.error
    assert sorted(r["client"] for r in r1.rejected) == [0, 1]
    assert all("non-finite" in r["reason"] for r in r1.rejected)
    assert_states_equal(states[0], g0)
    assert r1.accuracy == res.initial["accuracy"]
    assert r2.error is None and r2.rejected == [] and not all(torch.equal(states[1][k], g0[k]) for k in g0)
    assert all(v["steps"] == 2 for v in res.privacy["clients"].values()), "round 1's noise was still spent"
    out = res.to_json()
    assert out["failed_rounds"] == [1] and out["rounds"][0]["error"] == r1.error


def test_client_sampling_fraction_limits_participation():
    cfg = FederationConfig(**{**CFG, "num_clients": 4, "fraction": 0.5, "rounds": 2, "filter": "none", "n_train": 96})
    res = run_simulation(cfg, progress=False)
    assert [len(r.clients) for r in res.rounds] == [2, 2]
    steps = {int(c): v["steps"] for c, v in res.privacy["clients"].items()}
    sampled = [c for r in res.rounds for c in r.clients]
    assert steps == {c: cfg.local_steps * sampled.count(c) for c in range(4)}
    never = [c for c in range(4) if c not in sampled]
    assert all(res.privacy["clients"][str(c)]["epsilon"] == 0.0 for c in never)


def test_flower_apps_on_a_loopback_grid_with_partial_sampling(tmp_path, monkeypatch):
    """ServerApp + ClientApp + strategy driven in-process by a Grid that hands each message to the
    ClientApp (client caches cleared per message, as in the per-message processes of the deployment
    engine): the server assigns partitions to node ids (sorted), routes the seeded sample of fraction < 1
    to the assigned nodes, and the result equals the in-process simulation."""
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import client_app, server_app

    # what a real ServerApp process learns from its SuperLink before running the app
    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    class LoopbackGrid(Grid):
        def __init__(self, contexts):
            self.contexts = contexts
            self.sent = []

        def set_run(self, run):  # pragma: no cover - not used by the app
            pass

        @property
        def run(self):  # pragma: no cover
            raise NotImplementedError

        def create_message(self, *a, **k):  # pragma: no cover
            raise NotImplementedError

        def get_node_ids(self):
            return list(self.contexts)

        def push_messages(self, messages):  # pragma: no cover
            raise NotImplementedError

        def pull_messages(self, message_ids):  # pragma: no cover
            raise NotImplementedError

        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for m in messages:
                client_app._CLIENTS.clear()  # a fresh ClientApp "process" per message
                self.sent.append((m.metadata.message_type, m.metadata.dst_node_id))
                replies.append(client_app.app(m, self.contexts[m.metadata.dst_node_id]))
            return replies

    torch.set_num_threads(1)
    cfg = FederationConfig(**{**CFG, "num_clients": 3, "fraction": 0.67, "n_train": 72})
    planned, _ = planned_config(cfg, build_task(cfg))  # the operator's plan: the ServerApp reads no client data
    run_config = {**planned.to_dict(), "result-path": str(tmp_path / "r.json"), "state-path": str(tmp_path / "s.pt")}
    node_ids = [309, 101, 205]  # arbitrary ids; the server assigns partitions 0, 1, 2 in sorted id order
    pids = {101: 0, 205: 1, 309: 2}
    contexts = {
        n: Context(run_id=7, node_id=n, node_config={}, state=RecordDict(), run_config=run_config) for n in node_ids
    }
    grid = LoopbackGrid(contexts)
    server_app.app(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    sim = run_simulation(cfg, progress=False)
    final = torch.load(tmp_path / "s.pt")
    assert_states_equal(final, sim.state)
    # no handshake: 2 train messages per round, to the nodes the server assigned the sampled partitions
    assert {t for t, _ in grid.sent} == {"train"}
    node_of = {p: n for n, p in pids.items()}
    trains = [n for t, n in grid.sent if t == "train"]
    assert trains == [node_of[p] for r in sim.rounds for p in r.clients]
    assert all(len(r.clients) == 2 for r in sim.rounds)
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["epsilon"] == sim.to_json()["epsilon"] and res["accuracy"] == sim.accuracy
    assert all(contexts[n].state.config_records["lalora-client"]["rounds-run"] >= 1 for n in node_ids if n in trains)
    # replay protection survives the per-message rebuild: the node's context remembers its last round
    n_last = trains[-1]
    assert contexts[n_last].state.config_records["lalora-client"]["last-round"] == cfg.rounds
    replay = _train_message(final, cfg.rounds, n_last, partition=pids[n_last])
    client_app._CLIENTS.clear()
    refused = client_app.app(replay, contexts[n_last])  # an error reply naming only the category
    assert refused.has_error() and refused.error.reason == "replayed_round"


def _train_message(state, server_round, node, partition=None):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    pid = node - 1 if partition is None else partition
    config = ConfigRecord({"server-round": server_round, "partition-id": pid})
    content = RecordDict({"arrays": ArrayRecord(state), "config": config})
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)


def test_flower_strategy_survives_a_round_with_no_valid_reply(monkeypatch):
    """aggregate_train with only an error reply, a malformed reply and a NaN update keeps the previous
    global adapter, records every reason and the failure, and the next round aggregates again."""
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import strategy as flower_strategy
    from peft_lalora.federated.server.rounds import FederationServer

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    cfg = FederationConfig(**{**CFG, "num_clients": 3, "max_update_norm": 1e3})  # synthetic updates, not a client's
    g0 = {"m.lora_A.w": torch.zeros(2, 3), "m.lora_B.w": torch.ones(3, 2)}
    server = FederationServer(cfg, g0, sizes=[10, 10, 10], privacy={p: (1.0, 0.1) for p in range(3)})
    ledger = server.ledger
    strategy = flower_strategy.LALoraStrategy(server, {0: 1, 1: 2, 2: 3})
    strategy.configure_train(1, ArrayRecord(g0), ConfigRecord(), grid=None)

    def reply(node, state, pid, steps=2, **drop):
        metrics = {
            "partition-id": pid,
            "num-examples": 10,
            "train-loss": 0.5,
            "epsilon": 1.0,
            "dp-noise-multiplier": [1.0],
            "dp-q": [0.1],
            "dp-steps": [steps],
        }
        metrics = {k: v for k, v in metrics.items() if k not in drop}
        content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})
        return Message(content, reply_to=_train_message(g0, 1, node))

    nan = {k: torch.full_like(v, float("nan")) for k, v in g0.items()}
    bad = [
        Message(Error(code=0, reason="client crashed"), reply_to=_train_message(g0, 1, 1)),
        reply(2, g0, 1, **{"dp-steps": None}),
        reply(3, nan, 2),
    ]
    arrays, metrics = strategy.aggregate_train(1, bad)
    kept = arrays.to_torch_state_dict()
    assert_states_equal(kept, g0)
    assert strategy.global_state is not None and metrics["round-failed"] == 1 and metrics["num-rejected"] == 3
    rec = server.rounds[-1]
    assert rec.error.startswith("aggregation failed, global state kept")
    reasons = " | ".join(r["reason"] for r in rec.rejected)
    assert "rejected reply (KeyError" in reasons and "non-finite" in reasons
    assert "client crashed" not in reasons, "an error reply's text is never recorded, only its category"
    assert sorted(r["category"] for r in rec.rejected) == ["client_error", "invalid_update", "malformed_reply"]
    assert ledger.clients[2].steps == 2, "the rejected NaN update still spent privacy"
    assert ledger.clients[0].charged_steps == cfg.local_steps, "the crashed client is charged what it was sent"
    new = {k: v + 1 for k, v in g0.items()}
    strategy.configure_train(2, ArrayRecord(g0), ConfigRecord(), grid=None)
    arrays, metrics = strategy.aggregate_train(2, [reply(1, new, 0), reply(2, new, 1, steps=4)])
    assert_states_equal(arrays.to_torch_state_dict(), new)
    assert metrics["round-failed"] == 0 and server.rounds[-1].error is None


def test_written_flower_app_is_valid_and_round_trips_the_config(tmp_path):
    pytest.importorskip("flwr")
    from flwr.common.config import validate_config
    from peft_lalora.federated.flower.app_config import write_flower_app

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    cfg = FederationConfig(**{**CFG, "delta": 1e-6, "target_modules": "query,key,value"})
    app = write_flower_app(tmp_path / "app", {**cfg.to_dict(), "result-path": "/tmp/r.json"})
    pyproject = tomllib.loads((app / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(pyproject, check_module=True, project_dir=app)  # components import
    assert ok, errors
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert FederationConfig.from_dict(run_config, extra_keys=["result-path"]) == cfg
    components = pyproject["tool"]["flwr"]["app"]["components"]
    assert components == {  # Flower's app shape, imported from the installed package, not copied
        "serverapp": "peft_lalora.federated.flower.server_app:app",
        "clientapp": "peft_lalora.federated.flower.client_app:app",
    }
    assert not list(app.glob("*.py"))
