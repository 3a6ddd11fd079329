"""The built-in denoisers on real gradients: tiny BERT through opacus_spectral.PrivacyEngine.

Task (separable): every token of a sequence comes from the vocabulary half of its label. Low noise
(nm = 0.05) so that many gradient matrices cross the RMT gate and the denoised gradient is what trains the
model; a broken denoised gradient (zero, random, wrong orientation) leaves the accuracy at chance (~0.5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import tiny_bert
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore")


def halves(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    ids = torch.randint(10, 500, (n, 12), generator=g) + 490 * y[:, None]
    return ids, y


def _model(lora: bool) -> nn.Module:
    model = tiny_bert()
    if lora:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], modules_to_save=["classifier"])
        model = get_peft_model(model, cfg)
        model.base_model.model.bert.embeddings.requires_grad_(True)
    return model.train()


def train(mode: str, hooks: list[Any], *, lora: bool) -> tuple[float, list[dict[str, Any]]]:
    """One epoch (32 steps, batch 64) of DP-Adam; returns held-out accuracy and per-step denoiser diagnostics."""
    torch.manual_seed(0)
    model = _model(lora)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2 if lora else 3e-3)
    ids, y = halves(2048, 0)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(ids, y), batch_size=64),
        noise_multiplier=0.05,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        post_hooks=hooks,
        noise_generator=torch.Generator().manual_seed(1),
        poisson_sampling=False,
    )
    gsm, dp_opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    diags = []
    for x, yy in dl:
        dp_opt.zero_grad()
        # explicit per-sample token_type/position ids: BERT's broadcast buffers break per-sample gradients
        pos = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
        crit(gsm(input_ids=x, token_type_ids=torch.zeros_like(x), position_ids=pos).logits, yy).backward()
        dp_opt.step()
        assert engine.post_hooks is not None
        diags.append(engine.post_hooks.diagnostics.last.denoisers)
    gsm.eval()
    xt, yt = halves(512, 1)
    with torch.no_grad():
        acc = (gsm(input_ids=xt).logits.argmax(-1) == yt).double().mean().item()
    return acc, diags


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_full_finetuning_learns_with_rmt(mode: str) -> None:
    acc, diags = train(mode, ["rmt"], lora=False)
    assert all(d["rmt"]["matrices"] == 14 for d in diags)  # 12 encoder + pooler + classifier weights
    assert sum(int(d["rmt"]["gated"]) for d in diags) > 32  # denoising actually happened, every step on average
    assert acc >= 0.7, acc


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_full_finetuning_learns_with_lowpass(mode: str) -> None:
    acc, diags = train(mode, [("lowpass", {"weight_axis": 1})], lora=False)
    assert all(d["lowpass"]["filtered"] == 14 for d in diags)
    assert acc >= 0.7, acc


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("hook", ["rmt", "lowpass"])
def test_lora_learns_with_denoiser(mode: str, hook: str) -> None:
    pytest.importorskip("peft")
    acc, diags = train(mode, [hook], lora=True)
    if hook == "lowpass":  # the roles plugin told the filter which gradients are LoRA A / B
        assert all(d["lowpass"]["filtered"] == 22 for d in diags)
    else:
        assert all(d["rmt"]["matrices"] == 23 for d in diags)  # 22 LoRA factors + classifier head
        assert sum(int(d["rmt"]["gated"]) for d in diags) > 0
    assert acc >= 0.75, acc


def test_lowpass_axis_per_role_on_a_lora_model() -> None:
    """Through the engine on a PEFT LoRA model: A smoothed along input features, B along output features."""
    pytest.importorskip("peft")
    from engine_helpers import Recorder
    from opacus_spectral.denoisers.filters import binomial5

    before, after = Recorder(), Recorder()
    torch.manual_seed(0)
    model = _model(lora=True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids, y = halves(32, 0)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(ids, y), batch_size=32),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        post_hooks=[before, "lowpass", after],
        poisson_sampling=False,
    )
    x, yy = next(iter(dl))
    pos = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
    nn.functional.cross_entropy(
        gsm(input_ids=x, token_type_ids=torch.zeros_like(x), position_ids=pos).logits, yy
    ).backward()
    dp_opt.step()
    seen = 0
    for b, a in zip(before.seen[0], after.seen[0], strict=True):
        assert a["name"] == b["name"]
        if b["role"] == "lora_A":  # (r, in): along dim 1
            assert b["tensor"].shape[0] == 4 and torch.equal(a["tensor"], binomial5(b["tensor"], axis=1))
        elif b["role"] == "lora_B":  # (out, r): along dim 0
            assert b["tensor"].shape[1] == 4 and torch.equal(a["tensor"], binomial5(b["tensor"], axis=0))
        else:
            assert torch.equal(a["tensor"], b["tensor"])
            continue
        assert not torch.equal(a["tensor"], b["tensor"])
        seen += 1
    assert seen == 22
