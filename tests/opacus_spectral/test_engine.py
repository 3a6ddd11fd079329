"""The spectral PrivacyEngine: drop-in equality with Opacus, where the pipeline runs, what denoisers see,
and what happens when a denoiser misbehaves."""

from __future__ import annotations

import gc
import warnings

import opacus
import pytest
import torch
from engine_helpers import Identity, Recorder, Scale, loader, mlp
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.errors import DenoiserError, DoctorWarning
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, PrivacyEngine, install_post_hooks

NM, C = 1.1, 1.0


def _private_mlp(post_hooks=None, *, model=None, **kwargs):
    """A fresh MLP made private by the spectral engine: (engine, wrapped model, DPOptimizer, loader, model)."""
    torch.manual_seed(0)
    model = model or mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=post_hooks,
        **kwargs,
    )
    return engine, gsm, dp_opt, dl, model


def _hand_built_dp_optimizer():
    """A GradSampleModule + DPOptimizer built by hand (no PrivacyEngine)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    model = GradSampleModule(mlp(hidden=32, d_out=4))
    dp_opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=NM, max_grad_norm=C, expected_batch_size=16
    )
    return model, dp_opt


def _step(gsm, dp_opt, dl):
    x, y = next(iter(dl))
    dp_opt.zero_grad()
    nn.functional.mse_loss(gsm(x), y).backward()
    dp_opt.step()


def _train(engine_cls, *, steps=3, mode="hooks", seed=0, **mp_kwargs):
    """A few DP-SGD steps on an MLP regression task; returns final params, epsilon, engine. Noise and Poisson sample
    come from explicit generators seeded from ``seed``, so any two engines can be compared bit for bit."""
    torch.manual_seed(seed)
    model = mlp(hidden=32, d_out=4, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    engine = engine_cls(accountant="rdp")
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader(64, 16, d_out=4, seed=seed, sampler_seed=seed + 200),
        noise_multiplier=NM,
        max_grad_norm=C,
        grad_sample_mode=mode,
        noise_generator=torch.Generator().manual_seed(seed + 100),
        **mp_kwargs,
    )
    model, dp_opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.MSELoss()
    done = 0
    while done < steps:
        for x, y in dl:
            if len(x) == 0:
                continue
            dp_opt.zero_grad()
            crit(model(x), y).backward()
            dp_opt.step()
            done += 1
            if done == steps:
                break
    params = [p.detach().clone() for p in model.parameters()]
    return params, engine.get_epsilon(1e-5), engine


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("hooks", [None, [], "identity"])
def test_bit_identical_to_vanilla_opacus(mode, hooks):
    ref, eps_ref, _ = _train(opacus.PrivacyEngine, mode=mode)
    post = [Identity()] if hooks == "identity" else hooks
    got, eps, engine = _train(PrivacyEngine, mode=mode, post_hooks=post)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert eps == eps_ref
    if hooks is not None:
        assert engine.post_hooks.diagnostics.steps == 3


def test_denoiser_changes_training_and_order_is_users():
    ref, eps_ref, _ = _train(opacus.PrivacyEngine)
    scaled, eps, engine = _train(PrivacyEngine, post_hooks=[Scale(0.0)])
    assert eps == eps_ref  # post-processing never touches the accountant
    assert not all(torch.equal(a, b) for a, b in zip(ref, scaled, strict=True))
    # order: recorder after scale(0) sees zeros, recorder before sees noise
    rec_first, rec_last = Recorder(), Recorder()
    _train(PrivacyEngine, steps=1, post_hooks=[rec_first, Scale(0.0), rec_last])
    assert all(r["tensor"].abs().sum() > 0 for r in rec_first.seen[0])
    assert all(r["tensor"].abs().sum() == 0 for r in rec_last.seen[0])


def test_batch_memory_manager_runs_pipeline_once_per_logical_step():
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    engine = PrivacyEngine(accountant="rdp")
    model, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader(256, 64, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=[rec],
    )
    inner_steps = 0

    def count(*_):
        nonlocal inner_steps
        inner_steps += 1

    dp_opt.original_optimizer.register_step_post_hook(count)
    physical = 0
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=8, optimizer=dp_opt) as mem:
        for x, y in mem:
            dp_opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            dp_opt.step()
            physical += 1
    assert len(dl) == 4
    assert physical >= 16  # ~32 physical batches of <= 8 for 4 logical batches of ~64
    assert len(rec.seen) == 4 == inner_steps
    assert [r[0]["step"] for r in rec.seen] == [0, 1, 2, 3]
    # sigma is nm*C/B with B the logical (expected) batch size
    assert rec.seen[0][0]["sigma"] == pytest.approx(NM * C / 64)


def test_denoiser_reaches_no_parameter_or_clean_gradient():
    rec = Recorder()
    engine, gsm, dp_opt, dl, model = _private_mlp([rec])
    _step(gsm, dp_opt, dl)
    params = list(model.parameters())
    forbidden = {id(p) for p in params}
    forbidden |= {id(p.summed_grad) for p in params} | {id(p.grad_sample) for p in params}
    records = rec.raw[0]
    assert {r.name for r in records} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {r.role for r in records} == {"weight", "bias"}
    for r in records:
        assert not isinstance(r.tensor, nn.Parameter)
        assert not hasattr(r.tensor, "grad_sample") and not hasattr(r.tensor, "summed_grad")
        assert not hasattr(r, "__dict__")  # slots: no room to smuggle anything in
        # nothing reachable within three hops of the record is a Parameter or the clean clipped sum
        frontier, seen = [r], set()
        for _ in range(3):
            nxt = []
            for obj in frontier:
                for ref in gc.get_referents(obj):
                    if id(ref) in seen or isinstance(ref, type):
                        continue
                    seen.add(id(ref))
                    assert id(ref) not in forbidden, f"record {r.name} reaches a forbidden object"
                    assert not isinstance(ref, nn.Parameter)
                    nxt.append(ref)
            frontier = nxt


class _Bad(Denoiser):
    def __init__(self, kind: str, target: str = "2.weight") -> None:
        super().__init__()
        self.kind, self.target, self.name = kind, target, f"bad-{kind}"

    def __call__(self, grads):
        out = []
        for g in grads:
            t = g.tensor
            if g.name == self.target:
                if self.kind == "shape":
                    t = t.flatten()
                elif self.kind == "dtype":
                    t = t.double()
                elif self.kind == "device":
                    t = t.to("meta")
                elif self.kind == "nan":
                    t = t.clone()
                    t[0, 0] = float("nan")
                elif self.kind == "inplace-nan":
                    g.tensor[0, 0] = float("nan")
                elif self.kind == "raise":
                    raise ArithmeticError("boom")
            out.append(t)
        return None if self.kind == "inplace-nan" else out


@pytest.mark.parametrize("kind", ["shape", "dtype", "device", "nan", "inplace-nan", "raise"])
def test_bad_denoiser_output_raises_and_never_updates_weights(kind):
    engine, gsm, dp_opt, dl, model = _private_mlp([_Bad(kind)])
    before = [p.detach().clone() for p in model.parameters()]  # make_private does not touch the weights
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.raises(DenoiserError, match=f"bad-{kind}") as err:
        dp_opt.step()
    if kind != "raise":
        assert "2.weight" in str(err.value)
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p)
        assert p.grad is None  # a corrupted gradient is not left behind for a later step


@pytest.mark.parametrize("kind", ["shape", "nan", "inplace-nan", "raise"])
def test_fallback_policy_keeps_noisy_gradient_warns_once_and_counts(kind):
    ref, _, _ = _train(opacus.PrivacyEngine, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, engine = _train(PrivacyEngine, steps=2, post_hooks=[_Bad(kind)], on_denoiser_error="fallback")
    for a, b in zip(ref, got, strict=True):  # the bad denoiser's output was discarded: identical to no denoiser
        assert torch.equal(a, b)
    ours = [w for w in caught if f"bad-{kind}" in str(w.message)]
    assert len(ours) == 1
    diag = engine.post_hooks.diagnostics
    assert diag.fallbacks[f"bad-{kind}"] == 2
    assert diag.last.denoisers[f"bad-{kind}"]["fallbacks"] >= 1


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match=r"unknown denoiser 'nope'; available: .*lowpass.*rmt"):
        _train(PrivacyEngine, post_hooks=["nope"])
    with pytest.raises(TypeError, match="must be a list"):
        _train(PrivacyEngine, post_hooks="rmt")


def test_make_private_with_epsilon_installs_hooks_and_keeps_them_out_of_opacus_kwargs():
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    rec = Recorder()
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=C,
        post_hooks=[rec],
    )
    _step(gsm, dp_opt, dl)
    assert len(rec.seen) == 1
    assert rec.seen[0][0]["sigma"] == pytest.approx(dp_opt.noise_multiplier * C / 16)


def test_install_post_hooks_on_hand_built_optimizer_and_remove():
    model, dp_opt = _hand_built_dp_optimizer()
    rec = Recorder()
    handle = install_post_hooks(dp_opt, [rec], module=model)
    x, y = next(iter(loader(64, 16, d_out=4)))
    for _ in range(2):
        dp_opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        dp_opt.step()
    assert len(rec.seen) == 2 and rec.seen[0][0]["name"] == "0.weight"
    handle.remove()
    dp_opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    dp_opt.step()
    assert len(rec.seen) == 2 and dp_opt.step_hook is None
    with pytest.raises(TypeError, match="DPOptimizer"):
        install_post_hooks(torch.optim.SGD(model.parameters(), lr=0.1), [])


def test_second_make_private_replaces_the_pipeline():
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    r1, r2 = Recorder(), Recorder()
    kw = dict(optimizer=opt, data_loader=loader(64, 16, d_out=4), noise_multiplier=NM, max_grad_norm=C)
    gsm, _, _ = engine.make_private(module=model, post_hooks=[r1], **kw)
    gsm, dp_opt, dl = engine.make_private(module=gsm, post_hooks=[r2], **kw)  # same inner optimizer again
    _step(gsm, dp_opt, dl)
    assert len(r1.seen) == 0 and len(r2.seen) == 1


def test_vanilla_opacus_silently_ignores_post_hooks():
    """Documented trap: opacus.PrivacyEngine swallows post_hooks in **kwargs. Use opacus_spectral's engine."""
    rec = Recorder()
    _train(opacus.PrivacyEngine, steps=1, post_hooks=[rec])
    assert rec.seen == []


def test_eval_mode_gives_clear_error():
    engine, gsm, dp_opt, dl, model = _private_mlp([])
    gsm.eval()
    x, y = next(iter(dl))
    with pytest.raises(RuntimeError, match=r"eval mode.*model\.train\(\)"):
        nn.functional.mse_loss(gsm(x), y).backward()


def test_oracle_reports_cosines_to_clean_gradient():
    class Halve(Denoiser):
        name = "halve"

        def __call__(self, grads):
            return [g.tensor * 0.5 for g in grads]

    _, _, engine = _train(PrivacyEngine, steps=1, post_hooks=[Halve()], oracle=True)
    oracle = engine.post_hooks.diagnostics.last.oracle
    before, after = oracle["global"]
    assert -1 <= before <= 1 and after == pytest.approx(before, abs=1e-6)  # scaling keeps every cosine
    assert set(oracle["per_param"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_records_are_noisy_gradient_objects():
    rec = Recorder()
    _train(PrivacyEngine, steps=1, post_hooks=[rec])
    assert all(isinstance(r, NoisyGradient) for r in rec.raw[0])


def test_fsdp_is_refused_clearly():
    """One refusal, the engine's, whether FSDP comes through make_private or a hand-built optimizer."""
    from opacus.optimizers import FSDPOptimizerFastGradientClipping

    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    with pytest.raises(NotImplementedError, match="FSDP") as through_engine:
        PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=NM,
            max_grad_norm=C,
            grad_sample_mode="ghost_fsdp",
            post_hooks=["rmt"],
        )
    hand_built = FSDPOptimizerFastGradientClipping.__new__(FSDPOptimizerFastGradientClipping)  # __init__ needs a group
    with pytest.raises(NotImplementedError) as by_hand:
        install_post_hooks(hand_built, ["rmt"])
    assert str(by_hand.value) == str(through_engine.value)


@pytest.mark.parametrize("same_engine", [True, False])
def test_make_private_again_without_post_hooks_drops_the_old_pipeline(same_engine):
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    kw = dict(optimizer=opt, data_loader=loader(64, 16, d_out=4), noise_multiplier=NM, max_grad_norm=C)
    first = PrivacyEngine(accountant="rdp")
    gsm, _, _ = first.make_private(module=model, post_hooks=[rec], **kw)
    second = first if same_engine else PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = second.make_private(module=gsm, **kw)  # asks for plain Opacus now
    _step(gsm, dp_opt, dl)
    assert rec.seen == [] and second.post_hooks is None


def test_stepping_the_inner_optimizer_directly_never_feeds_clean_gradients_to_denoisers():
    rec = Recorder()
    engine, gsm, dp_opt, dl, model = _private_mlp([rec])
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.warns(DoctorWarning, match="without a noisy, accounted DP step"):
        dp_opt.original_optimizer.step()  # bypasses clipping and noise: p.grad is the clean gradient
    assert rec.seen == [] and engine.post_hooks.diagnostics.skipped == 1


def test_names_without_module_are_stable_under_toggling():
    from opacus_spectral import set_trainable

    model, dp_opt = _hand_built_dp_optimizer()
    rec = Recorder()
    install_post_hooks(dp_opt, [rec])  # no module: names come from param-group positions
    x, y = next(iter(loader(64, 16, d_out=4)))
    first = list(model._module.parameters())[0]
    for frozen in (False, True):
        set_trainable([first], not frozen)
        dp_opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        dp_opt.step()
    shapes = {}
    for step in rec.seen:
        for r in step:
            shapes.setdefault(r["name"], set()).add(tuple(r["tensor"].shape))
    assert all(len(v) == 1 for v in shapes.values()), shapes
    assert [r["name"] for r in rec.seen[1]] == ["param.1", "param.2", "param.3"]


def test_disabled_hooks_in_eval_mode_behave_like_opacus():
    # the alternation-safe hooks hand a disabled, eval-mode module to upstream's code path: a plain backward,
    # no per-sample state, exactly the gradients vanilla Opacus' GradSampleModule leaves
    grads = []
    for engine_cls in (opacus.PrivacyEngine, PrivacyEngine):
        model = mlp(hidden=32, d_out=4)
        gsm, dp_opt, dl = engine_cls(accountant="rdp").make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=NM,
            max_grad_norm=C,
        )
        gsm.eval()
        gsm.disable_hooks()
        x, y = next(iter(loader(64, 16, d_out=4)))
        nn.functional.mse_loss(gsm(x), y).backward()
        assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
    plain = mlp(hidden=32, d_out=4)
    nn.functional.mse_loss(plain(x), y).backward()
    for ours, vanilla, reference in zip(grads[1], grads[0], plain.parameters(), strict=True):
        assert torch.equal(ours, vanilla) and torch.allclose(ours, reference.grad)


def test_checkpoint_keeps_stateful_denoiser_state(tmp_path):
    class Counter(Denoiser):
        name = "counter"

        def __init__(self):
            super().__init__()
            self.calls = 0

        def __call__(self, grads):
            self.calls += 1

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    def build():
        torch.manual_seed(0)
        model = mlp(hidden=32, d_out=4)
        engine = PrivacyEngine(accountant="rdp")
        gsm, dp_opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=NM,
            max_grad_norm=C,
            post_hooks=[Counter()],
        )
        return engine, gsm, dp_opt, dl

    engine, gsm, dp_opt, dl = build()
    for x, y in dl:
        dp_opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        dp_opt.step()
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=gsm, optimizer=dp_opt)
    engine2, gsm2, dp_opt2, _ = build()
    engine2.load_checkpoint(path=tmp_path / "ckpt.pt", module=gsm2, optimizer=dp_opt2)
    assert engine2.post_hooks.denoisers[0].calls == engine.post_hooks.denoisers[0].calls == 4
    assert engine2.post_hooks.pipeline.step == 4
    plain = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match="post-hook"):
        plain.load_checkpoint(path=tmp_path / "ckpt.pt", module=gsm2, optimizer=dp_opt2)


@pytest.mark.parametrize(
    "clipping, bad",
    [
        ("flat", 0.0),
        ("flat", -1.0),
        ("flat", float("inf")),
        ("flat", float("nan")),
        ("flat", True),
        ("flat", "1"),
        ("per_layer", [1.0, 0.0, 1.0, 1.0]),
        ("per_layer", [1.0, float("inf"), 1.0, 1.0]),
        ("per_layer", []),
        ("adaptive", 0.0),
    ],
)
@pytest.mark.parametrize("entry", ["make_private", "make_private_with_epsilon"])
def test_max_grad_norm_must_be_finite_and_positive(clipping, bad, entry):
    """Upstream: 0 trains nothing while ε is accounted, inf gives non-finite weights, -1 a raw torch error."""
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    common = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": loader(64, 16, d_out=4),
        "max_grad_norm": bad,
        "clipping": clipping,
    }
    if clipping == "adaptive":
        common.update(
            target_unclipped_quantile=0.5,
            clipbound_learning_rate=0.2,
            max_clipbound=10.0,
            min_clipbound=0.01,
            unclipped_num_std=2.0,
        )
    with pytest.raises(ValueError, match=r"max_grad_norm must be a finite number > 0.*got"):
        if entry == "make_private":
            engine.make_private(noise_multiplier=NM, **common)
        else:
            engine.make_private_with_epsilon(target_epsilon=3.0, target_delta=1e-5, epochs=1, **common)
    assert engine.doctor is None and len(engine.accountant) == 0  # refused before anything was set up


def test_max_grad_norm_zero_upstream_trains_nothing_while_epsilon_grows():
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    before = [p.detach().clone() for p in model.parameters()]
    engine = opacus.PrivacyEngine(accountant="rdp")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=0.0,
    )
    x, y = next(iter(dl))
    opt.zero_grad()
    nn.functional.mse_loss(gsm(x), y).backward()
    opt.step()
    assert engine.get_epsilon(1e-5) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # noise std = σ·0 = 0
