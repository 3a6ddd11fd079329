"""opacus_spectral.PrivacyEngine as a drop-in for opacus.PrivacyEngine: where Opacus trains, ours trains the same.

Noise 0 (one warning, no error), every grad-sample mode under the default doctor, a deep copy of the private model
(an EMA / teacher copy), and zero-size layers — each compared with vanilla Opacus, bit for bit."""

from __future__ import annotations

import copy
import pickle
import warnings

import opacus
import pytest
import torch
from engine_helpers import Recorder
from opacus.optimizers import DPOptimizer
from opacus_spectral.errors import DoctorError, NonPrivateWarning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_spectral

MODES = ["hooks", "functorch", "ew", "ghost"]


@pytest.fixture(autouse=True)
def _opacus_optimizer_classes_restored():
    """A failing copy test must not break DPOptimizer for the rest of the session (torch patches the class)."""
    before = DPOptimizer.__dict__["step"]
    yield
    DPOptimizer.step = before


def classifier(widths=(6, 8, 3), seed=0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def data(d_in=6, classes=3, n=32, batch=8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g))
    return DataLoader(ds, batch_size=batch, generator=torch.Generator().manual_seed(2))  # the Poisson sampler's


def private(engine, model, *, mode="hooks", nm=1.0, **kw):
    """``make_private`` with explicit noise and sampling generators, so two engines draw the same."""
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=data(model[0].in_features),
        noise_multiplier=nm,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        noise_generator=torch.Generator().manual_seed(3),
        **({"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}),
        **kw,
    )


def train(out, mode, steps=3) -> None:
    module, optimizer, loader = out[0], out[1], out[-1]
    loss_fn = out[2] if mode == "ghost" else nn.functional.cross_entropy
    for _, (x, y) in zip(range(steps), loader, strict=False):
        optimizer.zero_grad()
        loss_fn(module(x), y).backward()
        optimizer.step()
    optimizer.zero_grad()  # clears grad_sample too: ExpandedWeights refuses a forward while it is set


def trained(engine_cls, mode, *, widths=(6, 8, 3), nm=1.0, **kw) -> tuple[list[torch.Tensor], list, object]:
    model = classifier(widths)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = engine_cls()
        out = private(engine, model, mode=mode, nm=nm, **kw)
        train(out, mode)
    return [p.detach().clone() for p in model.parameters()], caught, engine


def non_private(caught) -> list:
    return [w for w in caught if "NOT differentially private" in str(w.message)]


# ------------------------------------------------------------------------------------- noise 0
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("post_hooks", [None, []])
def test_noise_zero_trains_as_in_opacus_with_one_non_private_warning(mode, post_hooks):
    theirs, _, _ = trained(opacus.PrivacyEngine, mode, nm=0.0)
    ours, caught, engine = trained(opacus_spectral.PrivacyEngine, mode, nm=0.0, post_hooks=post_hooks)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    (warning,) = non_private(caught)
    assert warning.category is NonPrivateWarning and issubclass(NonPrivateWarning, RuntimeWarning)
    assert "allow_non_private=True" in str(warning.message) and warning.filename == __file__
    assert engine.doctor is not None and engine.doctor.findings == []


def test_allow_non_private_silences_the_warning():
    ours, caught, _ = trained(opacus_spectral.PrivacyEngine, "hooks", nm=0.0, allow_non_private=True)
    theirs, _, _ = trained(opacus.PrivacyEngine, "hooks", nm=0.0)
    assert non_private(caught) == [] and all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


def test_noise_zero_with_denoisers_needs_the_opt_in():
    with pytest.raises(ValueError, match="denoisers in post_hooks.*allow_non_private=True"):
        private(opacus_spectral.PrivacyEngine(), classifier(), nm=0.0, post_hooks=["rmt"])
    rec = Recorder()
    opt_in = {"post_hooks": [rec], "allow_non_private": True}
    _, caught, engine = trained(opacus_spectral.PrivacyEngine, "hooks", nm=0.0, **opt_in)
    assert non_private(caught) == [] and engine.post_hooks.logical_steps == 3
    assert {r["sigma"] for step in rec.seen for r in step} == {0.0}


# ------------------------------------------------------------------------------------- doctor in every mode
@pytest.mark.parametrize("mode", MODES)
def test_default_doctor_trains_bit_identically_in_every_grad_sample_mode(mode):
    theirs, _, _ = trained(opacus.PrivacyEngine, mode)
    ours, caught, engine = trained(opacus_spectral.PrivacyEngine, mode)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    assert engine.doctor is not None and engine.doctor.dp_steps == 3 and engine.doctor.findings == []
    assert not [w for w in caught if "doctor" in str(w.message)]


@pytest.mark.parametrize("mode", MODES)
def test_the_doctors_forward_check_runs_in_every_grad_sample_mode(mode):
    model = classifier()
    out = private(opacus_spectral.PrivacyEngine(), model, mode=mode, doctor="raise")
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())  # replaced after make_private (#820)
    with pytest.raises(DoctorError, match="optimizer_params"):
        train(out, mode, steps=1)


# ------------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_of_the_private_model_works_and_never_breaks_dpoptimizer(mode):
    model = classifier()
    engine = opacus_spectral.PrivacyEngine()
    out = private(engine, model, mode=mode, doctor="raise", post_hooks=["rmt"])
    train(out, mode, steps=1)
    copies = [copy.deepcopy(out[0])]  # an EMA / teacher copy
    vanilla_model = classifier()
    vanilla_out = private(opacus.PrivacyEngine(), vanilla_model, mode=mode)
    train(vanilla_out, mode, steps=1)
    try:  # pickle as far as Opacus' module pickles (functorch's per-layer closures do not)
        pickle.dumps(vanilla_out[0])
    except AttributeError:
        with pytest.raises(AttributeError, match="local object"):
            pickle.dumps(out[0])
    else:
        copies.append(pickle.loads(pickle.dumps(out[0])))
    x, y = next(iter(data()))
    for other in copies:
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)  # edited freely: the copy is not the private model, the doctor does not watch it
            assert not torch.equal(other(x), out[0](x))
        other.eval()
        other(x)  # an eval-mode teacher forward (grad enabled; Opacus' hooks and ours stay out of it)
    train(out, mode, steps=2)
    assert engine.doctor.findings == [] and engine.doctor.dp_steps == 3
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="DPOptimizer cannot be copied or pickled.*state_dict"):
            attempt(out[1])
    assert not hasattr(DPOptimizer.step, "hooked")  # torch's __setstate__ never ran on DPOptimizer
    train(vanilla_out, mode, steps=1)  # vanilla DPOptimizers, the one from before and a new one, still step
    train(private(opacus.PrivacyEngine(), classifier(seed=1)), "hooks", steps=2)


# ------------------------------------------------------------------------------------- zero-size layers
@pytest.mark.parametrize("mode", MODES)
def test_zero_size_layer_trains_as_in_opacus(mode):
    widths = (6, 0, 4, 3)  # nn.Linear(6, 0) then nn.Linear(0, 4): empty weights and gradients
    theirs, _, _ = trained(opacus.PrivacyEngine, mode, widths=widths)
    ours, _, engine = trained(opacus_spectral.PrivacyEngine, mode, widths=widths, doctor="raise")
    assert [t.numel() for t in ours][:2] == [0, 0]
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    assert engine.doctor.first_step_checked and engine.doctor.findings == []
