"""A denoiser must never switch itself off silently: a plain callable before ``rmt`` declares no output noise, so
``rmt`` would skip every record. The pipeline warns once, naming both; ``opacus_spectral.observer`` marks a
logger as a checked pass-through, after which ``rmt`` acts."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import Identity, Recorder, loader, mlp
from opacus_spectral.denoisers.observer import Observer
from opacus_spectral.errors import DenoiserError, ReproducibleNoiseWarning
from torch import nn

import opacus_spectral
from opacus_spectral import PrivacyEngine, observer

STEPS = 3


def _train(post_hooks, steps=STEPS, **kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant="rdp", noise_seed=7)
        gsm, dp_opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=1.1,
            max_grad_norm=1.0,
            post_hooks=post_hooks,
            noise_generator=torch.Generator().manual_seed(7),
            **kwargs,
        )
        it = iter(dl)
        for _ in range(steps):
            x, y = next(it)
            dp_opt.zero_grad()
            nn.functional.mse_loss(gsm(x), y).backward()
            dp_opt.step()
    switch_off = [str(w.message) for w in caught if "acts only on isotropic noise" in str(w.message)]
    return engine, switch_off


def _rmt_steps(engine):
    return [d.denoisers["rmt"] for d in engine.post_hooks.diagnostics.history]


def test_a_plain_logger_before_rmt_warns_once_naming_it_and_output_noise():
    calls = []

    def my_logger(grads):
        calls.append([float(g.tensor.norm()) for g in grads])

    engine, switch_off = _train([my_logger, "rmt"])
    assert len(calls) == STEPS
    assert all(r["skipped_noise"] == 2 and r["matrices"] == 0 for r in _rmt_steps(engine))  # rmt did nothing
    assert len(switch_off) == 1  # once per pipeline, not once per step
    msg = switch_off[0]
    assert "'rmt'" in msg and "'my_logger'" in msg and "output_noise" in msg and "observer" in msg


def test_with_observer_rmt_acts_and_nothing_warns():
    calls = []

    def my_logger(grads):
        calls.append([float(g.tensor.norm()) for g in grads])

    engine, switch_off = _train([opacus_spectral.observer(my_logger), "rmt"])
    assert len(calls) == STEPS and switch_off == []
    assert all(r["skipped_noise"] == 0 and r["matrices"] == 2 for r in _rmt_steps(engine))
    assert "my_logger" in engine.post_hooks.diagnostics.calls  # the observer carries the logger's name


def test_observer_works_as_a_decorator_and_a_declared_pass_through_never_warns():
    @observer
    def log(grads):
        pass

    assert isinstance(log, Observer) and log.name == "log" and log.output_noise([]) == 1.0
    _, switch_off = _train([log, Recorder(), "rmt"], steps=1)
    assert switch_off == []


def test_a_denoiser_subclass_without_its_own_declaration_is_named_too():
    _, switch_off = _train([Identity(), "rmt"], steps=2)
    assert len(switch_off) == 1 and "'identity'" in switch_off[0]


@pytest.mark.parametrize("abuse", ["edit", "replace", "return"])
def test_an_observer_that_changes_or_returns_something_is_a_denoiser_error(abuse):
    def sneaky(grads):
        if abuse == "edit":
            grads[0].tensor.mul_(2.0)
        elif abuse == "replace":
            grads[0].tensor = grads[0].tensor * 2.0
        else:
            return [g.tensor * 2.0 for g in grads]
        return None

    with pytest.raises(DenoiserError, match="observer 'sneaky'"):
        _train([observer(sneaky), "rmt"], steps=1)
    with pytest.raises(TypeError, match="observer"):
        observer(Identity)  # a class, not a callable on the records
