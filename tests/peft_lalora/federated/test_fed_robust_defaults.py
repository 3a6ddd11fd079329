"""Robust by default: a trimmed mean that trims nothing is an error, an absurd update is bounded without any
opt-in (and no honest update is clipped), and meta / sparse updates are rejected with the client and tensor.

Before: ``aggregation="trimmed_mean"`` at the default trim 0.1 with fewer than 10 clients trimmed
``int(0.1·n) = 0`` and one client moved the global adapter at will; ``max_update_norm`` was off unless set;
meta and sparse tensors raised deep inside the aggregation."""

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
from peft_lalora.federated.server.rounds import FederationServer  # noqa: E402
from peft_lalora.federated.server.update_bound import adam_step_bound, honest_update_norm  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning"),
]
TINY = "fed_tiny:tiny"
G0 = {"m.lora_A.w": torch.zeros(2, 3), "m.lora_B.w": torch.ones(3, 2), "head.w": torch.zeros(2)}
HONEST = [{k: v + d for k, v in G0.items()} for d in (0.1, 0.2, 0.3, 0.4)]
EVIL = {k: v + 1e6 for k, v in G0.items()}


def _norm(a, b) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in b))


# ---------------------------------------------------------------------------------------------- trimmed mean
def test_a_trimmed_mean_that_trims_nothing_is_a_config_error_naming_what_it_needs():
    with pytest.raises(
        ValueError,
        match=r"8 of num_clients=8 .* int\(0\.1·8\) = 0 .* needs at least 10 clients per "
        r"round, or trim_fraction >= 0\.125",
    ):
        FederationConfig(aggregation="trimmed_mean", num_clients=8)
    with pytest.raises(ValueError, match=r"5 of num_clients=10 .* needs at least 10 clients per round"):
        FederationConfig(aggregation="trimmed_mean", num_clients=10, fraction=0.5)
    with pytest.raises(ValueError, match="a trimmed mean needs at least 3 updates"):
        FederationConfig(aggregation="trimmed_mean", num_clients=2, trim_fraction=0.4)
    FederationConfig(aggregation="trimmed_mean", num_clients=10)  # int(0.1·10) = 1 per end
    FederationConfig(aggregation="trimmed_mean", num_clients=8, trim_fraction=0.125)


def test_a_trimmed_mean_that_trims_nothing_fails_the_aggregation_instead_of_averaging_the_outlier():
    """Five updates at trim 0.1: before, int(0.5) = 0 were trimmed and the 1e6 update moved the mean by 2e5."""
    with pytest.raises(
        AggregationError,
        match=r"int\(0\.1·5\) = 0 .* needs at least 10 clients per round, or "
        r"trim_fraction >= 0\.2",
    ):
        fedavg([*HONEST, EVIL], global_state=G0, rule="trimmed_mean")
    # rejections count: 5 sent, one NaN, 4 valid at trim 0.2 trims int(0.8) = 0
    nan = {k: torch.full_like(v, math.nan) for k, v in G0.items()}
    with pytest.raises(AggregationError, match=r"4 valid update\(s\) of 5: .* int\(0\.2·4\) = 0") as err:
        fedavg([*HONEST[:3], EVIL, nan], global_state=G0, rule="trimmed_mean", trim_fraction=0.2)
    assert [r.index for r in err.value.rejected] == [4]
    with pytest.raises(ValueError, match="trim_fraction=0 trims nothing"):
        fedavg(HONEST, rule="trimmed_mean", trim_fraction=0.0)
    res = fedavg([*HONEST, EVIL], global_state=G0, rule="trimmed_mean", trim_fraction=0.2)  # trims 1 per end
    assert _norm(res.state, G0) < _norm(HONEST[-1], G0)


# ---------------------------------------------------------------------------------------------- default bound
def test_the_adam_bound_is_the_exact_supremum_of_one_step_and_holds_for_five():
    torch.manual_seed(0)
    assert adam_step_bound(1) == pytest.approx(1.0, rel=1e-12)
    assert [round(adam_step_bound(t), 4) for t in (2, 5)] == [1.0014, 1.0108]
    p = torch.nn.Parameter(torch.randn(1000))
    start = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0)
    worst = 0.0
    for t in range(1, 6):
        p.grad = torch.randn(1000) * (10.0 if t % 2 else 1e-3)  # alternating huge / tiny gradients
        opt.step()
        worst = max(worst, float((p.detach() - start).norm()))
        assert worst <= 1e-2 * math.sqrt(1000) * sum(adam_step_bound(s) for s in range(1, t + 1)) * (1 + 1e-5)
    assert worst >= 0.99 * 1e-2 * math.sqrt(1000)  # one step of any gradient already moves ≈ lr per coordinate


@pytest.fixture(scope="module")
def tiny_task():
    from peft_lalora.federated.builders import build_task

    return build_task(FederationConfig(**ROBUST))


ROBUST = dict(
    task=TINY,
    num_clients=3,
    rounds=2,
    local_steps=3,
    batch_size=8,
    n_train=48,
    n_test=16,
    alpha=1.0,
    epsilon=5.0,
    seed=2,
    filter="binomial5",
)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_absurd_update_is_bounded_by_default_and_no_honest_one_is_clipped(optimizer, tiny_task, monkeypatch):
    """Client 2 adds 1e4 to every entry of its real DP update; nothing is opted in."""
    cfg = FederationConfig(**ROBUST, optimizer=optimizer)
    assert cfg.max_update_norm == 0 and cfg.auto_update_norm
    real_build = simulation_mod.build_client

    def build(cfg_, task, part, c):
        client = real_build(cfg_, task, part, c)
        if c == 2:
            fit = client.fit

            def absurd_fit(g, rnd, *a, **k):
                update = fit(g, rnd, *a, **k)
                update.state = {key: v + 1e4 for key, v in update.state.items()}
                return update

            client.fit = absurd_fit
        return client

    monkeypatch.setattr(simulation_mod, "build_client", build)
    states = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = simulation_mod.run_simulation(
            cfg, progress=False, task=tiny_task, on_round=lambda r, s: states.append(dict(s))
        )
    assert [r.clipped for r in res.rounds] == [[2], [2]]  # the absurd client every round, never an honest one
    assert all(r.update_bound > 0 and r.error is None for r in res.rounds)
    # a weighted mean of updates no longer than the bound moves the global adapter by at most the bound
    assert _norm(states[1], states[0]) <= res.rounds[1].update_bound * (1 + 1e-6)
    assert max(float(v.abs().max()) for v in res.state.values()) < 10  # before: ≈ 1e4 / 3 per entry


def test_the_default_bound_follows_the_run_and_no_bound_at_all_warns():
    sizes, privacy = [30, 10], {0: (1.0, 0.1), 1: (1.0, 0.25)}
    cfg = FederationConfig(task=TINY, num_clients=2, local_steps=3, epsilon=0, noise_multiplier=1.0)
    server = FederationServer(cfg, G0, sizes, privacy)
    server.start_round(1)
    for c, d in ((0, 0.01), (1, 1e4)):
        server.receive(c, state={k: v + d for k, v in G0.items()}, history=[(1.0, privacy[c][1], 3)])
    record = server.finish_round()
    expected = max(honest_update_norm(cfg, G0, n, *privacy[c]) for c, n in enumerate(sizes))
    assert record.update_bound == pytest.approx(expected) and record.clipped == [1]
    core = 5e-3 * math.sqrt(14) * sum(adam_step_bound(t) for t in (1, 2, 3))  # lr·√D·Σκ_t (no weight decay)
    rounding = 4 * 3 * torch.finfo(torch.float32).eps * (math.sqrt(6) + core)  # ‖G0‖ = √6
    assert expected == pytest.approx(core + rounding, rel=1e-12)
    assert _norm(server.global_state, G0) <= expected
    with pytest.warns(RuntimeWarning, match="no server-side update bound"):  # the old default, now an opt-out
        unbounded = FederationServer(
            FederationConfig(**{**cfg.to_dict(), "auto_update_norm": False}), G0, sizes, privacy
        )
    unbounded.start_round(1)
    for c, d in ((0, 0.01), (1, 1e4)):
        unbounded.receive(c, state={k: v + d for k, v in G0.items()}, history=[(1.0, privacy[c][1], 3)])
    assert unbounded.finish_round().update_bound is None and _norm(unbounded.global_state, G0) > 1e3
    explicit = FederationServer(FederationConfig(**{**cfg.to_dict(), "max_update_norm": 2.5}), G0, sizes, privacy)
    explicit.start_round(1)
    assert explicit.finish_round().update_bound == 2.5


# ---------------------------------------------------------------------------------------------- meta / sparse
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda v: torch.empty(v.shape, device="meta"), "'m.lora_B.w' is on the meta device"),
        (lambda v: v.to_sparse(), "'m.lora_B.w' has layout torch.sparse_coo: only dense tensors"),
        (lambda v: v.to_sparse_csr(), "'m.lora_B.w' has layout torch.sparse_csr: only dense tensors"),
    ],
)
def test_meta_and_sparse_updates_are_rejected_naming_the_client_and_the_tensor(make, reason):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: sparse CSR support is in beta
        bad = {**HONEST[0], "m.lora_B.w": make(HONEST[0]["m.lora_B.w"])}
        for global_state in (G0, None):  # with a global state, and voted reference (the bad one comes first)
            res = fedavg([bad, HONEST[1]], global_state=global_state, client_ids=["bad", "ok"])
            assert [(r.client, reason in r.reason) for r in res.rejected] == [("bad", True)]
            assert res.accepted == [1] and all(v.device.type == "cpu" for v in res.state.values())
        server = FederationServer(
            FederationConfig(task=TINY, num_clients=2, epsilon=0), G0, [30, 10], {0: (1.0, 0.1), 1: (1.0, 0.25)}
        )
        server.start_round(1)
        server.receive(0, state=bad, history=[(1.0, 0.1, 5)])
        record = server.finish_round()
    assert record.error is not None and record.rejected[0]["client"] == 0 and reason in record.rejected[0]["reason"]
