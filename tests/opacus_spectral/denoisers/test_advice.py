"""Advice on measured-harmful combinations: a temporal denoiser in front of an adaptive optimizer or SGD momentum
warns once at installation (``DenoiserAdviceWarning``); everything else stays silent."""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus_spectral.denoisers import EMADenoiser, RMTDenoiser
from opacus_spectral.denoisers.advice import combination_advice
from opacus_spectral.errors import DenoiserAdviceWarning
from torch import nn

from opacus_spectral import PrivacyEngine


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3, 2))]


class _TemporalCallable:
    """A plain callable (no ``Denoiser`` base) that declares it averages over steps."""

    name = "mine"
    temporal = True

    def __call__(self, grads):
        return None


@pytest.mark.parametrize(
    ("optimizer", "denoisers", "expected"),
    [
        (lambda p: torch.optim.AdamW(p, lr=1e-3), [EMADenoiser()], "AdamW"),
        (lambda p: torch.optim.Adam(p, lr=1e-3), [RMTDenoiser(), _TemporalCallable()], "'mine'"),
        (lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9), [EMADenoiser()], "momentum > 0"),
        (lambda p: torch.optim.SGD(p, lr=1.0), [EMADenoiser()], None),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), [RMTDenoiser()], None),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), [], None),
    ],
)
def test_combination_advice(optimizer, denoisers, expected) -> None:
    messages = combination_advice(optimizer(_params()), denoisers)
    if expected is None:
        assert messages == []
    else:
        assert len(messages) == 1 and expected in messages[0] and "docs/denoisers.md" in messages[0]


def test_momentum_in_any_param_group_counts() -> None:
    p, q = _params(), _params()
    opt = torch.optim.SGD([{"params": p}, {"params": q, "momentum": 0.5}], lr=1.0)
    assert len(combination_advice(opt, [EMADenoiser()])) == 1


def _make_private(optimizer_factory, post_hooks) -> list[warnings.WarningMessage]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=optimizer_factory(model.parameters()),
            data_loader=torch.utils.data.DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            post_hooks=post_hooks,
        )
    return [w for w in caught if issubclass(w.category, DenoiserAdviceWarning)]


def test_make_private_warns_once_for_ema_in_front_of_adamw_and_not_for_sgd_without_momentum() -> None:
    found = _make_private(lambda p: torch.optim.AdamW(p, lr=1e-3), ["ema", "rmt"])
    assert len(found) == 1 and "'ema'" in str(found[0].message)
    assert found[0].filename == __file__  # points at the caller's make_private, not inside the package
    assert _make_private(lambda p: torch.optim.SGD(p, lr=1.0), ["ema", "rmt"]) == []
    assert _make_private(lambda p: torch.optim.AdamW(p, lr=1e-3), ["rmt"]) == []
