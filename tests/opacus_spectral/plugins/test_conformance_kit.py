"""The conformance kit itself: it passes a correct denoiser and catches each kind of broken one."""

from __future__ import annotations

import pytest
import torch
from opacus_spectral.plugins.testing import check_denoiser

from opacus_spectral import Denoiser


class Shrink(Denoiser):
    name = "shrink"

    def __call__(self, grads):
        return [g.tensor / (1.0 + g.sigma) for g in grads]


class Ema(Denoiser):
    """A correct stateful denoiser: exponential moving average per parameter name."""

    name = "ema"

    def __init__(self):
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}

    def __call__(self, grads):
        out = []
        for g in grads:
            if g.sigma == 0:
                out.append(None)
                continue
            prev = self.state.get(g.name)
            new = g.tensor.float() if prev is None else 0.5 * prev + 0.5 * g.tensor.float()
            self.state[g.name] = new.clone()
            out.append(new.to(g.tensor.dtype))
        return out

    def state_dict(self):
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state):
        self.state = {k: v.clone() for k, v in state.items()}

    def reset(self):
        self.state = {}


class Upcast(Denoiser):
    def __call__(self, grads):
        return [g.tensor.float() for g in grads]


class NoisyAtZero(Denoiser):
    def __call__(self, grads):
        return [g.tensor + 1e-3 for g in grads]


class Hoarder(Denoiser):
    def __init__(self):
        super().__init__()
        self.kept = []

    def __call__(self, grads):
        self.kept.extend(grads)


class Random(Denoiser):
    def __call__(self, grads):
        return [g.tensor + g.sigma * torch.randn_like(g.tensor.float()).to(g.tensor.dtype) for g in grads]


class Renamer(Denoiser):
    def __call__(self, grads):
        for g in grads:
            g.role = "weight"


class ForgetfulEma(Ema):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_correct_denoisers_pass():
    check_denoiser(Shrink)
    check_denoiser(Ema, stateful=True)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Upcast, {}, "changed"),
        (NoisyAtZero, {}, "sigma=0"),
        (Hoarder, {}, "keeps references"),
        (Random, {}, "not deterministic"),
        (Renamer, {}, "metadata"),
        (ForgetfulEma, {"stateful": True}, "resume differs"),
    ],
)
def test_broken_denoisers_are_caught(cls, kwargs, message):
    with pytest.raises((AssertionError, Exception), match=message):
        check_denoiser(cls, **kwargs)


class StorageKeepingEma(Ema):
    """Keeps a *view* of its input (``.detach()``, a new tensor object sharing the storage): the reference check
    alone cannot see it."""

    def __call__(self, grads):
        out = []
        for g in grads:
            prev = self.state.get(g.name)
            out.append(None if prev is None else (0.5 * prev + 0.5 * g.tensor.float()).to(g.tensor.dtype))
            self.state[g.name] = g.tensor.detach()
        return out


def test_kit_detects_retained_storage_not_only_references():
    with pytest.raises(AssertionError, match="keeps the storage"):
        check_denoiser(StorageKeepingEma, stateful=True, sigma_zero_identity=False)


class Halve(Denoiser):
    """Halves every gradient and declares ``gain`` as the output noise's std factor (honest when 0.5)."""

    name = "halve"

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def __call__(self, grads):
        return [g.tensor * 0.5 for g in grads]

    def output_noise(self, grads):
        return self.gain


def test_kit_checks_the_declared_output_noise_against_the_measured_std():
    check_denoiser(lambda: Halve(0.5), sigma_zero_identity=False)  # honest: passes
    lying = r"gain\(s\) \[1.0\] at step 0, but the measured .* is 0\.(4[89]|5[01])\d ×"
    with pytest.raises(AssertionError, match=lying):
        check_denoiser(lambda: Halve(1.0), sigma_zero_identity=False)
    with pytest.raises(AssertionError, match="output_noise declares"):
        check_denoiser(lambda: Halve(0.4), sigma_zero_identity=False)  # 25 % off
    check_denoiser(lambda: Halve(0.47), sigma_zero_identity=False)  # 6 % off: inside the kit's 10 % tolerance
