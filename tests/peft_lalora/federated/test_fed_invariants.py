"""Federated privacy invariants (issue 39): no reply can stop the server, a client's failure reaches the server as a
category and an id (never its text), every CLI number is checked before training, a run whose rounds all fail
exits non-zero and the ledger keeps no charge a client provably did not spend, δ < 1/N, no negative ε, and no
``gdp`` (an approximation, not a bound) in the ledger."""

from __future__ import annotations

import io
import json
import logging
import math

import numpy as np
import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.server.ledger import PrivacyLedger, epsilon_from_history  # noqa: E402
from peft_lalora.federated.server.rounds import FederationServer  # noqa: E402

TINY = "fed_tiny:tiny"
DELTA = 1e-5
G0 = {"m.lora_A.w": torch.zeros(2, 3), "m.lora_B.w": torch.ones(3, 2)}
#: what a node's data error said (a cell value, a column name, the node's file path): none may reach the server
SECRETS = ("HIV-positive", "ssn", "/srv/clinic-7/patients.jsonl")


def _server(**over):
    cfg = FederationConfig(task=TINY, num_clients=2, local_steps=3, epsilon=0, noise_multiplier=1.0, **over)
    return FederationServer(cfg, G0, sizes=[30, 10], privacy={0: (1.0, 0.1), 1: (1.0, 0.25)})


@pytest.fixture
def strategy(monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import strategy as flower_strategy

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    strat = flower_strategy.LALoraStrategy(_server(max_update_norm=1e3), flower_strategy.assign_partitions([77, 12], 2))
    sent = list(strat.configure_train(1, ArrayRecord(G0), ConfigRecord(), grid=None))
    return strat, {m.metadata.dst_node_id: m for m in sent}


def _reply(sent_msg, arrays, *, pid, steps=3, q=0.1):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    metrics = MetricRecord({"partition-id": pid, "dp-noise-multiplier": [1.0], "dp-q": [q], "dp-steps": [steps]})
    record = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)
    return Message(RecordDict({"arrays": record, "metrics": metrics}), reply_to=sent_msg)


def _npy(descr: str, shape: tuple, payload: bytes = b"", fortran: bool = False) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return buf.getvalue() + payload


def _malformed(data: bytes, stype: str = "numpy.ndarray"):
    """G0 with LoRA A's bytes replaced by ``data``."""
    from flwr.app import Array, ArrayRecord

    good = ArrayRecord(G0)
    arrays = {k: good[k] for k in G0}
    arrays["m.lora_A.w"] = Array(dtype="float32", shape=(2, 3), stype=stype, data=data)
    return ArrayRecord(arrays)


_ZEROS6 = np.zeros(6, np.float32).tobytes()
#: name -> (array bytes, a fragment of the recorded reason)
MALFORMED = {
    "empty bytes": (b"", "not an .npy array"),  # before: EOFError out of aggregate_train
    "zip signature": (b"PK\x03\x04" + bytes(60), "not an .npy array"),  # before: BadZipFile
    "header claiming 4e12 floats": (_npy("<f4", (4_000_000_000_000,)), "shape"),  # before: MemoryError (14.6 TiB)
    "wrong shape": (_npy("<f4", (3, 2), _ZEROS6), "shape"),
    "float64": (_npy("<f8", (2, 3), bytes(48)), "dtype"),
    "object dtype (a pickle)": (_npy("|O", (2, 3), b"\x80\x04N."), "dtype"),
    "truncated data": (_npy("<f4", (2, 3), _ZEROS6[:-1]), "bytes"),
    "trailing bytes": (_npy("<f4", (2, 3), _ZEROS6 + b"x"), "bytes"),
    "huge header length": (b"\x93NUMPY\x02\x00" + (2**31).to_bytes(4, "little"), "header"),
}


# ------------------------------------------------------------------------------------- 1. no reply stops the server
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_array_is_rejected_before_allocation_and_the_round_goes_on(strategy, case):
    data, fragment = MALFORMED[case]
    strat, sent = strategy
    bad = _reply(sent[77], _malformed(data), pid=1, q=0.25)
    honest = _reply(sent[12], {k: v + 1.0 for k, v in G0.items()}, pid=0)
    arrays, metrics = strat.aggregate_train(1, [bad, honest])
    got = arrays.to_torch_state_dict()
    for k in G0:
        torch.testing.assert_close(got[k], G0[k] + 1.0)  # the honest update alone
    (rej,) = strat.server.rounds[-1].rejected
    assert rej["client"] == 1 and rej["category"] == "malformed_reply" and fragment in rej["reason"]
    assert metrics["num-rejected"] == 1 and metrics["round-failed"] == 0
    # its accountant report was well formed: it still reaches the ledger (the spend is never lost)
    assert strat.server.ledger.clients[1].steps == 3


def test_state_from_arrays_checks_keys_and_returns_fresh_writable_tensors():
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord
    from peft_lalora.federated.server.replies import MalformedReply, state_from_arrays

    state = state_from_arrays(ArrayRecord({k: v + 2 for k, v in G0.items()}), G0)
    assert list(state) == list(G0) and all(torch.equal(state[k], G0[k] + 2) for k in G0)
    state["m.lora_A.w"].add_(1)  # writable (no read-only numpy buffer underneath)
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    fortran = _npy("<f4", (2, 3), values.tobytes(order="F"), fortran=True)  # a valid layout: parsed, not refused
    assert torch.equal(state_from_arrays(_malformed(fortran), G0)["m.lora_A.w"], torch.from_numpy(values))
    with pytest.raises(MalformedReply, match=r"missing \['m.lora_B.w'\]"):
        state_from_arrays(ArrayRecord({"m.lora_A.w": G0["m.lora_A.w"]}), G0)
    with pytest.raises(MalformedReply, match="1 unexpected"):
        state_from_arrays(ArrayRecord({**G0, "evil": torch.zeros(1)}), G0)
    with pytest.raises(MalformedReply, match="serialization"):
        state_from_arrays(_malformed(_npy("<f4", (2, 3), _ZEROS6), stype="torch.pickle"), G0)


# ------------------------------------------------------------------------------------- 2. no text through a side door
def test_the_server_records_a_clients_error_as_a_category_and_never_its_text(strategy):
    from flwr.app import Error, Message

    strat, sent = strategy
    text = f"<class 'InputError'>:<'{SECRETS[2]}:3: record 3: label {SECRETS[0]!r}, column {SECRETS[1]!r}'>"
    arbitrary = Message(Error(code=0, reason=text), reply_to=sent[77])
    categorised = Message(Error(code=0, reason="data_error"), reply_to=sent[12])
    strat.aggregate_train(1, [arbitrary, categorised])
    rejected = sorted(strat.server.rounds[-1].rejected, key=lambda r: r["client"])
    got = [(r["client"], r["node"], r["category"]) for r in rejected]
    assert got == [(0, 12, "data_error"), (1, 77, "client_error")]
    dumped = json.dumps(strat.server.result("flower", 0.0).to_json(), allow_nan=True)
    assert not [s for s in SECRETS if s in dumped]


def test_a_node_reports_a_data_error_as_its_category_and_keeps_the_detail_in_its_own_log(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from fed_support import user_model_and_data
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.flower import client_app

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    model_dir, _ = user_model_and_data(tmp_path, "csv")
    own = tmp_path / "patients.jsonl"  # record 3's label is a string where record 1's is an integer
    rows = [{"note": "the movie was good", "ssn": 0}, {"note": "bad", "ssn": 1}, {"note": "x", "ssn": SECRETS[0]}]
    own.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = FederationConfig(
        model=str(model_dir), text_column="note", label_column="ssn", num_labels=2, num_clients=2, partition_sizes="3,3"
    )
    ctx = Context(run_id=7, node_id=5, node_config={"data": str(own)}, state=RecordDict(), run_config=cfg.to_dict())
    config = ConfigRecord({"server-round": 1, "partition-id": 0})
    content = RecordDict({"arrays": ArrayRecord(G0), "config": config})
    msg = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
    logged = []
    monkeypatch.setattr(client_app, "_log", lambda level, m, *a, **k: logged.append((m % a, k.get("exc_info"))))
    client_app._CLIENTS.clear()
    reply = client_app.app(msg, ctx)
    assert reply.has_error() and reply.error.reason == "data_error"  # before: the InputError, path and cell included
    (line, exc), *_ = [x for x in logged if "data_error" in x[0]]
    assert SECRETS[0] in str(exc) and str(own) in str(exc)  # the detail stays in the node's log


def test_a_node_whose_round_fails_after_a_dp_step_keeps_that_step_and_the_consumed_round(monkeypatch):
    """The error reply names only ``training_error``; the node's state keeps the step it ran and the round it
    consumed (before, both were lost with the process: the next process reported fewer steps, a replay was taken)."""
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from peft_lalora.federated.builders import build_evaluator, build_task
    from peft_lalora.federated.client.dp_client import DPClient
    from peft_lalora.federated.flower import client_app

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    cfg = FederationConfig(task=TINY, num_clients=2, alpha=1.0, n_train=32, n_test=8, batch_size=8, local_steps=2)
    real_fit = DPClient.fit

    def fail_after_one_step(self, g, server_round=None, *a, **k):
        real_fit(self, g, server_round, local_steps=1)
        raise RuntimeError(f"out of memory reading {SECRETS[2]}")

    monkeypatch.setattr(DPClient, "fit", fail_after_one_step)
    g0 = build_evaluator(cfg, build_task(cfg)).initial_state()
    ctx = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config=cfg.to_dict())
    content = RecordDict({"arrays": ArrayRecord(g0), "config": ConfigRecord({"server-round": 1, "partition-id": 0})})
    client_app._CLIENTS.clear()
    reply = client_app.app(Message(content, dst_node_id=5, message_type=MessageType.TRAIN), ctx)
    assert reply.has_error() and reply.error.reason == "training_error"
    saved = ctx.state.config_records["lalora-client"]
    assert list(saved["dp-steps"]) == [1] and saved["last-round"] == 1


# ------------------------------------------------------------------------------------- 3. the ledger's charges
def test_a_charge_is_withdrawn_only_with_proof_that_no_dp_step_ran():
    server = _server()
    server.start_round(1)
    server.reject(0, "client 0: training_error", category="training_error", no_dp_step=True)
    server.reject(1, "client 1: training_error", category="training_error")  # no proof: stays charged
    server.finish_round()
    ledger = server.ledger
    assert ledger.clients[0].charged == [] and ledger.epsilon(0) == 0.0
    assert ledger.report()["clients"]["0"]["withdrawn_steps"] == 3
    assert ledger.clients[1].charged == [(1.0, 0.25, 3)]
    assert ledger.epsilon(1) == pytest.approx(epsilon_from_history([(1.0, 0.25, 3)], DELTA, "rdp"), rel=1e-12)
    with pytest.raises(ValueError, match="more than was charged"):
        ledger.withdraw(1, 1.0, 0.25, 4)


def test_every_round_failing_exits_non_zero_and_keeps_only_the_steps_that_ran(tmp_path, monkeypatch, capsys, caplog):
    """Client 0 fails before its first DP step (no spend: its round's charge is withdrawn), client 1 after one DP
    step (charged the whole round, as asked). Before: exit 0, ε charged for both, the error text in the JSON."""
    from peft_lalora.cli import main
    from peft_lalora.federated import simulation as simulation_mod

    real_build = simulation_mod.build_client

    def build(cfg_, task, part, c):
        if c == 0:
            raise ValueError(f"{SECRETS[2]}:3: record 3: label {SECRETS[0]!r}, column {SECRETS[1]!r}")
        client = real_build(cfg_, task, part, c)

        real_fit = client.fit

        def one_step_then_fail(g, rnd, *a, **k):
            real_fit(g, rnd, local_steps=1)  # one real DP step, then the client crashes
            raise RuntimeError(f"disk full under {SECRETS[2]}")

        client.fit = one_step_then_fail
        return client

    monkeypatch.setattr(simulation_mod, "build_client", build)
    out = tmp_path / "r.json"
    argv = ["federate", "--task", TINY, "--num-clients", "2", "--alpha", "1", "--rounds", "2", "--local-steps", "2"]
    argv += ["--n-train", "48", "--n-test", "16", "--batch-size", "8", "--threads", "1", "--no-progress"]
    with caplog.at_level(logging.WARNING, logger="peft_lalora.federated"):
        rc = main([*argv, "--out", str(out)])
    assert rc == 1 and "every round failed" in capsys.readouterr().err
    text = out.read_text()
    assert not [s for s in SECRETS if s in text]
    res = json.loads(text)
    assert res["failed_rounds"] == [1, 2]
    cats = {(r["client"], r["category"]) for rnd in res["rounds"] for r in rnd["rejected"]}
    assert cats == {(0, "client_setup_error"), (1, "training_error")}
    c0, c1 = res["privacy"]["clients"]["0"], res["privacy"]["clients"]["1"]
    assert c0["epsilon"] == 0.0 and c0["charged_steps"] == 0 and c0["withdrawn_steps"] == 4
    assert c1["charged_steps"] == 4 and c1["steps"] == 2 and c1["epsilon"] > 0
    assert SECRETS[0] in caplog.text and "disk full" in caplog.text  # the detail: the operator's own log only


# ------------------------------------------------------------------------------------- 4/5. δ, negative ε, gdp
def test_delta_at_or_above_one_over_n_is_refused_naming_n():
    from peft_lalora.federated.client.dp_client import ClientConfig, privacy_parameters

    assert privacy_parameters(ClientConfig(noise_multiplier=1.0, delta=0.03), 30) == (1.0, 0.5)  # 0.03 < 1/30
    with pytest.raises(ValueError, match=r"delta=0\.05 >= 1/N.*N = 30 records.*1/N\^1\.1"):
        privacy_parameters(ClientConfig(noise_multiplier=1.0, delta=0.05), 30)
    with pytest.raises(ValueError, match=r"partition 0.*N = 30"):
        FederationServer(
            FederationConfig(task=TINY, num_clients=2, epsilon=0, delta=0.05),
            G0,
            sizes=[30, 10],
            privacy={0: (1.0, 0.1), 1: (1.0, 0.25)},
        )


def test_no_negative_epsilon_in_the_ledger():
    assert epsilon_from_history([(2.0, 0.01, 1)], 0.05, "rdp") == 0.0  # before: -0.051 (RDP), i.e. (0, δ)-DP
    ledger = PrivacyLedger(0.05)
    ledger.charge("a", 2.0, 0.01, 1)
    assert ledger.epsilon("a") == 0.0 and ledger.report()["max_epsilon"] == 0.0


def test_gdp_is_refused_with_why():
    from peft_lalora.cli import build_parser
    from peft_lalora.federated.client.dp_client import ClientConfig

    for make in (
        lambda: FederationConfig(accountant="gdp"),
        lambda: PrivacyLedger(DELTA, "gdp"),
        lambda: epsilon_from_history([(1.0, 0.1, 3)], DELTA, "gdp"),
        lambda: ClientConfig(target_epsilon=1.0, planned_steps=3, accountant="gdp"),
    ):
        with pytest.raises(ValueError, match="approximation, not an upper bound"):
            make()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["federate", "--accountant", "gdp"])


# ------------------------------------------------------------------------------------- 3. every CLI number
BAD_FLAGS = [
    ("--epsilon", "nan"),  # before: silently fell back to --noise-multiplier
    ("--epsilon", "-1"),
    ("--epsilon", "inf"),
    ("--noise-multiplier", "nan"),
    ("--noise-multiplier", "0"),
    ("--max-grad-norm", "0"),  # before: passed, every round failed, exit 0, ε charged
    ("--max-grad-norm", "nan"),
    ("--lr", "nan"),
    ("--lr", "0"),
    ("--lr", "-1"),
    ("--delta", "nan"),
    ("--delta", "0"),
    ("--server-lr", "0"),
    ("--server-lr", "nan"),
    ("--alpha", "nan"),
    ("--alpha", "0"),
    ("--b-lr-ratio", "0"),
    ("--weight-decay", "-0.1"),
    ("--weight-decay", "nan"),
    ("--max-update-norm", "inf"),
    ("--lora-alpha", "0"),
    ("--seed", "-1"),
    ("--min-partition-size", "0"),
    ("--threads", "-1"),
    ("--timeout", "0"),
    ("--timeout", "nan"),
]


@pytest.fixture
def no_training(monkeypatch):
    from peft_lalora.federated import simulation
    from peft_lalora.federated.data import task
    from peft_lalora.federated.launcher import run as flower_run

    def started(*a, **k):
        raise AssertionError("training started with an invalid flag")

    for mod, name in ((task, "build_task"), (simulation, "run_simulation"), (flower_run, "run_flower")):
        monkeypatch.setattr(mod, name, started)


@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS, ids=[f"{f}={v}" for f, v in BAD_FLAGS])
def test_every_cli_number_is_checked_before_training_naming_the_flag(flag, value, tmp_path, capsys, no_training):
    from peft_lalora.cli import main

    assert main(["federate", "--task", TINY, "--no-progress", "--out", str(tmp_path / "r.json"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} {value}:" in err, err
    assert not (tmp_path / "r.json").exists()


def test_documented_zeros_still_mean_what_the_help_says():
    from peft_lalora.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["federate", "--epsilon", "0", "--noise-multiplier", "0.8"]))
    assert cfg.epsilon == 0.0 and cfg.noise_multiplier == 0.8  # --epsilon 0: use --noise-multiplier
    cfg = config_from_args(build_parser().parse_args(["federate", "--max-update-norm", "0", "--weight-decay", "0"]))
    assert cfg.max_update_norm == 0.0 and cfg.weight_decay == 0.0 and not math.isnan(cfg.lr)
