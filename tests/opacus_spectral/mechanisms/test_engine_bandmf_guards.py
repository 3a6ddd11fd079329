"""What BandMF's accounting does not cover, refused or charged right in the engine: coefficients of any norm are
charged σ/κ (and calibrated through it), resumes within one band get fresh noise, optimizers whose add_noise does
more than Opacus' i.i.d. draw are refused, so are a changing clipping bound, a σ changed at a resume under a noise
scheduler, and ghost clipping with loader workers."""

from __future__ import annotations

import pytest
import torch
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus_spectral.mechanisms.bandmf import BandMFMechanism
from opacus_spectral.mechanisms.realization import realize
from opacus_spectral.mechanisms.strategy import Accounting, BandedToeplitz
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

N, BATCH, DELTA = 64, 8, 1e-5
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(1))


def _private(mechanism, *, seed=3, steps=16, noise_multiplier=1.0, workers=0, model=None, data=None, **kw):
    """A private run; ``model`` (the same object across retries) and ``data`` default to a fresh model and X."""
    if model is None:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
    engine = PrivacyEngine(accountant="rdp", noise_seed=seed)
    data = TensorDataset(X, torch.arange(N)) if data is None else data
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=BATCH, num_workers=workers),
        noise_multiplier=noise_multiplier,
        max_grad_norm=1.0,
        noise_mechanism=mechanism,
        steps=steps,
        **kw,
    )
    return engine, *out


def _train(gsm, opt, dl, steps, zero=False):
    """``steps`` DP steps; each step's parameter update (with ``zero``: of a zero loss, so the released noise)."""
    updates, done = [], 0
    while done < steps:
        for xb, idx in dl:
            before = [p.detach().clone() for p in gsm.parameters()]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(gsm(xb), Y[idx])
            (loss * 0 if zero else loss).backward()
            opt.step()
            updates.append(
                torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(gsm.parameters(), before, strict=True)])
            )
            done += 1
            if done == steps:
                break
    return updates


@pytest.mark.parametrize("bad", [[float("inf"), 0.0], [float("nan"), 0.5], [0.0, 1.0], [-0.6, 0.8]])
def test_coefficients_that_are_not_finite_or_have_c0_not_positive_are_refused(bad):
    with pytest.raises(ValueError, match="finite coefficients with c_0 > 0"):
        BandMFMechanism(bands=2, coefficients=bad)


def test_given_coefficients_are_charged_sigma_over_kappa():
    """c = (4, 3): κ = 5, the released noise is M⁻¹z with std σC/4 at the first step, and the accountant is charged
    DP-SGD with σ/5 (not σ): at σ = 2, (0.4, 2q) every 2 steps — computed by the engine from the coefficients."""
    realized = realize(BandMFMechanism(bands=2, coefficients=[4.0, 3.0]), steps=10, sample_rate=0.1, dataset_size=100)
    assert realized.kappa == 5.0
    assert realized.accounting(2.0, 0.1) == Accounting(0.4, 0.2, 2)
    engine, gsm, opt, dl = _private(("bandmf", {"bands": 2, "coefficients": [4.0, 3.0]}), noise_multiplier=2.0)
    _train(gsm, opt, dl, 4)
    assert engine.accountant.history == [(0.4, 2 / 8, 2)]
    assert BandedToeplitz((0.8, 0.6)).kappa == 1.0


def test_target_epsilon_is_calibrated_through_kappa():
    """make_private_with_epsilon with coefficients of norm 5 chooses 5× the σ of normalized ones (the charged σ/κ is
    what meets the target), and the run ends at the target."""
    runs = {}
    for name, coefs in (("unit", [0.8, 0.6]), ("kappa5", [4.0, 3.0])):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        engine = PrivacyEngine(accountant="rdp", noise_seed=3)
        gsm, opt, dl = engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(X, torch.arange(N)), batch_size=BATCH),
            target_epsilon=3.0,
            target_delta=DELTA,
            epochs=2,
            max_grad_norm=1.0,
            noise_mechanism=("bandmf", {"bands": 2, "coefficients": coefs}),
        )
        _train(gsm, opt, dl, 16)
        runs[name] = (opt.noise_multiplier, engine.get_epsilon(DELTA))
    assert runs["kappa5"][0] == pytest.approx(5 * runs["unit"][0], rel=1e-9)
    assert runs["kappa5"][1] == pytest.approx(runs["unit"][1], rel=1e-9)
    assert 2.9 < runs["unit"][1] <= 3.0


def test_resumes_within_one_band_do_not_replay_the_noise(tmp_path):
    """With noise_seed, runs resumed at DP steps 5 and 6 (one accountant charge apart: ⌈5/4⌉ = ⌈6/4⌉) draw different
    noise: the difference of their first updates (zero loss: the noise itself) is not 0."""
    engine, gsm, opt, dl = _private(("bandmf", {"bands": 4}))
    _train(gsm, opt, dl, 5)
    engine.save_checkpoint(path=tmp_path / "a.pt", module=gsm, optimizer=opt)
    _train(gsm, opt, dl, 1)
    engine.save_checkpoint(path=tmp_path / "b.pt", module=gsm, optimizer=opt)
    first = []
    for name in ("a.pt", "b.pt"):
        resumed, gsm2, opt2, dl2 = _private(("bandmf", {"bands": 4}))
        resumed.load_checkpoint(path=tmp_path / name, module=gsm2, optimizer=opt2)
        assert resumed.accountant.history == [(1.0, 0.5, 2)]
        first.append(_train(gsm2, opt2, dl2, 1, zero=True)[0])
    assert float((first[0] - first[1]).abs().max()) > 1e-3


def test_adaptive_clipping_is_refused_before_the_model_is_hooked():
    """AdaClip's add_noise also noises the unclipped count that moves C: replacing it would move C by the exact
    count, within a band. Refused before Opacus hooks the model: a retry with flat clipping on it works."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def private(**kw):
        return _private(("bandmf", {"bands": 4}), seed=None, model=model, **kw)[1:]

    with pytest.raises(ValueError, match="adds noise its own way"):
        private(
            clipping="adaptive",
            target_unclipped_quantile=0.5,
            clipbound_learning_rate=0.2,
            max_clipbound=10.0,
            min_clipbound=0.01,
            unclipped_num_std=5.0,
        )
    gsm, opt, dl = private()
    _train(gsm, opt, dl, 1)


def test_a_clipping_bound_that_changes_during_the_run_is_refused():
    _, gsm, opt, dl = _private(("bandmf", {"bands": 4}))
    _train(gsm, opt, dl, 2)
    before = [p.detach().clone() for p in gsm.parameters()]
    opt.max_grad_norm = 2.0  # what a clipping scheduler would do
    with pytest.raises(ValueError, match="one clipping bound"):
        _train(gsm, opt, dl, 1)
    assert all(torch.equal(a, p) for a, p in zip(before, gsm.parameters(), strict=True))


def test_a_resume_with_another_sigma_is_refused_also_with_a_noise_scheduler(tmp_path):
    """The band spanning the resume is charged once, at the σ before it: a scheduler argument does not lift the σ
    check under BandMF, and without an optimizer or noise_multiplier= the σ is required."""
    engine, gsm, opt, dl = _private(("bandmf", {"bands": 4}))
    _train(gsm, opt, dl, 6)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    resumed, gsm2, opt2, _ = _private(("bandmf", {"bands": 4}), noise_multiplier=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0)  # any object passed as noise_scheduler
    with pytest.raises(ValueError, match="inside a band .* this run changes noise_multiplier"):
        resumed.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2, noise_scheduler=scheduler)
    with pytest.raises(ValueError, match="without the run's noise multiplier"):
        resumed.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, noise_scheduler=scheduler)
    resumed.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, noise_multiplier=1.0, noise_scheduler=scheduler)


def test_ghost_clipping_with_loader_workers_is_refused_before_the_model_is_hooked():
    """Ghost clipping counts one accumulated iteration whatever the loop did, and with workers the engine cannot
    count the batches drawn: two batches trained as one step would go unseen. Refused in make_private, before
    Opacus hooks the model, so a retry with num_workers=0 on the same model works."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def private(workers):
        mechanism = ("bandmf", {"bands": 4})
        kw = {"grad_sample_mode": "ghost", "criterion": nn.CrossEntropyLoss()}
        return _private(mechanism, seed=None, workers=workers, model=model, **kw)[1:]

    with pytest.raises(ValueError, match="num_workers=0"):
        private(1)
    gsm, opt, criterion, dl = private(0)
    assert isinstance(opt, DPOptimizerFastGradientClipping)
    before = [p.detach().clone() for p in gsm.parameters()]
    xb, idx = next(iter(dl))
    opt.zero_grad()
    criterion(gsm(xb), Y[idx]).backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, gsm.parameters(), strict=True))


def test_a_resume_whose_seed_rebuilds_other_groups_is_refused_without_showing_the_seed(tmp_path):
    """The checkpoint keeps a digest of the groups: a resume on a dataset of another size (or a torch whose generator
    draws differently) rebuilds other groups from the same seed, and is refused; no error message shows the seed."""
    engine, gsm, opt, dl = _private(("bandmf", {"bands": 4}), seed=None)
    _train(gsm, opt, dl, 3)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)["opacus_spectral_noise_mechanism"]
    seed = str(saved["partition_seed"])
    shorter = TensorDataset(X[:-1], torch.arange(N - 1))  # the same rate (8 batches), one record fewer
    other, gsm2, opt2, _ = _private(("bandmf", {"bands": 4}), seed=None, data=shorter)
    with pytest.raises(ValueError, match="groups rebuilt") as caught:
        other.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2)
    assert seed not in str(caught.value) and other.accountant.history == []  # refused before anything is loaded
    resumed, gsm3, opt3, _ = _private(("bandmf", {"bands": 2}), seed=None)
    with pytest.raises(ValueError, match="noise mechanism") as caught:
        resumed.load_checkpoint(path=tmp_path / "ck.pt", module=gsm3, optimizer=opt3)
    assert seed not in str(caught.value)
    resumed, gsm3, opt3, _ = _private(("bandmf", {"bands": 4}), seed=None)
    resumed.load_checkpoint(path=tmp_path / "ck.pt", module=gsm3, optimizer=opt3)
