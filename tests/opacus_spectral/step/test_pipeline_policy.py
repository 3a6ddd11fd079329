"""Policies the pipeline enforces whatever a denoiser or the data does: every malformed output goes through
the error policy, absurd finite outputs are caught by a norm bound, non-finite gradients follow a stated
policy, noise-free training needs an explicit opt-in, selectors that match nothing warn, and checkpoints
never unpickle code."""

from __future__ import annotations

import os
import pickle
import warnings

import opacus
import pytest
import torch
from engine_helpers import Identity, Recorder, loader, mlp
from opacus_spectral.denoisers import LowPassDenoiser, RMTDenoiser
from opacus_spectral.errors import DenoiserError, NonFiniteGradientError, ReproducibleNoiseWarning
from opacus_spectral.step.selection import Selector
from torch import nn

from opacus_spectral import Denoiser, PrivacyEngine

NM, C = 1.1, 1.0


def _private(post_hooks, *, nm=NM, data=None, **kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    with warnings.catch_warnings():  # the same Poisson batches in every run of a test (not private: a test)
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant="rdp", noise_seed=7)
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data or loader(64, 16, d_out=4),
        noise_multiplier=nm,
        max_grad_norm=C,
        post_hooks=post_hooks,
        noise_generator=torch.Generator().manual_seed(7),
        **kwargs,
    )
    return engine, gsm, dp_opt, dl, model


def _steps(gsm, dp_opt, dl, n=2):
    it = iter(dl)
    for _ in range(n):
        x, y = next(it)
        dp_opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        dp_opt.step()


# ------------------------------------------------------------------------------------- malformed outputs
class _Malformed(Denoiser):
    """Edits the gradients in place (×1000), then returns something that is not a list of tensors."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.name = kind, f"malformed-{kind}"

    def __call__(self, grads):
        for g in grads:
            g.tensor.mul_(1000.0)
        if self.kind == "true":
            return True
        if self.kind == "int":
            return 3
        if self.kind == "generator-raises":
            return (g.tensor if i == 0 else 1 / 0 for i, g in enumerate(grads))
        if self.kind == "short":
            return [g.tensor for g in grads][:-1]
        if self.kind == "huge":  # finite but absurd: ×1e30
            return [g.tensor * 1e27 for g in grads]
        if self.kind == "exit":
            raise SystemExit(3)
        raise AssertionError(self.kind)


KINDS = ["true", "int", "generator-raises", "short", "huge", "exit"]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_output_raises_denoiser_error_and_leaves_no_edit(kind):
    engine, gsm, dp_opt, dl, model = _private([_Malformed(kind)])
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.raises(DenoiserError, match=f"malformed-{kind}"):
        dp_opt.step()
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p)
        assert p.grad is None  # the ×1000 in-place edit does not survive for a later step


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_output_falls_back_to_the_noisy_gradient(kind):
    ref = _private([])
    _steps(*ref[1:4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _private([_Malformed(kind)], on_denoiser_error="fallback")
        _steps(*got[1:4])
    for a, b in zip(ref[4].parameters(), got[4].parameters(), strict=True):
        assert torch.equal(a, b)  # bit-identical to no denoiser: the in-place edit was made on a copy
    assert got[0].post_hooks.diagnostics.fallbacks[f"malformed-{kind}"] >= 2
    assert sum(f"malformed-{kind}" in str(w.message) for w in caught) == 1


def test_output_norm_bound_names_the_norms_and_is_configurable():
    engine, gsm, dp_opt, dl, model = _private([_Malformed("huge")])
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.raises(DenoiserError, match=r"norm .* more than max_output_ratio=1000"):
        dp_opt.step()
    # raised bound: accepted, and the weights really move by the absurd amount (the user asked for it)
    engine, gsm, dp_opt, dl, model = _private([_Malformed("huge")], max_output_ratio=1e40)
    w0 = model[0].weight.detach().clone()
    _steps(gsm, dp_opt, dl, 1)
    assert float((model[0].weight - w0).abs().max()) > 1e20
    with pytest.raises(ValueError, match="max_output_ratio"):
        _private([], max_output_ratio=0.5)


def test_a_legitimate_temporal_filter_passes_the_norm_bound():
    class Ema(Denoiser):
        name = "ema"

        def __init__(self):
            super().__init__()
            self.m = {}

        def __call__(self, grads):
            out = []
            for g in grads:
                m = self.m.get(g.name)
                m = g.tensor.clone() if m is None else 0.9 * m + 0.1 * g.tensor
                self.m[g.name] = m
                out.append(m.clone())
            return out

    engine, gsm, dp_opt, dl, model = _private([Ema()])
    _steps(gsm, dp_opt, dl, 4)
    assert engine.post_hooks.diagnostics.errors["ema"] == 0


# ------------------------------------------------------------------------------------- non-finite gradients
NAN = {"poisson_sampling": False}  # fixed batches, so the poisoned example is in the first one


def _nan_loader():
    dl = loader(64, 16, d_out=4)
    x, y = dl.dataset.tensors
    x = x.clone()
    x[3] = float("nan")  # one poisoned example in the first batch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def test_nonfinite_gradient_raises_by_default_and_weights_do_not_move():
    rec = Recorder()
    engine, gsm, dp_opt, dl, model = _private([rec], data=_nan_loader(), **NAN)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.raises(NonFiniteGradientError, match=r"non-finite .*0\.weight"):
        dp_opt.step()
    assert rec.seen == []  # no denoiser saw the step
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p) and p.grad is None


def test_nonfinite_gradient_skip_step_skips_warns_once_and_counts():
    rec = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, gsm, dp_opt, dl, model = _private([rec], data=_nan_loader(), on_nonfinite_grad="skip_step", **NAN)
        before = [p.detach().clone() for p in model.parameters()]
        it = iter(dl)
        x, y = next(it)
        for _ in range(2):  # the poisoned batch twice: skipped twice, one warning
            dp_opt.zero_grad()
            nn.functional.mse_loss(gsm(x), y).backward()
            dp_opt.step()
        for a, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(a, p)
        x, y = next(it)  # a clean batch trains again
        dp_opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        dp_opt.step()
    assert not torch.equal(before[0], model[0].weight)
    assert engine.post_hooks.diagnostics.nonfinite_steps == 2
    assert len(rec.seen) == 1 and rec.seen[0][0]["step"] == 2  # only the finite step (logical step 2)
    assert sum("non-finite" in str(w.message) for w in caught) == 1
    # privacy was spent on every step, skipped or not: 3 DP steps, all in the first pass over these fixed batches
    # (poisson_sampling=False: one Gaussian mechanism per pass, docs/engine.md "Sampling and epsilon")
    assert engine.dp_steps == 3 and engine.accountant.history == [(NM, 1.0, 1)]


def test_nonfinite_gradient_ignore_lets_nan_through_as_opacus_does():
    engine, gsm, dp_opt, dl, model = _private([Identity()], data=_nan_loader(), on_nonfinite_grad="ignore", **NAN)
    _steps(gsm, dp_opt, dl, 1)
    assert not bool(torch.isfinite(model[0].weight).all())
    with pytest.raises(ValueError, match="on_nonfinite_grad"):
        _private([], on_nonfinite_grad="skip")


# ------------------------------------------------------------------------------------- noise-free training
def test_zero_noise_warns_like_a_drop_in_and_denoisers_need_the_opt_in():
    with pytest.warns(RuntimeWarning, match="NOT differentially private.*allow_non_private=True"):
        engine, gsm, dp_opt, dl, model = _private(None, nm=0.0)  # trains, as vanilla Opacus does
    _steps(gsm, dp_opt, dl, 1)
    with pytest.raises(ValueError, match="NOT differentially private.*post_hooks.*allow_non_private=True"):
        _private(["rmt"], nm=0.0)  # denoisers calibrated to noise 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the opt-in silences the warning
        engine, gsm, dp_opt, dl, model = _private(["rmt"], nm=0.0, allow_non_private=True)
        _private([], nm=0.0, allow_non_private=True)
    _steps(gsm, dp_opt, dl, 1)
    # vanilla Opacus accepts it silently (pinned: this is why the warning exists)
    torch.manual_seed(0)
    m = mlp(hidden=32, d_out=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opacus.PrivacyEngine().make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=loader(64, 16, d_out=4),
            noise_multiplier=0.0,
            max_grad_norm=C,
        )


# ------------------------------------------------------------------------------------- selectors
def test_a_plain_string_is_one_role_or_one_name():
    d = RMTDenoiser(roles="weight", params="0.weight")
    assert d.roles == frozenset({"weight"})
    assert d.selects("0.weight", "weight") and not d.selects("2.weight", "weight")
    assert not d.selects("0.weight", "bias")
    with pytest.raises(TypeError, match="roles"):
        RMTDenoiser(roles=["weight", 3])
    lp = LowPassDenoiser(params="0.weight", weight_axis=1)
    assert lp.selects("0.weight", "weight") and not lp.selects("2.weight", "weight")
    assert not lp.selects("0.weight", "bias")


def test_rmt_with_roles_given_as_a_string_still_denoises():
    engine, gsm, dp_opt, dl, model = _private([("rmt", {"roles": "weight"})])
    _steps(gsm, dp_opt, dl, 1)
    assert engine.post_hooks.diagnostics.last.denoisers["rmt"]["matrices"] == 2  # was 0: roles {'w','e','i',...}


def test_a_selector_that_matches_no_parameter_warns_once_at_installation():
    with pytest.warns(RuntimeWarning, match=r"'rmt' selects none of the 4 parameters.*params=\('encoder',\)"):
        _private([("rmt", {"params": "encoder"})])
    with pytest.warns(RuntimeWarning, match="'lowpass' selects none"):
        _private(["lowpass"])  # no LoRA roles and weight_axis=None: it would filter nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _private([("rmt", {"params": ["0."]})])  # matches: silent


CONSULTED: list[str] = []


class _CountingSelector(Selector):
    def matches(self, name: str, role: str) -> bool:
        CONSULTED.append(name)
        return super().matches(name, role)


def test_the_pipeline_alone_selects_once_per_record_and_step():
    """Selection has one owner: the pipeline consults a denoiser's selector once per record per step, and the denoiser
    (and the noise bookkeeping) work on what it was handed. Before: up to three times more (rmt twice, noise model)."""
    rmt = RMTDenoiser()
    rmt.selector = _CountingSelector(roles=frozenset({"weight"}))

    def undeclared(grads):  # declares no output noise: rmt skips its records (and the pipeline says so, once)
        return None

    engine, gsm, dp_opt, dl, _ = _private([undeclared, rmt])
    CONSULTED.clear()
    with pytest.warns(RuntimeWarning, match=r"'rmt' acts only on isotropic noise.*2 parameter\(s\) it selects"):
        _steps(gsm, dp_opt, dl, 1)
    assert sorted(CONSULTED) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert engine.post_hooks.diagnostics.last.denoisers["rmt"]["skipped_noise"] == 2


# ------------------------------------------------------------------------------------- checkpoints
class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_load_checkpoint_never_unpickles_code_unless_trusted(tmp_path):
    engine, gsm, dp_opt, dl, model = _private(["rmt"])
    _steps(gsm, dp_opt, dl, 2)
    good = tmp_path / "good.pt"
    engine.save_checkpoint(path=good, module=gsm, optimizer=dp_opt)
    engine2, gsm2, dp_opt2, _, _ = _private(["rmt"])
    engine2.load_checkpoint(path=good, module=gsm2, optimizer=dp_opt2)  # our own state: weights_only is enough
    assert engine2.accountant.history == engine.accountant.history
    assert engine2.post_hooks.pipeline.step == 2

    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt"
    ckpt = torch.load(good, weights_only=True)
    ckpt["extra"] = _Evil(str(marker))
    torch.save(ckpt, bad)
    with pytest.raises(pickle.UnpicklingError, match="trusted=True"):
        engine2.load_checkpoint(path=bad, module=gsm2, optimizer=dp_opt2)
    assert not marker.exists()
    engine2.load_checkpoint(path=bad, module=gsm2, optimizer=dp_opt2, trusted=True)  # the caller's decision
    assert marker.exists()
