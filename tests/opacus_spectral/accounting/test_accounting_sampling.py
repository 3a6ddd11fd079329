"""The ε of a run is a bound for the sampling that ran (issue 39, finding 5; docs/engine.md, "Sampling and ε").

Before: ``make_private(..., poisson_sampling=False)`` trained on the loader's shuffled fixed-size batches and the
accountant charged them as Poisson batches of rate 1/len(loader) (history ``(σ, 0.25, 8)`` for two epochs of four
batches: ε 5.47 at σ = 1, where the un-amplified bound is 6.58), which the Poisson analysis does not cover; a
weighted sampler was accepted too, and with ``poisson_sampling=True`` a custom sampler was silently replaced (Opacus
#813). Now a loader that yields each record at most once per pass is charged the un-amplified bound — one Gaussian
mechanism of noise multiplier σ per pass the steps touch, ``(σ/k, 1.0, 1)`` for a step spanning k passes — and any
other is refused.
"""

from __future__ import annotations

import itertools
import pickle
import warnings

import pytest
import torch
from engine_helpers import mlp
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.accounting.calibration import epsilon_from_history, noise_multiplier_for
from opacus_spectral.accounting.sampling import PassTracker
from opacus_spectral.errors import IgnoredSamplerWarning, ShuffledSamplingWarning
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from opacus_spectral import PrivacyEngine

SIGMA, DELTA = 1.0, 1e-5


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))


def _private(dl: DataLoader, *, poisson: bool = False, engine: PrivacyEngine | None = None, doctor="raise"):
    engine = engine or PrivacyEngine(accountant="prv")
    model = mlp(d_in=8, hidden=8, d_out=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShuffledSamplingWarning)
        gsm, opt, out = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=dl,
            noise_multiplier=SIGMA,
            max_grad_norm=1.0,
            poisson_sampling=poisson,
            doctor=doctor,  # the accounting check accepts the steps charged nothing
        )
    return engine, gsm, opt, out


def _train(gsm, opt, batches, per_step: int = 1) -> None:
    for i, (x, y) in enumerate(batches, start=1):
        nn.functional.mse_loss(gsm(x), y).backward()
        if i % per_step == 0:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_pass_is_one_gaussian_mechanism(shuffle: bool) -> None:
    model = mlp(d_in=8, hidden=8, d_out=2)
    with pytest.warns(ShuffledSamplingWarning, match="UN-amplified bound"):
        engine = PrivacyEngine(accountant="prv")
        gsm, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(64), batch_size=16, shuffle=shuffle),
            noise_multiplier=SIGMA,
            max_grad_norm=1.0,
            poisson_sampling=False,
            doctor="raise",
        )
    _train(gsm, opt, itertools.chain(dl, dl))  # two epochs, 8 steps
    assert engine.accountant.history == [(SIGMA, 1.0, 2)]
    eps = engine.get_epsilon(DELTA)
    assert eps == epsilon_from_history([(SIGMA, 1.0, 2)], DELTA)
    assert eps == pytest.approx(6.583, abs=1e-3)
    assert epsilon_from_history([(SIGMA, 0.25, 8)], DELTA) == pytest.approx(5.468, abs=1e-3)  # Opacus' report


def test_a_step_across_a_pass_boundary_has_k_times_the_sensitivity() -> None:
    """Three batches per pass, two per step: the second step takes the last batch of pass 1 and the first of pass
    2, so one record can be in it twice (sensitivity 2C): it is charged (σ/2, 1, 1). (The doctor's batch_dim check
    forgets the batches of a finished pass, so it reports this step; its accounting check accepts the charges.)"""
    engine, gsm, opt, dl = _private(DataLoader(_data(48), batch_size=16, shuffle=True), doctor="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(gsm, opt, itertools.chain(dl, dl), per_step=2)
    assert engine.accountant.history == [(SIGMA, 1.0, 1), (SIGMA / 2, 1.0, 1)]
    assert "accounting" not in {f.check for f in engine.doctor.findings}


def test_batch_memory_manager_and_a_batch_sampler() -> None:
    dl = DataLoader(_data(64), batch_sampler=BatchSampler(RandomSampler(range(64)), 16, drop_last=False))
    engine, gsm, opt, dl = _private(dl)
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=4, optimizer=opt) as physical:
        _train(gsm, opt, physical)
    assert engine.accountant.history == [(SIGMA, 1.0, 1)] and engine.doctor.dp_steps == 4


class Repeating(Sampler):
    def __iter__(self):
        return iter([0, 1, 0, 1])

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: WeightedRandomSampler([1.0] * 64, 64, replacement=True),
        lambda: RandomSampler(range(64), replacement=True),
        lambda: RandomSampler(range(64), num_samples=128),  # two permutations in one pass
        lambda: Repeating(),
        lambda: SubsetRandomSampler(list(range(32))),
    ],
)
def test_a_sampler_without_a_computable_bound_is_refused(sampler) -> None:
    dl = DataLoader(_data(64), batch_size=16, sampler=sampler())
    engine = PrivacyEngine(accountant="prv")
    with pytest.raises(ValueError, match="has no bound that can be computed"):
        _private(dl, engine=engine)
    assert engine.accountant.history == []


def test_a_weighted_sampler_without_replacement_is_one_pass() -> None:
    dl = DataLoader(_data(64), batch_size=16, sampler=WeightedRandomSampler([1.0] * 64, 64, replacement=False))
    engine, gsm, opt, dl = _private(dl)
    _train(gsm, opt, dl)
    assert engine.accountant.history == [(SIGMA, 1.0, 1)]


@pytest.mark.parametrize(
    "sampler", [lambda: WeightedRandomSampler([1.0] * 64, 64), lambda: SubsetRandomSampler(list(range(32)))]
)
def test_poisson_sampling_says_it_ignores_the_loaders_sampler(sampler) -> None:
    with pytest.warns(IgnoredSamplerWarning, match="Opacus #813"):
        engine, *_ = _private(DataLoader(_data(64), batch_size=16, sampler=sampler()), poisson=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSamplerWarning)  # a plain shuffled loader: no word
        _private(DataLoader(_data(64), batch_size=16, shuffle=True), poisson=True)


def test_a_step_on_batches_the_loader_never_yielded_is_refused() -> None:
    engine, gsm, opt, _ = _private(DataLoader(_data(64), batch_size=16, shuffle=True))
    before = [p.detach().clone() for p in gsm.parameters()]
    x, y = _data(16).tensors
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.raises(RuntimeError, match="no batch drawn from the data loader make_private returned"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, gsm.parameters(), strict=True))
    assert engine.accountant.history == []


def test_make_private_with_epsilon_calibrates_to_the_unamplified_bound() -> None:
    engine = PrivacyEngine(accountant="prv")
    model = mlp(d_in=8, hidden=8, d_out=2)
    with pytest.warns(ShuffledSamplingWarning):
        gsm, opt, dl = engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(64), batch_size=16, shuffle=True),
            target_epsilon=8.0,
            target_delta=DELTA,
            epochs=2,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    assert opt.noise_multiplier == noise_multiplier_for(
        target_epsilon=8.0, target_delta=DELTA, sample_rate=1.0, steps=2
    )
    _train(gsm, opt, itertools.chain(dl, dl))
    assert 7.9 < engine.get_epsilon(DELTA) <= 8.0


def test_a_shuffled_checkpoint_round_trips_and_stays_shuffled(tmp_path) -> None:
    engine, gsm, opt, dl = _private(DataLoader(_data(48), batch_size=16, shuffle=True), doctor=False)
    _train(gsm, opt, itertools.chain(dl, dl), per_step=2)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    fresh, gsm2, opt2, _ = _private(DataLoader(_data(48), batch_size=16, shuffle=True))
    fresh.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2)
    assert fresh.accountant.history == engine.accountant.history
    assert fresh.get_epsilon(DELTA) == engine.get_epsilon(DELTA)
    poisson, gsm3, opt3, _ = _private(DataLoader(_data(48), batch_size=16), poisson=True)
    with pytest.raises(ValueError, match="charged for shuffle sampling, but this engine's last make_private"):
        poisson.load_checkpoint(path=tmp_path / "ck.pt", module=gsm3, optimizer=opt3)


# --- the pass tracker on its own ------------------------------------------------------------------------------


def _draw(sampler, n: int, it=None):
    it = it if it is not None else iter(sampler)
    for _ in range(n):
        next(it)
    return it


def test_tracker_charges_each_pass_once_and_spanning_steps_by_their_passes() -> None:
    sampler = SequentialSampler(range(4))
    tracker = PassTracker(sampler, prefetching=False)
    it = _draw(sampler, 2)
    assert tracker.charge(1.0) == 1.0  # pass 1, first step
    _draw(sampler, 2, it)
    assert tracker.charge(1.0) is None  # pass 1 again
    assert tracker.charge(1.0) is None  # nothing new drawn: the same pass (a step on pre-drawn batches)
    _draw(sampler, 4)  # a whole pass 2 ...
    it = _draw(sampler, 1)  # ... and the start of pass 3, in one step
    assert tracker.charge(1.0) == 0.5
    _draw(sampler, 1, it)
    assert tracker.charge(1.0) is None  # pass 3 was charged with the spanning step
    assert tracker.passes == 3 and tracker.steps == 5


def test_a_prefetching_loader_charges_the_first_step_of_a_pass_as_spanning() -> None:
    """Worker processes draw batches ahead, so the last batches of a pass may be used by the step after the next
    pass began: that step counts both passes (conservative)."""
    sampler = SequentialSampler(range(4))
    tracker = PassTracker(sampler, prefetching=True)
    _draw(sampler, 4)
    assert tracker.charge(1.0) == 1.0
    _draw(sampler, 2)
    assert tracker.charge(1.0) == 0.5
    assert tracker.charge(1.0) is None
    assert type(pickle.loads(pickle.dumps(sampler))) is SequentialSampler  # a copy is the plain sampler
