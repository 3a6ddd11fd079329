"""The oracle (opacus_spectral.step.oracle): the clean counterpart of the released gradient is Opacus' clean clipped sum
times clean_scale, exactly; the comparisons are float64; and no other source computes it."""

from __future__ import annotations

import math
import re

import pytest
import torch
from engine_helpers import loader, mlp
from opacus_spectral.step.noise_std import clean_scale
from opacus_spectral.step.oracle import clean_gradients, cosine, norm_ratio
from repo_support import ROOT

from opacus_spectral import PrivacyEngine


def _one_step(noise_multiplier: float):
    torch.manual_seed(0)
    model = mlp()
    engine = PrivacyEngine(accountant="rdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    module, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader(64, 16),
        noise_multiplier=noise_multiplier,
        max_grad_norm=0.5,
        allow_non_private=noise_multiplier == 0,
    )
    x, y = next(iter(dl))
    torch.nn.functional.mse_loss(module(x), y).backward()
    dp_opt.pre_step()  # clip, accumulate, noise, scale: p.grad is the released gradient, p.summed_grad the clean sum
    return dp_opt


def test_without_noise_the_clean_gradient_is_the_released_one():
    dp_opt = _one_step(0.0)
    params = list(dp_opt.params)
    clean = clean_gradients(dp_opt, params)
    assert all(torch.equal(c, p.grad) for c, p in zip(clean, params, strict=True))
    assert cosine([p.grad for p in params], clean) == pytest.approx(1.0, abs=1e-12)
    assert norm_ratio([p.grad for p in params], clean) == pytest.approx(1.0, abs=1e-12)


def test_clean_gradients_are_the_sum_times_the_scale_shaped_like_the_parameter():
    dp_opt = _one_step(1.0)
    p = dp_opt.params[0]
    (c,) = clean_gradients(dp_opt, [p])
    assert c.shape == p.shape and torch.equal(c, p.summed_grad.view_as(p) * clean_scale(dp_opt))
    (c64,) = clean_gradients(dp_opt, [p], dtype=torch.float64, scale=0.5)
    assert c64.dtype == torch.float64 and torch.equal(c64, p.summed_grad.double().view_as(p) * 0.5)
    del p.summed_grad
    (missing,) = clean_gradients(dp_opt, [p])
    assert missing.shape == p.shape and bool(missing.isnan().all())


def test_cosine_and_norm_ratio_of_concatenations():
    a, b = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])], [torch.tensor([1.0, 0.0]), torch.tensor([[0.0]])]
    assert cosine(a, b) == pytest.approx(0.6, abs=1e-15) and norm_ratio(a, b) == pytest.approx(5.0, abs=1e-15)
    assert math.isnan(cosine(a, [torch.zeros(2), torch.zeros(1, 1)]))


def test_no_other_source_forms_the_clean_gradient():
    """The formula ``summed_grad × clean_scale`` lives in the oracle alone (the engine, the harness's probes, the
    demo and the audit's deliberately broken denoiser call it)."""
    pattern = re.compile(r"summed_grad[\w.()]*\s*\*|\*\s*\w*\.summed_grad")
    sources = [
        p
        for d in ("opacus_spectral/src", "peft_lalora/src", "benchmarks/src", "plugins")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "oracle.py"
    ]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
