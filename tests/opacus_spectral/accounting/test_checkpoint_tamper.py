"""DP state that cannot lower ε: ``PrivacyEngine.load_checkpoint`` refuses an accountant history that disagrees
with the optimizer it is loaded into (σ, q) or with the step counters saved beside it — the engine's own count for
every optimizer (SGD keeps none), Adam's, the pipeline's — before loading anything; a correct round trip restores
the same ε. Before issue 39 an SGD checkpoint with an emptied history loaded with ε = 0 (true 3.887), one with a
step removed with 3.585, and an Adam one with both the history and the optimizer state emptied was accepted."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import loader, mlp
from opacus_spectral.accounting.checkpoint import COUNT_KEY, optimizer_step_count, verify_accountant_history
from torch import nn

from opacus_spectral import PrivacyEngine

NM, C, STEPS, DELTA = 1.1, 1.0, 5, 1e-5


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


def _run(tmp_path, steps: int = STEPS, post_hooks=None, optimizer: str = "adam"):
    """Train ``steps`` DP steps (Adam, or SGD: no step counter of its own), save a checkpoint; returns (path, ε)."""
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=OPTIMIZERS[optimizer](model.parameters()),
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


def _fresh(post_hooks=None, optimizer: str = "adam"):
    torch.manual_seed(1)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="prv")
    gsm, opt, _ = engine.make_private(
        module=model,
        optimizer=OPTIMIZERS[optimizer](model.parameters()),
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


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_correct_round_trip_restores_the_same_epsilon(tmp_path, optimizer: str) -> None:
    path, eps = _run(tmp_path, optimizer=optimizer)
    assert eps == pytest.approx(3.887, abs=1e-3)
    engine, gsm, opt = _fresh(optimizer=optimizer)
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


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(TAMPERS))
def test_tampered_history_is_refused_and_nothing_is_loaded(tmp_path, kind: str, optimizer: str) -> None:
    path, eps = _run(tmp_path, optimizer=optimizer)
    edit, message = TAMPERS[kind]
    _tamper(path, edit)
    engine, gsm, opt = _fresh(optimizer=optimizer)
    before = [p.detach().clone() for p in gsm.parameters()]
    with pytest.raises(ValueError, match=message):
        engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert len(engine.accountant.history) == 0  # nothing was loaded
    assert all(torch.equal(a, b) for a, b in zip(before, gsm.parameters(), strict=True))
    assert not opt.state_dict()["state"]


def _edit(path, edit) -> None:
    ck = torch.load(path, weights_only=True)
    edit(ck)
    torch.save(ck, path)


def _empty_history_and_optimizer_state(ck) -> None:
    ck["privacy_accountant_state_dict"]["history"] = []
    ck["optimizer_state_dict"]["state"] = {}


FILE_EDITS = {
    "history and Adam's state emptied": (_empty_history_and_optimizer_state, "records 5 updates"),
    "the engine's count removed": (lambda ck: ck.pop(COUNT_KEY), "holds no step count"),
    "history shortened, its saved length kept": (
        lambda ck: ck["privacy_accountant_state_dict"].update(history=[(NM, 0.25, 4)]),
        "counts 4 DP steps, but the state saved beside it records 5",
    ),
    "the count made inconsistent": (lambda ck: ck[COUNT_KEY].update(history_steps=3), "refusing an edited count"),
}


@pytest.mark.parametrize("kind", list(FILE_EDITS))
def test_edits_beside_the_history_are_refused(tmp_path, kind: str) -> None:
    path, _ = _run(tmp_path)
    edit, message = FILE_EDITS[kind]
    _edit(path, edit)
    engine, gsm, opt = _fresh()
    with pytest.raises(ValueError, match=message):
        engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert engine.accountant.history == [] and not opt.state_dict()["state"]


def test_a_file_from_opacus_itself_is_refused(tmp_path) -> None:
    """Vanilla Opacus saves no step count: its history cannot be cross-checked (here: SGD, nothing else counts)."""
    import opacus

    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    upstream = opacus.PrivacyEngine(accountant="prv")
    gsm, opt, _ = upstream.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
    )
    upstream.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    engine, gsm2, opt2 = _fresh(optimizer="sgd")
    with pytest.raises(ValueError, match="not written by opacus_spectral's PrivacyEngine.save_checkpoint"):
        engine.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2)


def test_a_consistent_forgery_is_not_detected(tmp_path) -> None:
    """What the checks do not protect against (docs/engine.md): a history and every count rewritten together."""
    path, eps = _run(tmp_path, optimizer="sgd")

    def forge(ck) -> None:
        ck["privacy_accountant_state_dict"]["history"] = [(NM, 0.25, 1)]
        ck[COUNT_KEY].update(dp_steps=1, charged_steps=1, history_steps=1)

    _edit(path, forge)
    engine, gsm, opt = _fresh(optimizer="sgd")
    engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert engine.get_epsilon(DELTA) < 0.7 * eps  # one step: 2.317 instead of 3.887


def test_the_count_continues_across_make_private_calls_and_resumes(tmp_path) -> None:
    """The engine's count is its own: two make_private calls on one engine add up, a load restores it, and a
    resumed run saves a file the next load accepts; a history emptied in memory cannot be saved."""
    path, _ = _run(tmp_path, steps=2, optimizer="sgd")
    engine, gsm, opt = _fresh(optimizer="sgd")
    engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
    for _ in range(2):  # two more make_private calls on the same engine, one step each
        _, opt2, dl = engine.make_private(
            module=gsm, optimizer=torch.optim.SGD(gsm.parameters(), lr=0.1), data_loader=loader(64, 16, d_out=4),
            noise_multiplier=NM, max_grad_norm=C,
        )  # fmt: skip
        x, y = next(x for x in dl if len(x[0]))
        nn.functional.mse_loss(gsm(x), y).backward()
        opt2.step()
        opt2.zero_grad()
    assert sum(n for _, _, n in engine.accountant.history) == 4
    engine.save_checkpoint(path=tmp_path / "again.pt", module=gsm, optimizer=opt2)
    assert torch.load(tmp_path / "again.pt", weights_only=True)[COUNT_KEY] == {
        "dp_steps": 4, "charged_steps": 4, "history_steps": 4, "sampling": "poisson"
    }  # fmt: skip
    _tamper(tmp_path / "again.pt", lambda h: [(s, q, n - 1) for s, q, n in h])
    with pytest.raises(ValueError, match="records 4 updates"):
        _fresh(optimizer="sgd")[0].load_checkpoint(path=tmp_path / "again.pt", module=gsm, optimizer=opt2)
    engine.accountant.history = []
    with pytest.raises(ValueError, match="history was emptied or replaced"):
        engine.save_checkpoint(path=tmp_path / "emptied.pt", module=gsm, optimizer=opt2)


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
