"""``make_private(noise_mechanism="bandmf")`` end to end (docs/mechanisms.md): b = 1 is DP-SGD bit for bit; the ε is
an independent Opacus computation of DP-SGD with (σ, b·q, ⌈T/b⌉); the released noise has covariance (σC)²·M⁻¹M⁻ᵀ
across steps; step t trains on group t mod b only; a resumed run keeps the partition and the ε, and no saved file
holds a noise buffer; what the accounting does not cover is refused."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from engine_helpers import Recorder
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus_spectral.accounting.calibration import noise_multiplier_for
from opacus_spectral.accounting.record import privacy_record_of
from opacus_spectral.mechanisms.bandmf_math import inverse_matrix
from opacus_spectral.mechanisms.base import NoiseMechanism
from opacus_spectral.mechanisms.cyclic import partition
from opacus_spectral.mechanisms.install import mechanism_of
from opacus_spectral.mechanisms.strategy import BandedToeplitz
from opacus_spectral.plugins.registry import Registry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine, hookimpl

pytestmark = pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")

N, BATCH, DELTA = 256, 32, 1e-5  # q = 1/8
X = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _private(mechanism, steps=12, seed=3, accountant="rdp", model=None, **kw):
    model = model or _model()
    engine = PrivacyEngine(accountant=accountant, noise_seed=seed)
    extra = {} if mechanism is None else {"noise_mechanism": mechanism, "steps": steps}
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(X, torch.arange(N)), batch_size=BATCH),
        noise_multiplier=kw.pop("noise_multiplier", 1.0),
        max_grad_norm=1.0,
        **extra,
        **kw,
    )
    return engine, model, *out


def _train(gsm, opt, dl, steps, seen=None):
    """``steps`` DP steps, every batch stepped on (empty ones too); ``seen`` collects each step's record indices."""
    done = 0
    while done < steps:
        for xb, idx in dl:
            opt.zero_grad()
            nn.functional.cross_entropy(gsm(xb), Y[idx]).backward()
            opt.step()
            if seen is not None:
                seen.append(idx.tolist())
            done += 1
            if done == steps:
                break


def test_one_band_is_dp_sgd_bit_for_bit():
    weights, histories = [], []
    for mechanism in (None, ("bandmf", {"bands": 1})):
        engine, model, gsm, opt, dl = _private(mechanism)
        _train(gsm, opt, dl, 12)
        weights.append([p.detach().clone() for p in model.parameters()])
        histories.append(engine.accountant.history)
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    assert histories[0] == histories[1] == [(1.0, 1 / 8, 12)]


@pytest.mark.parametrize("accountant, independent", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_is_dp_sgd_with_b_times_the_rate_for_a_bth_of_the_steps(accountant, independent):
    engine, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12, accountant=accountant)
    _train(gsm, opt, dl, 5)  # ⌈5/4⌉ = 2 accountant steps so far
    assert engine.accountant.history == [(1.0, 0.5, 2)]
    _train(gsm, opt, dl, 7)
    ref = independent()
    ref.history = [(1.0, 4 / 8, math.ceil(12 / 4))]
    assert engine.get_epsilon(DELTA) == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    run = privacy_record_of(engine).runs[-1]
    assert (run.mechanism, run.sampler, run.history) == ("bandmf", "cyclic_poisson", ((1.0, 0.5, 3),))


def test_released_noise_has_the_covariance_of_m_inverse_across_steps():
    """Zero gradients, sum reduction: the gradient each step releases is σC·x_t, x = M⁻¹z. Over 20,200 coordinates
    the empirical T × T covariance is within 0.06 (≈ 4 standard errors) of M⁻¹M⁻ᵀ, and far from DP-SGD's I."""
    steps, bands = 8, 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100))
    engine = PrivacyEngine(accountant="rdp", noise_seed=7)
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(torch.randn(64, 100)), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        loss_reduction="sum",
        noise_mechanism=("bandmf", {"bands": bands}),
        steps=steps,
    )
    released = []
    for (xb,) in dl:
        opt.zero_grad()
        (0.0 * gsm(xb).sum()).backward()
        opt.step()
        released.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    x = torch.stack(released)  # T × 20,200
    expected = inverse_matrix(mechanism_of(opt).coefficients, steps)
    expected = expected @ expected.T
    assert (x @ x.T / x.shape[1] - expected).abs().max() < 0.06
    assert (expected - torch.eye(steps, dtype=expected.dtype)).abs().max() > 0.2


def test_step_t_trains_on_group_t_mod_b_only():
    engine, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=16)
    seen: list[list[int]] = []
    _train(gsm, opt, dl, 16, seen)
    groups = partition(N, 4, engine.mechanism_run.partition_seed)
    group_of = {int(i): g for g, part in enumerate(groups) for i in part}
    assert all(group_of[i] == t % 4 for t, batch in enumerate(seen) for i in batch)
    assert sum(map(len, seen)) > 0.5 * 16 * BATCH  # the expected batch is still B (at rate b·q within the group)
    other = PrivacyEngine(accountant="rdp")  # without noise_seed: a partition nobody else knows
    assert other.noise_source.partition_seed() != PrivacyEngine(accountant="rdp").noise_source.partition_seed()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_a_resumed_run_keeps_the_partition_and_the_epsilon_and_saves_no_noise_buffer(tmp_path):
    mech = ("bandmf", {"bands": 4})
    whole, _, gsm, opt, dl = _private(mech, steps=12)
    _train(gsm, opt, dl, 12)

    first, _, gsm, opt, dl = _private(mech, steps=12)
    _train(gsm, opt, dl, 6)
    rings = [ring.rows.clone() for ring in mechanism_of(opt)._stream._history.values()]
    buffers = [row for rows in rings for row in rows]
    assert len(buffers) == 3 * 4 and all(bool(b.abs().sum() > 0) for b in buffers)  # b − 1 = 3 outputs of 4 tensors
    buffers += [rows.reshape(-1) for rows in rings]  # nor a whole ring
    path = tmp_path / "ck.pt"
    first.save_checkpoint(path=path, module=gsm, optimizer=opt)
    saved = [s.reshape(-1) for s in _tensors(torch.load(path, weights_only=False))]
    assert not any(s.numel() == b.numel() and torch.equal(s, b) for s in saved for b in buffers)

    resumed, _, gsm, opt, dl = _private(mech, steps=12, seed=11)
    resumed.load_checkpoint(path=path, module=gsm, optimizer=opt)
    assert resumed.mechanism_run.partition_seed == first.mechanism_run.partition_seed
    parts = dl.batch_sampler.parts
    assert all(
        torch.equal(a, b) for a, b in zip(parts, partition(N, 4, first.mechanism_run.partition_seed), strict=True)
    )
    assert mechanism_of(opt)._stream._history == {}  # a fresh stream: nothing carried over
    seen: list[list[int]] = []
    _train(gsm, opt, dl, 6, seen)
    group_of = {int(i): g for g, part in enumerate(parts) for i in part}
    assert all(group_of[i] == (6 + t) % 4 for t, batch in enumerate(seen) for i in batch)  # the cycle continues
    assert resumed.accountant.history == whole.accountant.history == [(1.0, 0.5, 3)]
    assert resumed.get_epsilon(DELTA) == pytest.approx(whole.get_epsilon(DELTA), rel=1e-12)


def test_resuming_with_another_mechanism_is_refused(tmp_path):
    engine, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12)
    _train(gsm, opt, dl, 2)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    for mechanism in (("bandmf", {"bands": 2}), None):
        other, _, gsm2, opt2, _ = _private(mechanism, steps=12)
        with pytest.raises(ValueError, match="noise mechanism"):
            other.load_checkpoint(path=tmp_path / "ck.pt", module=gsm2, optimizer=opt2)


def test_a_skipped_batch_is_refused_before_its_update():
    engine, model, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12)
    batches = iter(dl)
    for _ in range(2):
        xb, idx = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(xb), Y[idx]).backward()
        opt.step()
    next(batches)  # drawn, never trained on
    xb, idx = next(batches)
    opt.zero_grad()
    nn.functional.cross_entropy(gsm(xb), Y[idx]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="stepped on"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert engine.accountant.history == [(1.0, 0.5, 1)]


def test_physical_batches_of_batch_memory_manager_advance_the_noise_once_per_logical_step():
    """Opacus' BatchMemoryManager splits each cyclic Poisson batch into physical batches of ≤ 5: the run equals the
    unsplit one (the same batches and one stream step per logical step; summation order aside), and so does ε."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    runs, physical_steps = [], 0
    for physical in (None, 5):
        engine, model, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=8)
        if physical is None:
            _train(gsm, opt, dl, 8)
        else:
            with BatchMemoryManager(data_loader=dl, max_physical_batch_size=physical, optimizer=opt) as loader:
                for xb, idx in loader:  # one pass: the 8 logical steps
                    opt.zero_grad()
                    nn.functional.cross_entropy(gsm(xb), Y[idx]).backward()
                    opt.step()
                    physical_steps += 1
        runs.append(([p.detach().clone() for p in model.parameters()], engine.accountant.history))
    (plain, history), (split, split_history) = runs
    assert history == split_history == [(1.0, 0.5, 2)] and physical_steps > 30  # ≈ 32 records per batch, split
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, split, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain, [p.detach() for p in _model().parameters()], strict=True))


@pytest.mark.parametrize(
    "mechanism, kw, match",
    [
        (("bandmf", {"bands": 4}), {"poisson_sampling": False}, "Poisson sampling the engine builds only"),
        (("bandmf", {"bands": 16}), {"steps": 32}, "exceeds 1"),  # 16 × 1/8
        (("bandmf", {"bands": 4}), {"steps": None}, "needs the run's length"),
        (("bandmf", {"bands": 4}), {"post_hooks": ["ema"]}, "independent across steps"),
        ("bandfm", {}, "bandmf"),
    ],
)
def test_what_the_accounting_does_not_cover_is_refused(mechanism, kw, match):
    with pytest.raises((ValueError, KeyError), match=match):
        _private(mechanism, **{"steps": 12, **kw})


def test_gdp_and_a_length_without_a_mechanism_are_refused():
    with pytest.raises(ValueError, match="upper-bound accountant"):
        _private(("bandmf", {"bands": 2}), accountant="gdp")
    model = _model()
    with pytest.raises(ValueError, match="need noise_mechanism='bandmf'"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(X, torch.arange(N)), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_mechanism="gaussian",
            steps=12,
        )


def test_target_epsilon_is_calibrated_through_the_bandmf_accounting():
    model = _model()
    engine = PrivacyEngine(accountant="rdp", noise_seed=3)
    gsm, opt, dl = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(X, torch.arange(N)), batch_size=BATCH),
        target_epsilon=3.0,
        target_delta=DELTA,
        epochs=2,  # 16 steps
        max_grad_norm=1.0,
        noise_mechanism=("bandmf", {"bands": 4}),
    )
    assert opt.noise_multiplier == pytest.approx(
        noise_multiplier_for(target_epsilon=3.0, target_delta=DELTA, sample_rate=0.5, steps=4, accountant="rdp")
    )
    _train(gsm, opt, dl, 16)
    assert engine.accountant.history == [(opt.noise_multiplier, 0.5, 4)]
    assert 2.9 < engine.get_epsilon(DELTA) <= 3.0 + 1e-6


def test_denoisers_see_the_released_noise_std_of_each_step():
    records = []
    for mechanism in (None, ("bandmf", {"bands": 3})):
        recorder = Recorder()
        _, _, gsm, opt, dl = _private(mechanism, steps=6, post_hooks=[recorder])
        _train(gsm, opt, dl, 6)
        records.append([step[0]["sigma"] for step in recorder.seen])
    rows = inverse_matrix(mechanism_of(opt).coefficients, 6).norm(dim=1)
    assert [b / a for a, b in zip(*records, strict=True)] == pytest.approx(rows.tolist(), rel=1e-9)


class _Plugin:
    """A third-party plugin with three mechanisms: a valid one (a strategy: DP-SGD's c = (1,) over 2 groups, i.e.
    cyclic sampling with i.i.d. noise), and two written for the old contract — one declaring its own accounting (an ε
    of its choosing), one its own noise (a tenth of the draw) — which are refused before anything is built."""

    @hookimpl
    def opacus_spectral_noise_mechanisms(self):
        class Plain(NoiseMechanism):
            name = "plain"

            def strategy(self, *, steps, sample_rate, dataset_size):
                return BandedToeplitz((1.0, 0.0))

        class FreeForm(NoiseMechanism):
            name = "free_form"

            def accounting(self, noise_multiplier, sample_rate):
                return 0.1  # "ε = 0.1": never consulted

        class Quiet(NoiseMechanism):
            name = "quiet"

            def noise(self, key, z):
                return 0.1 * z  # releases a tenth of what is charged: never called

        return {"plain": Plain, "free_form": FreeForm, "quiet": Quiet}


def test_a_third_party_mechanism_contributes_a_strategy_and_nothing_else():
    registry = Registry(entry_points=lambda: [])
    registry.register(_Plugin(), name="third-party")
    assert set(registry.mechanisms()) == {"plain", "free_form", "quiet"}  # no entry points: no built-ins

    def private(name):
        model = _model()
        engine = PrivacyEngine(accountant="rdp", registry=registry, noise_seed=3)
        out = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(X, torch.arange(N)), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_mechanism=name,
        )
        return engine, model, *out

    engine, _, gsm, opt, dl = private("plain")
    _train(gsm, opt, dl, 4)
    assert engine.accountant.history == [(1.0, 2 / 8, 2)]  # computed: b = 2 groups at rate 2q, charged every 2
    for name, member in (("free_form", "accounting"), ("quiet", "noise")):
        with pytest.raises(TypeError, match=f"defines {member}: a mechanism contributes strategy"):
            private(name)


def test_a_noise_multiplier_that_changes_during_the_run_is_refused(tmp_path):
    """BandMF charges one σ for each b steps: a σ changed mid-run is stopped before the update (the steps between
    charges would be uncharged at their own σ); a resume with another σ is refused at load_checkpoint."""
    _, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12)
    _train(gsm, opt, dl, 2)
    before = [p.detach().clone() for p in gsm.parameters()]
    opt.noise_multiplier = 0.5  # what a noise scheduler would do
    with pytest.raises(ValueError, match="one noise multiplier"):
        _train(gsm, opt, dl, 1)
    assert all(torch.equal(a, p) for a, p in zip(before, gsm.parameters(), strict=True))

    first, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12)
    _train(gsm, opt, dl, 3)
    path = tmp_path / "ck.pt"
    first.save_checkpoint(path=path, module=gsm, optimizer=opt)
    resumed, _, gsm, opt, dl = _private(("bandmf", {"bands": 4}), steps=12, noise_multiplier=2.0)
    with pytest.raises(ValueError, match="inside a band .* changes noise_multiplier"):
        resumed.load_checkpoint(path=path, module=gsm, optimizer=opt)


def test_a_run_past_its_declared_horizon_warns_once_and_given_coefficients_never():
    """64 declared, 160 run is legal and exactly accounted, but the coefficients were optimized for another horizon:
    one PastHorizonWarning, at the first step past it; coefficients the caller gives carry no horizon."""
    from opacus_spectral.errors import PastHorizonWarning

    _, _, gsm, opt, dl = _private(("bandmf", {"bands": 2}), steps=4)
    with pytest.warns(PastHorizonWarning, match="past the 4 its coefficients were optimized for") as caught:
        _train(gsm, opt, dl, 9)
    assert len([w for w in caught if w.category is PastHorizonWarning]) == 1
    _, _, gsm, opt, dl = _private(("bandmf", {"bands": 2, "coefficients": [1.0, 0.5]}), steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PastHorizonWarning)
        _train(gsm, opt, dl, 9)
