"""The privacy record a DP-trained model carries (docs/engine.md, "The privacy record"): a new engine on a trained
model continues ε (composes) unless the user states a new privacy unit, the same engine never counts twice, the
record survives a save and load, and an edited record file is refused."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from engine_helpers import loader, mlp
from opacus_spectral.accounting import privacy_record_of, read_privacy_record
from opacus_spectral.accounting.record import RECORD_FILE, noise_multiplier_after, run_history
from opacus_spectral.errors import ComposedPrivacyWarning
from torch import nn

from opacus_spectral import PrivacyEngine, epsilon_from_history, load_privacy_record, save_privacy_record

DELTA, Q = 1e-5, 0.25  # 64 examples, batches of 16


def model() -> nn.Module:
    return mlp(d_in=16, hidden=8, d_out=4)


def train(engine: PrivacyEngine, net: nn.Module, steps: int, sigma: float, **kw) -> nn.Module:
    """``steps`` DP-SGD steps of the tiny regression task through ``engine.make_private``; the wrapped model (which
    the next engine takes: Opacus refuses to hook the same model twice)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    module, opt, dl = engine.make_private(
        module=net, optimizer=opt, data_loader=loader(d_out=4), noise_multiplier=sigma, max_grad_norm=1.0, **kw
    )
    batches = iter(dl)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()
    return module


def rdp() -> PrivacyEngine:
    return PrivacyEngine(accountant="rdp")


@pytest.fixture
def trained():
    """A model after 3 steps at σ = 1 through engine A; its history."""
    a = rdp()
    net = train(a, model(), 3, 1.0)
    assert a.accountant.history == [(1.0, Q, 3)]
    return net, a


def test_a_new_engine_on_a_trained_model_continues_epsilon(trained):
    net, _ = trained
    b = rdp()
    with pytest.warns(ComposedPrivacyWarning, match="1 earlier DP run"):
        train(b, net, 2, 1.3)
    composed = epsilon_from_history([(1.0, Q, 3), (1.3, Q, 2)], DELTA, "rdp")
    alone = epsilon_from_history([(1.3, Q, 2)], DELTA, "rdp")
    assert b.get_epsilon(DELTA) == composed > alone + 1  # not a restart from 0
    record = privacy_record_of(net)
    assert [r.history for r in record.runs] == [((1.0, Q, 3),), ((1.3, Q, 2),)]
    assert [r.unit for r in record.runs] == [0, 0] and record.epsilon(DELTA, "rdp") == composed


def test_same_noise_merges_in_the_accountant_but_the_runs_stay_apart(trained):
    """Opacus merges a step of the same (σ, q) into the last entry: the record still splits the runs right."""
    net, _ = trained
    b = rdp()
    with pytest.warns(ComposedPrivacyWarning):
        train(b, net, 2, 1.0)
    assert b.accountant.history == [(1.0, Q, 5)]
    assert [r.history for r in privacy_record_of(net).runs] == [((1.0, Q, 3),), ((1.0, Q, 2),)]
    assert run_history([(1.0, Q, 5), (2.0, Q, 1)], [(1.0, Q, 3)]) == [(1.0, Q, 2), (2.0, Q, 1)]
    with pytest.raises(ValueError, match="does not start with"):
        run_history([(1.0, Q, 2)], [(1.0, Q, 3)])


def test_new_privacy_unit_starts_from_zero_and_keeps_the_earlier_runs(trained):
    net, _ = trained
    b = rdp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComposedPrivacyWarning)
        train(b, net, 2, 1.3, new_privacy_unit=True)
    assert b.get_epsilon(DELTA) == epsilon_from_history([(1.3, Q, 2)], DELTA, "rdp")
    record = privacy_record_of(net)
    assert [(r.unit, r.steps) for r in record.runs] == [(0, 3), (1, 2)]
    assert record.epsilon(DELTA, "rdp", unit=1) == b.get_epsilon(DELTA)


def test_the_same_engine_again_counts_nothing_twice(trained):
    net, a = trained
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComposedPrivacyWarning)
        train(a, net, 2, 1.0)
    assert a.accountant.history == [(1.0, Q, 5)]
    assert [r.steps for r in privacy_record_of(net).runs] == [5]
    with pytest.raises(ValueError, match="needs a new PrivacyEngine"):
        train(a, net, 1, 1.0, new_privacy_unit=True)


def test_a_shuffled_run_is_recorded_as_such_and_composes():
    """poisson_sampling=False is charged by the un-amplified bound (one Gaussian mechanism per pass, q = 1): the
    record names the sampler and a Poisson run after it composes with that history."""
    a = rdp()
    with pytest.warns(UserWarning):
        net = train(a, model(), 4, 1.0, poisson_sampling=False)  # one pass over the 64 records
    (run,) = privacy_record_of(net).runs
    assert (run.sampler, run.history) == ("shuffle", tuple(a.accountant.history)) == ("shuffle", ((1.0, 1.0, 1),))
    b = rdp()
    with pytest.warns(ComposedPrivacyWarning):
        train(b, net, 2, 1.3)
    assert b.get_epsilon(DELTA) == epsilon_from_history([(1.0, 1.0, 1), (1.3, Q, 2)], DELTA, "rdp")
    assert [r.sampler for r in privacy_record_of(net).runs] == ["shuffle", "poisson"]


def test_gdp_cannot_compose_and_is_refused(trained):
    net, _ = trained
    with pytest.raises(ValueError, match="gdp accountant cannot compose"):
        train(PrivacyEngine(accountant="gdp"), net, 1, 1.0)


def test_save_then_load_into_a_fresh_model_composes(trained, tmp_path):
    net, a = trained
    with pytest.raises(ValueError, match="needs delta="):
        save_privacy_record(net, tmp_path)
    save_privacy_record(net, tmp_path, delta=DELTA)
    data = json.loads((tmp_path / RECORD_FILE).read_text())
    assert set(data) == {"format", "version", "runs", "sha256"}
    (run,) = data["runs"]
    assert {k: run[k] for k in run if k != "id"} == {
        "unit": 0,
        "history": [[1.0, Q, 3]],
        "sampler": "poisson",
        "mechanism": "gaussian",
        "accountant": "rdp",
        "delta": DELTA,
        "dataset_size": 64,
    }
    save_privacy_record(a, tmp_path / "engine")  # the engine's last make_private: the same record
    assert read_privacy_record(tmp_path / "engine") == read_privacy_record(tmp_path)
    fresh = model()
    load_privacy_record(fresh, tmp_path)
    b = rdp()
    prior = epsilon_from_history([(1.0, Q, 3)], DELTA, "rdp")
    with pytest.warns(ComposedPrivacyWarning, match=f"epsilon = {prior:.4g} at delta = 1e-05"):
        train(b, fresh, 2, 1.3)
    assert b.get_epsilon(DELTA) == epsilon_from_history([(1.0, Q, 3), (1.3, Q, 2)], DELTA, "rdp")


def _edit_steps(d):
    d["runs"][0]["history"][0][2] = 1


def _drop_run(d):
    d["runs"].pop()


def _drop_all(d):
    d["runs"] = []


def _zero_steps(d):
    d["runs"][0]["history"][0][2] = 0


@pytest.mark.parametrize(
    ("edit", "rehash", "match"),
    [
        (_edit_steps, False, "edited after it was written"),
        (_drop_run, False, "edited after it was written"),
        (_drop_all, True, "lists no DP run"),
        (_zero_steps, True, "steps >= 1"),
        (lambda d: d["runs"][0].update(sampler="weighted"), True, "sampler must be one of"),
        (lambda d: d["runs"][0].update(extra=1), True, "exactly the keys"),
        (lambda d: d.update(version=2), True, "this version reads"),
    ],
)
def test_an_edited_record_is_refused(trained, tmp_path, edit, rehash, match):
    net, _ = trained
    b = rdp()
    with pytest.warns(ComposedPrivacyWarning):
        train(b, net, 1, 1.3)  # two runs
    save_privacy_record(net, tmp_path, delta=DELTA)
    path = tmp_path / RECORD_FILE
    data = json.loads(path.read_text())
    edit(data)
    if rehash:  # a consistent edit of the digest too: the field checks still refuse it
        from opacus_spectral.accounting.record import _digest

        data["sha256"] = _digest({k: data[k] for k in ("format", "version", "runs")})
    path.write_text(json.dumps(data))
    fresh = model()
    with pytest.raises(ValueError, match=match):
        load_privacy_record(fresh, tmp_path)
    assert privacy_record_of(fresh) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (lambda t: t[: len(t) // 2], "not a valid privacy record"),
        (lambda t: t.replace("0.25", "NaN", 1), "not a number a privacy record may hold"),
        (lambda t: t.replace('"unit": 0', '"unit": 0, "unit": 0', 1), "a key appears twice"),
    ],
)
def test_a_broken_record_file_is_refused(trained, tmp_path, text, match):
    net, _ = trained
    save_privacy_record(net, tmp_path, delta=DELTA)
    path = tmp_path / RECORD_FILE
    path.write_text(text(path.read_text()))
    with pytest.raises(ValueError, match=match):
        read_privacy_record(tmp_path)
    with pytest.raises(FileNotFoundError, match="privacy it spent is unknown"):
        read_privacy_record(tmp_path / "empty")


def test_loading_merges_by_run_and_refuses_a_model_already_training(trained, tmp_path):
    net, _ = trained
    save_privacy_record(net, tmp_path / "r1", delta=DELTA)
    load_privacy_record(net, tmp_path / "r1")  # the run it is training: nothing new
    other = model()
    train(rdp(), other, 1, 2.0)
    save_privacy_record(other, tmp_path / "r2", delta=DELTA)
    with pytest.raises(ValueError, match="load the privacy record before make_private"):
        load_privacy_record(net, tmp_path / "r2")
    fresh = model()
    load_privacy_record(fresh, tmp_path / "r1")
    load_privacy_record(fresh, tmp_path / "r1")  # the same run twice: once
    record = load_privacy_record(fresh, tmp_path / "r2")
    assert sorted(r.steps for r in record.runs) == [1, 3]


def test_calibration_with_a_prior_keeps_the_total_within_the_target():
    prior = [(1.0, Q, 3)]
    kw = dict(target_delta=DELTA, sample_rate=Q, steps=4, accountant="rdp")
    sigma = noise_multiplier_after(prior, target_epsilon=8.0, **kw)
    assert 8.0 - 0.01 <= epsilon_from_history([*prior, (sigma, Q, 4)], DELTA, "rdp") <= 8.0
    with pytest.raises(ValueError, match="already spends epsilon"):
        noise_multiplier_after(prior, target_epsilon=2.0, **kw)
    with pytest.raises(ValueError, match="cannot use the gdp accountant"):
        noise_multiplier_after(prior, target_epsilon=8.0, **{**kw, "accountant": "gdp"})
    with pytest.raises(ValueError, match="steps must be"):
        noise_multiplier_after(prior, target_epsilon=8.0, **{**kw, "steps": 2.5})


def test_make_private_with_epsilon_on_a_trained_model_keeps_the_composed_target(trained):
    """Before, σ was calibrated as if from zero: a target of 6 after a 3-step prior ended at 6.81."""
    net, _ = trained
    b = rdp()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with pytest.warns(ComposedPrivacyWarning):
        module, opt, dl = b.make_private_with_epsilon(
            module=net,
            optimizer=opt,
            data_loader=loader(d_out=4),
            target_epsilon=6.0,
            target_delta=DELTA,
            epochs=2,
            max_grad_norm=1.0,
        )
    for _ in range(2):  # the two epochs calibrated for
        for x, y in dl:
            opt.zero_grad()
            nn.functional.mse_loss(module(x), y).backward()
            opt.step()
    composed = epsilon_from_history([(1.0, Q, 3), (opt.noise_multiplier, Q, 8)], DELTA, "rdp")
    assert b.accountant.history[-1][2] == 8 and 5.9 <= b.get_epsilon(DELTA) == composed <= 6.0


def test_a_record_of_disjoint_units_is_bounded_by_its_worst_unit_and_writes_only_with_every_delta(tmp_path):
    """A record whose runs lie in different privacy units (a federation's clients): any one record is protected by
    its own unit's ε, the largest of which is ``worst_epsilon``; composing every run is a looser bound."""
    from opacus_spectral.accounting import PrivacyRecord, PrivacyRun, write_privacy_record

    a, b = ((1.0, 0.1, 50),), ((0.8, 0.1, 50), (1.0, 0.05, 20))
    runs = (PrivacyRun("a" * 32, 0, a, delta=1e-5), PrivacyRun("b" * 32, 1, b, delta=1e-5))
    record = PrivacyRecord(runs)
    worst = max(epsilon_from_history(list(h), 1e-5, "prv") for h in (a, b))
    assert record.worst_epsilon(1e-5) == pytest.approx(worst, rel=1e-12)
    assert (
        record.worst_epsilon(1e-5)
        < record.epsilon(1e-5)
        == pytest.approx(epsilon_from_history([*a, *b], 1e-5, "prv"), rel=1e-12)
    )
    write_privacy_record(record, tmp_path)
    assert read_privacy_record(tmp_path) == record
    with pytest.raises(ValueError, match="needs delta="):
        write_privacy_record(PrivacyRecord((PrivacyRun("c" * 32, 0, a),)), tmp_path / "x")
