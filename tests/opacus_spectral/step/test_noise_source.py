"""Noise nobody can regenerate: the engine draws DP noise and the Poisson sample from OS-entropy generators, never
from torch's global RNG (which a public seed such as the Trainer's ``TrainingArguments.seed`` fixes); a
reproducible ``noise_seed`` is an explicit, warned opt-in. The neighbouring-run probe: two runs with the same
global seed on datasets that differ in one label."""

from __future__ import annotations

import os
import socket
import warnings

import opacus
import pytest
import torch
import torch.distributed as dist
from engine_helpers import loader, mlp
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.step.noise_source import NoiseSource, parameter_device
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

N, D_IN, K = 32, 16, 8
LR, C, SIGMA = 0.5, 1.0, 1.0
BOUND = 2 * LR * C / N  # how far one changed example can move the weights in one step at q = 1 (mean reduction)


def _classification(flip: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D_IN, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    if flip:
        y = y.clone()
        y[0] = (y[0] + 1) % K
    return TensorDataset(x, y)


def _one_step(engine_cls=PrivacyEngine, *, flip: bool = False, global_seed: int = 0, **engine_kwargs) -> torch.Tensor:
    """One DP-SGD step at q = 1 (every example is in the batch); returns the flattened weights after it."""
    torch.manual_seed(global_seed)
    model = nn.Linear(D_IN, K)
    engine = engine_cls(accountant="rdp", **engine_kwargs)
    model, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(_classification(flip), batch_size=N),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
    )
    x, y = next(iter(dl))
    assert len(x) == N
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_neighbouring_runs_differ_at_the_noise_scale_by_default() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleNoiseWarning)  # the default never warns about reproducibility
        diff = (_one_step(flip=False) - _one_step(flip=True)).norm()
    noise_scale = LR * SIGMA * C / N * (2 * (D_IN + 1) * K) ** 0.5  # ‖difference of two independent noises‖
    assert diff > 5 * BOUND
    assert 0.5 * noise_scale < diff < 1.5 * noise_scale


def test_vanilla_opacus_neighbouring_runs_reveal_the_example() -> None:
    """What the default fixes: upstream draws from the global RNG, so the same seed cancels the noise."""
    diff = (_one_step(opacus.PrivacyEngine, flip=False) - _one_step(opacus.PrivacyEngine, flip=True)).norm()
    assert 0 < diff <= BOUND * (1 + 1e-5)


def test_noise_seed_reproduces_and_warns_that_it_is_not_private() -> None:
    with pytest.warns(ReproducibleNoiseWarning, match="NOT differentially private against anyone who knows"):
        a = _one_step(flip=False, noise_seed=7)
    with pytest.warns(ReproducibleNoiseWarning):
        b = _one_step(flip=True, noise_seed=7)
    assert 0 < (a - b).norm() <= BOUND * (1 + 1e-5)  # the same seed cancels the noise: the label shows
    with pytest.warns(ReproducibleNoiseWarning):
        assert torch.equal(_one_step(flip=False, noise_seed=7), a)
    with pytest.warns(ReproducibleNoiseWarning):
        assert (_one_step(flip=False, noise_seed=8) - a).norm() > 5 * BOUND


def test_default_runs_with_the_same_global_seed_differ() -> None:
    a, b = _one_step(), _one_step()
    assert (a - b).norm() > 5 * BOUND


def test_training_never_draws_from_the_global_rng() -> None:
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=1.0,
        max_grad_norm=C,
    )
    state = torch.get_rng_state()
    for x, y in dl:  # Poisson sample
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # noise
    assert torch.equal(torch.get_rng_state(), state)
    assert opt.generator is not None and opt.generator is not torch.default_generator
    assert dl.batch_sampler.generator is not None


def test_generators_given_by_the_caller_are_used_as_given() -> None:
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    noise, sampler = torch.Generator(), torch.Generator()
    data = DataLoader(loader(64, 16, d_out=4).dataset, batch_size=16, generator=sampler)
    _, opt, dl = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=1.0,
        max_grad_norm=C,
        noise_generator=noise,
    )
    assert opt.generator is noise
    assert dl.batch_sampler.generator is sampler


def test_make_private_with_epsilon_and_ghost_get_fresh_generators() -> None:
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=C,
        grad_sample_mode="ghost",
    )
    opt, dl = out[1], out[-1]
    assert opt.generator is not None and dl.batch_sampler.generator is not None
    state = torch.get_rng_state()
    x, y = next(iter(dl))
    opt.zero_grad()
    out[2](out[0](x), y).backward()
    opt.step()
    assert torch.equal(torch.get_rng_state(), state)


def test_every_make_private_of_a_seeded_engine_gets_new_streams() -> None:
    """Reusing one seed's stream across two make_private calls would cancel noise between them."""
    source = NoiseSource(3)
    first = [torch.randn(4, generator=source.noise_generator()), torch.rand(4, generator=source.sampler_generator())]
    second = [torch.randn(4, generator=source.noise_generator()), torch.rand(4, generator=source.sampler_generator())]
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    again = NoiseSource(3)
    assert torch.equal(torch.randn(4, generator=again.noise_generator()), first[0])
    ranks = [torch.rand(4, generator=NoiseSource(3).sampler_generator(rank)) for rank in (0, 1)]
    assert not torch.equal(ranks[0], ranks[1])  # DDP ranks sample independently


def test_bad_noise_seed_and_conflicting_options_are_refused() -> None:
    with pytest.raises(TypeError, match="noise_seed must be an int"):
        PrivacyEngine(noise_seed="7")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="noise_seed must be an int"):
        PrivacyEngine(noise_seed=True)
    with pytest.raises(ValueError, match="pick one"):
        PrivacyEngine(secure_mode=True, noise_seed=1)


def test_noise_generator_lives_on_the_parameters_device() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert parameter_device(opt) == torch.device("cpu")
    assert NoiseSource().noise_generator(parameter_device(opt)).device == torch.device("cpu")
    meta = nn.Linear(4, 2, device="meta")
    assert NoiseSource().noise_generator(parameter_device(torch.optim.SGD(meta.parameters(), lr=0.1))).device.type == (
        "cpu"
    )
    mixed = torch.optim.SGD([*model.parameters(), *meta.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="several devices"):
        parameter_device(mixed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_noise_is_drawn_on_the_device_from_the_engine_generator() -> None:
    torch.manual_seed(0)
    model = nn.Linear(D_IN, K).cuda()
    gsm, opt, dl = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(_classification(False), batch_size=8),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
    )
    assert opt.generator.device == model.weight.device
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    x, y = next(iter(dl))
    opt.zero_grad()
    nn.functional.cross_entropy(gsm(x.cuda()), y.cuda()).backward()
    opt.step()
    assert torch.equal(torch.get_rng_state(), cpu_state) and torch.equal(torch.cuda.get_rng_state(), cuda_state)


def test_checkpoint_holds_no_generator_state(tmp_path) -> None:
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=1.0,
        max_grad_norm=C,
        post_hooks=["rmt"],
    )
    x, y = next(iter(dl))
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=model, optimizer=opt)
    states = {bytes(g.get_state().numpy()) for g in (opt.generator, dl.batch_sampler.generator)}
    found: list[object] = []

    def walk(obj: object) -> None:
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        else:
            found.append(obj)

    walk(torch.load(tmp_path / "ck.pt", weights_only=True))
    assert not any(isinstance(o, torch.Generator) for o in found)
    assert not any(isinstance(o, torch.Tensor) and o.dtype == torch.uint8 for o in found)
    assert not any(isinstance(o, torch.Tensor) and o.dtype == torch.uint8 and bytes(o.numpy()) in states for o in found)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_distributed_path_draws_from_the_engine_generators(clipping: str) -> None:
    """DPDDP (one gloo process): the distributed sampler and the distributed optimizers (flat and per-layer) get
    the engine's generators; nothing is drawn from the global RNG."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = DPDDP(mlp(hidden=32, d_out=4))
        engine = PrivacyEngine(accountant="rdp")
        norms = [C] * len(list(model.parameters())) if clipping == "per_layer" else C
        model, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=1.0,
            max_grad_norm=norms,
            clipping=clipping,
        )
        assert type(dl.batch_sampler).__name__ == "DistributedUniformWithReplacementSampler"
        assert dl.batch_sampler.generator is not None and opt.generator is not None
        state = torch.get_rng_state()
        x, y = next(iter(dl))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        dist.destroy_process_group()


def _seeded(seed: int = 5):
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    with pytest.warns(ReproducibleNoiseWarning):
        engine = PrivacyEngine(accountant="rdp", noise_seed=seed)
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=1.0,
        max_grad_norm=C,
    )
    return engine, gsm, opt, dl


def _states(opt, dl) -> list[torch.Tensor]:
    return [opt.generator.get_state(), dl.batch_sampler.generator.get_state()]


def test_a_resumed_seeded_run_does_not_replay_its_first_noise(tmp_path) -> None:
    """Resuming with the same noise_seed must not restart the streams: the resumed steps would repeat the first
    steps' noise and batches. load_checkpoint moves them to streams derived from the steps already taken."""
    engine, gsm, opt, dl = _seeded()
    start = _states(opt, dl)
    for x, y in list(dl)[:2]:
        opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        opt.step()
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
    resumed = []
    for _ in range(2):
        engine, gsm, opt, dl = _seeded()
        assert all(torch.equal(a, b) for a, b in zip(_states(opt, dl), start, strict=True))  # a fresh run
        engine.load_checkpoint(path=tmp_path / "ck.pt", module=gsm, optimizer=opt)
        resumed.append(_states(opt, dl))
        assert not any(torch.equal(a, b) for a, b in zip(resumed[-1], start, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(*resumed, strict=True))  # still reproducible
