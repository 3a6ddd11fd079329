"""DP federated client and privacy ledger: accounting equals a fresh Opacus accountant for the steps
actually run; one PrivacyEngine per client; alternation per round; cloned states; noise from OS entropy
by default and seeded only on request; replayed rounds refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from opacus.accountants import RDPAccountant  # noqa: E402
from opacus_spectral.errors import ReproducibleNoiseWarning  # noqa: E402
from peft_lalora.federated.builders import (  # noqa: E402
    build_client,
    build_evaluator,
    build_partition,
    build_task,
    client_config,
)
from peft_lalora.federated.client import dp_client as client_mod  # noqa: E402
from peft_lalora.federated.client.dp_client import ReplayedRoundError  # noqa: E402
from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.server.ledger import PrivacyLedger, epsilon_from_history, normalize_history  # noqa: E402

DELTA = 1e-5
TINY = "fed_tiny:tiny"


def _setup(**kw):
    base = dict(
        task=TINY,
        num_clients=2,
        alpha=1.0,
        rounds=3,
        local_steps=3,
        batch_size=8,
        n_train=96,
        n_test=32,
        epsilon=0.0,
        noise_multiplier=0.8,
    )
    base.update(kw)
    cfg = FederationConfig(**base)
    task = build_task(cfg)
    part = build_partition(cfg, task)
    init = build_evaluator(cfg, task).initial_state()
    return cfg, task, part, init


def _count_steps(client):
    """Count real optimizer steps independently of the client and of Opacus' accountant."""
    counter = {"n": 0}
    client.optimizer.original_optimizer.register_step_post_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
    return counter


def _split(state):
    a = {k: v for k, v in state.items() if ".lora_A." in k}
    b = {k: v for k, v in state.items() if ".lora_B." in k}
    h = {k: v for k, v in state.items() if "classifier" in k}
    assert a and b and h and len(a) + len(b) + len(h) == len(state)
    return a, b, h


def _same(x, y):
    return all(torch.equal(x[k], y[k]) for k in x)


def test_ledger_matches_fresh_accountant_for_steps_actually_run():
    cfg, task, part, g = _setup()
    c0, c1 = (build_client(cfg, task, part, i) for i in (0, 1))
    n0, n1 = _count_steps(c0), _count_steps(c1)
    ledger = PrivacyLedger(DELTA, "rdp")
    for c in (0, 1):
        ledger.register(c)
    # client 0 is sampled in rounds 1, 2, 3 (K=3, then K=2 in round 3); client 1 only in round 2
    eps0 = []
    for rnd, who in ((1, [c0]), (2, [c0, c1]), (3, [c0])):
        for c in who:
            u = c.fit(g, rnd, local_steps=2 if rnd == 3 else None)
            ledger.record(u.client, u.history)
        eps0.append(ledger.epsilon(0))
    assert eps0[0] < eps0[1] < eps0[2], "a client's spent budget grows with the rounds it takes part in"
    assert (n0["n"], n1["n"]) == (3 + 3 + 2, 3)
    for client, n in ((c0, n0["n"]), (c1, n1["n"])):
        fresh = RDPAccountant()
        for _ in range(n):
            fresh.step(noise_multiplier=client.noise_multiplier, sample_rate=client.sample_rate)
        expected = fresh.get_epsilon(DELTA)
        assert ledger.epsilon(client.client_id) == pytest.approx(expected, rel=1e-12)
        assert client.epsilon(DELTA) == pytest.approx(expected, rel=1e-12)
    assert c0.sample_rate == pytest.approx(1 / math.ceil(len(part.indices[0]) / 8))
    # fewer rounds -> less spent (same sigma; client 1's q is at least as large here, so check steps)
    assert ledger.clients[1].steps == 3 and ledger.clients[0].steps == 8
    assert ledger.max_epsilon == max(ledger.epsilons.values())
    rep = ledger.report()
    assert rep["clients"]["0"]["rounds"] == 3 and rep["clients"]["1"]["rounds"] == 1
    assert rep["max_epsilon"] == ledger.max_epsilon


def test_target_epsilon_calibration_is_met_after_planned_steps():
    cfg, task, part, g = _setup(epsilon=2.0, rounds=2, local_steps=2)
    c = build_client(cfg, task, part, 0)
    for rnd in (1, 2):
        u = c.fit(g, rnd)
    assert u.epsilon <= 2.0 + 0.02  # opacus calibrates to within epsilon_tolerance=0.01
    assert u.epsilon > 1.8


def test_one_privacy_engine_per_client_and_no_hook_growth():
    cfg, task, part, g = _setup()
    c = build_client(cfg, task, part, 0)
    engine, optimizer, module = c.engine, c.optimizer, c.module
    lin = c.peft_model.base_model.model.classifier.modules_to_save["default"]
    hooks_before = (len(lin._forward_hooks), len(lin._backward_hooks))
    for rnd in (1, 2, 3):
        c.fit(g, rnd)
    assert c.engine is engine and c.optimizer is optimizer and c.module is module
    assert (len(lin._forward_hooks), len(lin._backward_hooks)) == hooks_before


def test_returned_state_is_a_clone_and_global_is_untouched():
    cfg, task, part, g = _setup()
    g_copy = {k: v.clone() for k, v in g.items()}
    c = build_client(cfg, task, part, 0)
    u = c.fit(g, 1)
    assert _same(g, g_copy), "fit must not write into the global state"
    assert not _same(u.state, g), "training must move the adapter"
    ptrs = {p.data_ptr() for p in c.params.values()}
    assert all(t.data_ptr() not in ptrs for t in u.state.values())
    assert u.num_examples == len(part.indices[0]) and u.steps == 3 and math.isfinite(u.loss)


@pytest.mark.parametrize(
    ("algo", "k", "moved"),
    [("la-lora", 1, "B"), ("la-lora", 2, "AB"), ("ffa-lora", 3, "B"), ("dp-lora", 1, "AB")],
)
def test_alternation_mode_decides_which_factor_moves(algo, k, moved):
    cfg, task, part, g = _setup(algo=algo, local_steps=k)
    c = build_client(cfg, task, part, 0)
    u = c.fit(g, 1)
    a0, b0, h0 = _split(g)
    a1, b1, h1 = _split(u.state)
    assert _same(a0, a1) == ("A" not in moved)
    assert _same(b0, b1) == ("B" not in moved)
    assert not _same(h0, h1), "the classifier head trains every step"


def test_rolora_trains_one_factor_per_round():
    cfg, task, part, g = _setup(algo="rolora", local_steps=2)
    c = build_client(cfg, task, part, 0)
    a0, b0, _ = _split(g)
    a1, b1, _ = _split(c.fit(g, 1).state)  # federated round 1 (1-based): first factor B
    assert _same(a0, a1) and not _same(b0, b1)
    a2, b2, _ = _split(c.fit(g, 2).state)  # round 2: A
    assert not _same(a0, a2) and _same(b0, b2)


def test_default_noise_is_fresh_os_entropy_not_a_function_of_the_seeds(monkeypatch):
    """Two fresh clients, same (seed, client, round): different noise and Poisson draws by default, so
    whoever knows the run's seed cannot regenerate them; identical only with the explicit opt-in."""
    cfg, task, part, g = _setup(algo="dp-lora", local_steps=1)

    def public_seeds(*a, **k):
        raise AssertionError("default noise must not be derived from (seed, client, round)")

    with monkeypatch.context() as m:
        m.setattr(client_mod, "round_seeds", public_seeds)
        c1, c2 = build_client(cfg, task, part, 0), build_client(cfg, task, part, 0)
        u1, u2 = c1.fit(g, 1), c2.fit(g, 1)
    assert not _same(u1.state, u2.state)
    assert not torch.equal(c1._noise_gen.get_state(), c2._noise_gen.get_state())
    assert not torch.equal(c1._sampler_gen.get_state(), c2._sampler_gen.get_state())
    # opt-in: a pure function of the public seeds (hence the warning)
    cfg_r = dataclasses.replace(cfg, reproducible_noise=True)
    with pytest.warns(ReproducibleNoiseWarning, match="not private against whoever knows the seed"):
        r1, r2 = build_client(cfg_r, task, part, 0), build_client(cfg_r, task, part, 0)
    assert _same(r1.fit(g, 1).state, r2.fit(g, 1).state)


def test_replayed_or_older_round_is_refused_and_spends_nothing():
    cfg, task, part, g = _setup(local_steps=1)
    c = build_client(cfg, task, part, 0)
    c.fit(g, 2)
    hist, params = c.history, {k: v.detach().clone() for k, v in c.params.items()}
    with pytest.raises(ReplayedRoundError, match="round 2 requested but round 2 was already run"):
        c.fit(g, 2)
    with pytest.raises(ReplayedRoundError):
        c.fit(g, 1)
    with pytest.raises(ValueError, match="1-based"):
        c.fit(g, 0)
    assert c.history == hist and c.last_round == 2 and _same(params, {k: v.detach() for k, v in c.params.items()})
    # the last round survives a rebuild (Flower: one process per message)
    rebuilt = build_client(cfg, task, part, 0)
    rebuilt.load_state_dict(c.state_dict())
    with pytest.raises(ReplayedRoundError):
        rebuilt.fit(g, 2)
    assert rebuilt.fit(g, 3).round == 3 and rebuilt.last_round == 3


@pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")
def test_rebuilt_client_with_restored_state_reproduces_the_round():
    """The Flower path: a fresh process rebuilds the client and restores its accountant history
    (bit-exact only with the reproducible_noise opt-in)."""
    cfg, task, part, g = _setup(filter="binomial5", reproducible_noise=True)
    live = build_client(cfg, task, part, 1)
    live.fit(g, 1)
    rebuilt = build_client(cfg, task, part, 1)
    rebuilt.load_state_dict(live.state_dict())
    u_live, u_rebuilt = live.fit(g, 2), rebuilt.fit(g, 2)
    assert _same(u_live.state, u_rebuilt.state)
    assert u_live.history == u_rebuilt.history and u_live.epsilon == u_rebuilt.epsilon
    other_round = build_client(cfg, task, part, 1).fit(g, 3)
    assert not _same(u_live.state, other_round.state), "rounds must draw different noise"


def test_empty_poisson_batch_still_takes_a_noisy_accounted_step():
    cfg, task, part, g = _setup(algo="dp-lora")
    c = build_client(cfg, task, part, 0)
    c.fit(g, 1, local_steps=1)
    before = {k: v.detach().clone() for k, v in c.params.items()}
    steps_before = sum(h[2] for h in c.history)
    c._empty_step()
    assert sum(h[2] for h in c.history) == steps_before + 1
    assert not _same(before, {k: v.detach() for k, v in c.params.items()}), "noise must still be applied"


def test_history_helpers():
    assert normalize_history([(1.0, 0.1, 2), (1.0, 0.1, 3), (0.5, 0.1, 0), (0.5, 0.2, 1)]) == [
        (1.0, 0.1, 5),
        (0.5, 0.2, 1),
    ]
    assert epsilon_from_history([], DELTA) == 0.0
    acc = RDPAccountant()
    acc.history = [(1.1, 0.05, 40)]
    assert epsilon_from_history([(1.1, 0.05, 40)], DELTA, "rdp") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    with pytest.raises(ValueError, match="sample_rate"):
        normalize_history([(1.0, 0.0, 1)])
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(0.0)


def test_config_validation_and_flat_round_trip():
    from peft_lalora.federated.client.dp_client import ClientConfig

    with pytest.raises(ValueError, match="exactly one"):
        ClientConfig()
    with pytest.raises(ValueError, match="planned_steps"):
        ClientConfig(target_epsilon=1.0)
    with pytest.raises(ValueError, match="ghost"):
        ClientConfig(noise_multiplier=1.0, grad_sample_mode="ghost")
    with pytest.raises(ValueError, match="exclude"):
        ClientConfig(noise_multiplier=1.0, secure_mode=True, reproducible_noise=True)
    assert ClientConfig(noise_multiplier=1.0).reproducible_noise is False
    assert FederationConfig().reproducible_noise is False
    assert client_config(FederationConfig()).reproducible_noise is False
    assert FederationConfig().task == "text"  # the user's own model and data by default
    assert client_config(FederationConfig.from_dict({"reproducible-noise": "true"})).reproducible_noise is True
    cfg = FederationConfig.from_dict(
        {"num-clients": "3", "alpha": 1, "weighted": "false", "result-path": "/x"}, extra_keys=["result-path"]
    )
    assert (cfg.num_clients, cfg.alpha, cfg.weighted) == (3, 1.0, False)
    assert isinstance(cfg.alpha, float)
    assert FederationConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="algo"):
        FederationConfig(algo="lora")
    with pytest.raises(ValueError, match="needs group_column"):
        FederationConfig(partition="group")
    cfg_group = FederationConfig(task=TINY, partition="group")
    with pytest.raises(ValueError, match="no group column"):
        build_partition(cfg_group, build_task(cfg_group))
    assert client_config(cfg).planned_steps == cfg.rounds * cfg.local_steps


def test_a_client_without_noise_is_refused_unless_opted_in():
    """The engine only warns at noise 0 (a drop-in for Opacus); a federated client must not send such updates."""
    from peft_lalora.federated.client.dp_client import ClientConfig

    with pytest.raises(ValueError, match="allow_non_private"):
        ClientConfig(noise_multiplier=0.0)
    assert ClientConfig(noise_multiplier=0.0, allow_non_private=True).allow_non_private


def test_privacy_parameters_calibrate_with_the_one_noise_multiplier_function():
    from opacus.accountants.utils import get_noise_multiplier
    from opacus_spectral.accounting.calibration import noise_multiplier_for

    cc = client_mod.ClientConfig(target_epsilon=2.0, planned_steps=30, batch_size=8, delta=DELTA, accountant="rdp")
    noise_multiplier, q = client_mod.privacy_parameters(cc, 60)
    assert q == 1 / 8
    expected = dict(target_epsilon=2.0, target_delta=DELTA, sample_rate=q, steps=30, accountant="rdp")
    assert noise_multiplier == noise_multiplier_for(**expected) == get_noise_multiplier(**expected)
