"""Federated trust: a client cannot lie its way into weight, partitions or a smaller ε, absurd updates are
bounded server-side, the ledger never under-reports, and one failing client does not lose the round's
privacy spend. Config typos are errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.federated import simulation as simulation_mod  # noqa: E402
from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.server.aggregate import AggregationError, fedavg  # noqa: E402
from peft_lalora.federated.server.ledger import PrivacyLedger, epsilon_from_history  # noqa: E402
from peft_lalora.federated.simulation import run_simulation  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning"),
]
DELTA = 1e-5
TINY = "fed_tiny:tiny"
G0 = {"m.lora_A.w": torch.zeros(2, 3), "m.lora_B.w": torch.ones(3, 2), "head.w": torch.zeros(2)}


def _shift(state, by):
    return {k: v + by for k, v in state.items()}


# ---------------------------------------------------------------------------------------------- Flower strategy
@pytest.fixture
def strategy(monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import strategy as flower_strategy

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    from peft_lalora.federated.server.rounds import FederationServer

    # attribution tests with synthetic shifts (1 to 100) far longer than a real client's 3 steps at lr 5e-3: an
    # explicit bound above all of them keeps the derived default bound (which would clip them) out of the way
    cfg = FederationConfig(
        task=TINY, num_clients=2, local_steps=3, epsilon=0, noise_multiplier=1.0, max_update_norm=1e3
    )
    server = FederationServer(cfg, G0, sizes=[30, 10], privacy={0: (1.0, 0.1), 1: (1.0, 0.25)})
    strat = flower_strategy.LALoraStrategy(server, flower_strategy.assign_partitions([77, 12], 2))
    strat.ledger = server.ledger
    sent = list(strat.configure_train(1, ArrayRecord(G0), ConfigRecord(), grid=None))
    return strat, {m.metadata.dst_node_id: m for m in sent}


def _reply(sent_msg, state, *, pid, n, steps=3, sigma=1.0, q=0.1):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    metrics = MetricRecord(
        {
            "partition-id": pid,
            "num-examples": n,
            "train-loss": 0.5,
            "epsilon": 0.1,
            "dp-noise-multiplier": [sigma],
            "dp-q": [q],
            "dp-steps": [steps],
        }
    )
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=sent_msg)


def test_server_assigns_partitions_and_sends_them(strategy):
    strat, sent = strategy
    assert strat.node_of == {0: 12, 1: 77}  # sorted node ids
    assert {n: int(m.content.config_records["config"]["partition-id"]) for n, m in sent.items()} == {12: 0, 77: 1}
    # the server charged each partition its (σ, q, local steps) when it sent the message
    assert strat.ledger.clients[0].charged == [(1.0, 0.1, 3)] and strat.ledger.clients[1].charged == [(1.0, 0.25, 3)]


def test_a_node_claiming_another_partition_and_1e9_examples_gets_nothing(strategy):
    """Before: the liar replying first as partition 0 got weight ≈ 1, the honest client 0 was dropped as a
    duplicate, and the ledger showed the liar's ε for client 0."""
    strat, sent = strategy
    liar = _reply(sent[77], _shift(G0, 100.0), pid=0, n=10**9, steps=1, q=0.001)
    honest = _reply(sent[12], _shift(G0, 1.0), pid=0, n=30)
    arrays, _ = strat.aggregate_train(1, [liar, honest])
    got = arrays.to_torch_state_dict()
    for k in G0:
        torch.testing.assert_close(got[k], G0[k] + 1.0)  # only the honest update, full weight
    reasons = " | ".join(r["reason"] for r in strat.server.rounds[-1].rejected)
    assert "claims partition 0 but was assigned partition 1" in reasons
    # the honest client's ε is its own; the liar's account cannot go below what the server charged it
    assert strat.ledger.epsilon(0) == pytest.approx(epsilon_from_history([(1.0, 0.1, 3)], DELTA, "rdp"), rel=1e-12)
    assert strat.ledger.epsilon(1) == pytest.approx(epsilon_from_history([(1.0, 0.25, 3)], DELTA, "rdp"), rel=1e-12)


def test_unknown_and_duplicate_senders_are_rejected_and_a_claimed_example_count_is_ignored(strategy):
    """A reply's own example count is not read (the plan fixes the sizes): before, it was compared with the
    server's; now an inflated count cannot change the weight either way (the update keeps weight 10)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    strat, sent = strategy
    inflated = _reply(sent[77], _shift(G0, 5.0), pid=1, n=10**12, q=0.25)
    honest = _reply(sent[12], _shift(G0, 1.0), pid=0, n=30)
    duplicate = _reply(sent[12], _shift(G0, 9.0), pid=0, n=30)
    stranger_msg = Message(
        RecordDict({"arrays": ArrayRecord(G0), "metrics": MetricRecord({})}), dst_node_id=555, message_type="train"
    )
    stranger = _reply(stranger_msg, _shift(G0, 9.0), pid=0, n=30)
    arrays, metrics = strat.aggregate_train(1, [honest, inflated, duplicate, stranger])
    for k in G0:  # (30·1 + 10·5) / 40: the server's sizes, never the claimed 1e12
        torch.testing.assert_close(arrays.to_torch_state_dict()[k], G0[k] + 2.0)
    reasons = " | ".join(r["reason"] for r in strat.server.rounds[-1].rejected)
    assert "second reply from node 12" in reasons
    assert "node 555, which was not sent a train message" in reasons
    assert metrics["num-rejected"] == 2


def test_a_node_configured_for_another_partition_refuses_the_assignment(monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import client_app
    from peft_lalora.federated.flower import strategy as flower_strategy

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    cfg = FederationConfig(task=TINY, num_clients=2, n_train=32, n_test=16, rounds=1, local_steps=1)
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 1}, state=RecordDict(), run_config=cfg.to_dict())
    content = RecordDict({"arrays": ArrayRecord(G0), "config": ConfigRecord({"server-round": 1, "partition-id": 0})})
    with pytest.raises(ValueError, match="assigned partition 0 but this SuperNode is configured for partition-id=1"):
        client_app._assigned_partition(Message(content, dst_node_id=5, message_type=MessageType.TRAIN), ctx)
    with pytest.raises(ValueError, match="3 SuperNodes are connected but the run has 2 partitions"):
        flower_strategy.assign_partitions([1, 2, 3], 2)


# ---------------------------------------------------------------------------------------------- fedavg bounds
def test_update_norm_bound_clips_or_rejects_a_1e6_update():
    honest = [_shift(G0, 0.1), _shift(G0, -0.1)]
    evil = {k: G0[k] + 1e6 for k in G0}
    res = fedavg([*honest, evil], [1, 1, 1], global_state=G0, max_update_norm=1.0, client_ids=["a", "b", "evil"])
    assert res.clipped == ["evil"]
    delta = torch.cat([(res.state[k] - G0[k]).flatten() for k in G0])
    # the evil update counts with norm exactly 1 (all-ones over the 14 entries / √14); the honest ones cancel
    assert torch.allclose(delta, torch.full_like(delta, 1 / math.sqrt(14) / 3), atol=1e-6)
    res = fedavg(
        [*honest, evil],
        global_state=G0,
        max_update_norm=1.0,
        update_norm_policy="reject",
        client_ids=["a", "b", "evil"],
    )
    assert [r.client for r in res.rejected] == ["evil"] and "exceeds max_update_norm=1" in res.rejected[0].reason
    for k in G0:
        torch.testing.assert_close(res.state[k], G0[k])  # the two honest updates cancel
    # without a bound (plain FedAvg, the old behaviour) the ×1e6 update moves the global state by ~3e5
    plain = fedavg([*honest, evil], global_state=G0)
    assert float((plain.state["head.w"] - G0["head.w"]).abs().max()) > 1e5


def test_finite_3e38_values_never_become_an_inf_global_state():
    big = {k: torch.full_like(v, 3e38) for k, v in G0.items()}
    with pytest.raises(AggregationError, match="overflows torch.float32"):
        fedavg([big, big, _shift(G0, 1.0)], [1, 1, 1], global_state=G0, server_lr=2.0)
    res = fedavg([big, _shift(G0, 1.0)], global_state=G0, max_update_norm=10.0)
    assert all(bool(torch.isfinite(v).all()) for v in res.state.values())


def test_trimmed_mean_keeps_every_coordinate_within_the_honest_range():
    honest = [_shift(G0, d) for d in (0.1, 0.2, 0.3, 0.4)]
    evil = _shift(G0, 1e6)
    res = fedavg([*honest, evil], [1, 1, 1, 1, 10**9], global_state=G0, rule="trimmed_mean", trim_fraction=0.2)
    for k in G0:  # trims 1 client per end: mean of (0.2, 0.3, 0.4)
        torch.testing.assert_close(res.state[k], G0[k] + 0.3)
    with pytest.raises(ValueError, match="trim_fraction"):
        fedavg(honest, rule="trimmed_mean", trim_fraction=0.5)


# ---------------------------------------------------------------------------------------------- ledger
def test_ledger_accumulates_a_reset_accountant_and_the_server_charge_is_a_floor():
    sigma, q = 1.1, 0.1
    true_eps = epsilon_from_history([(sigma, q, 30)], DELTA, "rdp")
    # the client's accountant was reset after round 1 (10 steps) and then ran 20 more: it reports 20
    reports_only = PrivacyLedger(DELTA)
    reports_only.record(0, [(sigma, q, 10)])
    with pytest.warns(RuntimeWarning, match="does not extend"):
        reports_only.record(0, [(sigma, q, 5)])  # reset: a regression is added, not accepted as the total
    assert reports_only.clients[0].steps == 15 and reports_only.clients[0].anomalies
    # a reset that already ran *more* steps than recorded looks like a continuation to the reports alone ...
    ledger = PrivacyLedger(DELTA)
    for _ in range(2):
        ledger.charge(0, sigma, q, 10)
    ledger.record(0, [(sigma, q, 10)])
    ledger.record(0, [(sigma, q, 12)])  # reset after round 1, then 12 steps: reports say 12 in all
    assert ledger.clients[0].epsilon_reported < true_eps
    # ... but the server asked for 20 steps, so ε is at least that of 20 (before the fix it read the 12-step ε)
    assert ledger.epsilon(0) == pytest.approx(epsilon_from_history([(sigma, q, 20)], DELTA, "rdp"), rel=1e-12)
    assert ledger.report()["clients"]["0"]["charged_steps"] == 20


def test_a_failing_client_does_not_abort_the_run_or_lose_the_rounds_spend(monkeypatch):
    """Before: a client raising in round 2 ended the in-process run and the round's spend of the clients that
    did run was never recorded."""
    cfg = FederationConfig(
        task=TINY,
        num_clients=3,
        rounds=3,
        local_steps=2,
        batch_size=8,
        n_train=72,
        n_test=16,
        alpha=1.0,
        epsilon=5.0,
        seed=1,
        filter="none",
    )
    real_build = simulation_mod.build_client

    def build(cfg_, task, part, c):
        client = real_build(cfg_, task, part, c)
        if c == 1:
            fit = client.fit

            def failing_fit(g, rnd, *a, **k):
                if rnd == 2:
                    client._empty_step()  # one DP step taken, then the client crashes
                    raise RuntimeError("disk full")
                return fit(g, rnd, *a, **k)

            client.fit = failing_fit
        return client

    monkeypatch.setattr(simulation_mod, "build_client", build)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_simulation(cfg, progress=False)
    assert len(res.rounds) == 3 and res.rounds[1].error is None  # round 2 aggregated the two others
    (failed,) = [r for r in res.rounds[1].rejected if r["client"] == 1]
    assert failed["category"] == "training_error" and "disk full" not in failed["reason"]  # the category, not the text
    clients = res.privacy["clients"]
    assert clients["0"]["steps"] == clients["2"]["steps"] == 6
    c1 = clients["1"]
    assert c1["steps"] == 5  # 2 + the 1 step before the crash + 2
    assert c1["charged_steps"] == 6  # the server asked for 2 steps in each of the 3 rounds
    (sigma,), (q,) = c1["noise_multipliers"], c1["sample_rates"]
    assert c1["epsilon"] == pytest.approx(epsilon_from_history([(sigma, q, 6)], DELTA, "rdp"), rel=1e-12)


# ---------------------------------------------------------------------------------------------- config
def test_unknown_run_config_keys_are_errors_with_a_suggestion():
    with pytest.raises(ValueError, match=r"'noise-multiplyer' \(did you mean 'noise-multiplier'\?\)"):
        FederationConfig.from_dict({"noise-multiplyer": 0.5})
    cfg = FederationConfig.from_dict({"noise-multiplier": 0.5, "result-path": "/x"}, extra_keys=["result-path"])
    assert cfg.noise_multiplier == 0.5
    with pytest.raises(ValueError, match="aggregation"):
        FederationConfig(aggregation="median")
