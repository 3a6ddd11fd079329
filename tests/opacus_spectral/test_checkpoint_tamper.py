"""DP state that cannot lower ε: ``PrivacyEngine.load_checkpoint`` refuses an accountant history that disagrees
with the optimizer it is loaded into (σ, q) or with the step counters saved beside it, before loading anything;
a correct round trip restores the same ε."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import loader, mlp
from opacus_spectral.checkpoint import optimizer_step_count, verify_accountant_history
from torch import nn

from opacus_spectral import PrivacyEngine

NM, C, STEPS, DELTA = 1.1, 1.0, 5, 1e-5


def _run(tmp_path, steps: int = STEPS, post_hooks=None):
    """Train ``steps`` DP steps (Adam), save a checkpoint; returns (path, ε at δ)."""
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=post_hooks,
    )
    done = 0
    while done < steps:
        for x, y in dl:
            if len(x) == 0 or done == steps:
                continue
            opt.zero_grad()
            nn.functional.mse_loss(gsm(x), y).backward()
            opt.step()
            done += 1
    path = tmp_path / "ck.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=opt)
    return path, engine.get_epsilon(DELTA)


def _fresh(post_hooks=None):
    torch.manual_seed(1)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=post_hooks,
    )
    return engine, gsm, opt


def _tamper(path, edit) -> None:
    ck = torch.load(path, weights_only=True)
    ck["privacy_accountant_state_dict"]["history"] = edit(ck["privacy_accountant_state_dict"]["history"])
    torch.save(ck, path)


def test_correct_round_trip_restores_the_same_epsilon(tmp_path) -> None:
    path, eps = _run(tmp_path)
    engine, gsm, opt = _fresh()
    engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert engine.get_epsilon(DELTA) == eps
    assert sum(n for _, _, n in engine.accountant.history) == STEPS


TAMPERS = {
    "sigma x100": (lambda h: [(s * 100, q, n) for s, q, n in h], "noise_multiplier 110"),
    "sample rate /100": (lambda h: [(s, q / 100, n) for s, q, n in h], "not a whole multiple"),
    "emptied": (lambda h: [], r"counts 0 DP steps \(it is empty\)"),
    "one step removed": (lambda h: [(s, q, n - 1) for s, q, n in h], f"counts {STEPS - 1} DP steps"),
    "malformed": (lambda h: [(s, q) for s, q, n in h], "not \\(noise_multiplier, sample_rate, steps\\)"),
}


@pytest.mark.parametrize("kind", list(TAMPERS))
def test_tampered_history_is_refused_and_nothing_is_loaded(tmp_path, kind: str) -> None:
    path, eps = _run(tmp_path)
    edit, message = TAMPERS[kind]
    _tamper(path, edit)
    engine, gsm, opt = _fresh()
    before = [p.detach().clone() for p in gsm.parameters()]
    with pytest.raises(ValueError, match=message):
        engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert len(engine.accountant.history) == 0  # nothing was loaded
    assert all(torch.equal(a, b) for a, b in zip(before, gsm.parameters(), strict=True))
    assert not opt.state_dict()["state"]


def test_what_opacus_would_have_reported(tmp_path) -> None:
    """Upstream loads a σ×100 history silently and reports an ε ~50× too small."""
    import opacus

    path, eps = _run(tmp_path)
    _tamper(path, TAMPERS["sigma x100"][0])
    torch.manual_seed(1)
    model = opacus.GradSampleModule(mlp(hidden=32, d_out=4))  # the checkpoint holds the wrapped module's keys
    upstream = opacus.PrivacyEngine(accountant="prv")
    upstream.load_checkpoint(path=path, module=model)
    assert upstream.get_epsilon(DELTA) < eps / 10


def test_denoiser_step_counter_also_bounds_the_history(tmp_path) -> None:
    """SGD keeps no step counter; the pipeline's does (``post_hooks``)."""
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=[],
    )
    for x, y in dl:
        opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        opt.step()
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    _tamper(tmp_path / "ck.pt", lambda h: [])
    engine2 = PrivacyEngine(accountant="prv")
    torch.manual_seed(0)
    m2 = mlp(hidden=32, d_out=4)
    gsm2, opt2, _ = engine2.make_private(
        module=m2,
        optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=[],
    )
    with pytest.raises(ValueError, match="records 4 updates"):
        engine2.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2)


def test_loading_without_the_run_needs_its_noise_and_sample_rate(tmp_path) -> None:
    from opacus import GradSampleModule

    path, eps = _run(tmp_path)
    model = GradSampleModule(mlp(hidden=32, d_out=4))
    engine = PrivacyEngine(accountant="prv")
    with pytest.raises(ValueError, match="noise_multiplier= and sample_rate="):
        engine.load_checkpoint(path=path, module=model)
    with pytest.raises(ValueError, match="noise_multiplier 1.1"):
        engine.load_checkpoint(path=path, module=model, noise_multiplier=1.0, sample_rate=0.25)
    engine.load_checkpoint(path=path, module=model, noise_multiplier=NM, sample_rate=0.25)
    assert engine.get_epsilon(DELTA) == eps


def test_verify_accountant_history_rules() -> None:
    q = 1 / 64
    assert verify_accountant_history([(1.0, q, 3), (1.0, 2 * q, 2)], noise_multiplier=1.0, sample_rate=q) == 5
    verify_accountant_history([(1.0, q, 3), (0.5, q, 2)], noise_multiplier=None, sample_rate=q, steps=5)
    verify_accountant_history([], noise_multiplier=1.0, sample_rate=q, steps=0)
    with pytest.raises(ValueError, match="the run it belongs to took 6"):
        verify_accountant_history([(1.0, q, 5)], noise_multiplier=1.0, sample_rate=q, steps=6, where="resume")
    with pytest.raises(ValueError, match="^resume: accountant history entry 1 records noise_multiplier 0.5"):
        verify_accountant_history([(1.0, q, 3), (0.5, q, 2)], noise_multiplier=1.0, sample_rate=q, where="resume")
    with pytest.raises(ValueError, match="sample rate 0.0234375"):
        verify_accountant_history([(1.0, 1.5 * q, 1)], noise_multiplier=1.0, sample_rate=q)
    with pytest.raises(ValueError, match="records 4 updates"):
        verify_accountant_history([(1.0, q, 3)], noise_multiplier=1.0, sample_rate=q, min_steps=4)
    for bad in ([(1.0, q, 0)], [(1.0, 0.0, 1)], [(float("nan"), q, 1)], [(1.0, q, True)], [(1.0, q, 1.0)]):
        with pytest.raises(ValueError, match="not \\(noise_multiplier, sample_rate, steps\\)"):
            verify_accountant_history(bad, noise_multiplier=None, sample_rate=None)
    with pytest.raises(ValueError, match="not a list"):
        verify_accountant_history({"history": []}, noise_multiplier=None, sample_rate=None)


def test_optimizer_step_count() -> None:
    p = nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([p], lr=0.1)
    assert optimizer_step_count(adam.state_dict()) == 0
    for _ in range(3):
        p.grad = torch.ones(2)
        adam.step()
    assert optimizer_step_count(adam.state_dict()) == 3
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    sgd.step()
    assert optimizer_step_count(sgd.state_dict()) == 0
