"""No clean gradient can reach a denoiser: the memory a denoiser saw is never written by a later backward.

Opacus' ``DPOptimizer.zero_grad()`` defaults to ``set_to_none=False``: the next ``backward()`` accumulates the
next batch's clean, unclipped gradient into the *same* ``p.grad`` memory. A denoiser that kept a view of a
record's tensor (``rec.tensor.detach()``) or handed back its own state tensor as the new ``p.grad`` would then
read that clean gradient at the next step. The engine gives ``p.grad`` fresh memory after the pipeline, and
the conformance kit fails denoisers that keep the storage they were handed.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import Recorder, loader, mlp
from opacus_spectral.plugins.testing import check_denoiser
from torch import nn

from opacus_spectral import Denoiser, PrivacyEngine


class LeakyEma(Denoiser):
    """EMA (β = ½) that keeps ``rec.tensor.detach()`` — a view of the memory it was handed — as its state."""

    name = "leaky-ema"

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}

    def __call__(self, grads):
        out = []
        for g in grads:
            prev = self.state.get(g.name)
            out.append(None if prev is None else 0.5 * prev + 0.5 * g.tensor)
            self.state[g.name] = g.tensor.detach()  # the bug: no .clone()
        return out

    def state_dict(self):
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state):
        self.state = {k: v.clone() for k, v in state.items()}

    def reset(self):
        self.state = {}


class StateReturningEma(Denoiser):
    """EMA that returns its own state tensor as the new gradient and updates it in place next step."""

    name = "state-ema"

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}

    def __call__(self, grads):
        out = []
        for g in grads:
            m = self.state.get(g.name)
            if m is None:
                m = self.state[g.name] = g.tensor.detach().clone()
            else:
                m.mul_(0.5).add_(g.tensor, alpha=0.5)
            out.append(m)
        return out


def _two_steps(denoiser: Denoiser):
    """Two DP steps with the README loop (``zero_grad()`` keeps ``p.grad`` memory); records before/after."""
    before, after = Recorder(), Recorder()
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4),
        noise_multiplier=1.1,
        max_grad_norm=1.0,
        post_hooks=[before, denoiser, after],
    )
    it = iter(dl)
    for _ in range(2):
        x, y = next(it)
        dp_opt.zero_grad()  # set_to_none=False: the next backward writes into the same p.grad memory
        nn.functional.mse_loss(gsm(x), y).backward()
        dp_opt.step()
    return before, after


@pytest.mark.parametrize("cls", [LeakyEma, StateReturningEma])
def test_released_update_mixes_only_noisy_gradients(cls):
    before, after = _two_steps(cls())
    for noisy0, noisy1, released in zip(before.seen[0], before.seen[1], after.seen[1], strict=True):
        expected = 0.5 * noisy0["tensor"] + 0.5 * noisy1["tensor"]
        # with the leak the first term is the clean gradient of batch 2 instead (max |diff| was 0.0 to it)
        torch.testing.assert_close(released["tensor"], expected, rtol=1e-6, atol=1e-7)


def test_conformance_kit_fails_a_denoiser_that_keeps_its_input_storage():
    with pytest.raises(AssertionError, match="storage"):
        check_denoiser(LeakyEma, stateful=True, sigma_zero_identity=False)


def test_conformance_kit_accepts_a_state_returning_denoiser():
    # returning (and later updating) its own state is allowed: the engine copies outputs into fresh p.grad
    check_denoiser(StateReturningEma, sigma_zero_identity=False, dtypes=(torch.float32,))
