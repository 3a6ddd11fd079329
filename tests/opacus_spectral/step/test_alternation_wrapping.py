"""Alternation-safe Opacus wrapping: toggling which LoRA factor trains between steps (upstream crashes with
"No activations detected" / stale ghost norms), per_layer + toggling refused, unsupported params named."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_bert, token_loader
from torch import nn

from opacus_spectral import PrivacyEngine, set_trainable


def _lora_model(targets=("query", "value")):
    model = tiny_bert()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="SEQ_CLS", lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    for n, p in peft_model.named_parameters():  # B starts at 0: give it a value so A's gradient is not 0
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    return peft_model


def _factors(model):
    a = [p for n, p in model.named_parameters() if "lora_A" in n]
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    return a, b


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("wrap_model", [True, False])
def test_toggling_factors_trains_only_active_factor(mode, wrap_model):
    if mode == "functorch" and not wrap_model:
        pytest.skip("covered by hooks+wrap_model=False (same hooks class)")
    torch.manual_seed(0)
    model = _lora_model()
    a, b = _factors(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=token_loader(),
        noise_multiplier=0.5,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        wrap_model=wrap_model,
        post_hooks=[],
    )
    wrapped, dp_opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    net = wrapped if wrap_model else model
    steps = 0
    for step in range(4):
        active, frozen = (b, a) if step % 2 == 0 else (a, b)
        set_trainable(frozen, False)
        set_trainable(active, True)
        snap_a = [p.detach().clone() for p in active]
        snap_f = [p.detach().clone() for p in frozen]
        x, y = next(iter(dl))
        dp_opt.zero_grad()
        crit(net(x).logits, y).backward()
        dp_opt.step()
        steps += 1
        assert all(torch.equal(s, p) for s, p in zip(snap_f, frozen, strict=True)), (
            f"frozen factor moved at step {step}"
        )
        assert all(not torch.equal(s, p) for s, p in zip(snap_a, active, strict=True)), (
            f"active factor still at step {step}"
        )
    assert steps == 4


def test_ghost_norms_ignore_frozen_factor():
    """Ghost clipping must build per-example norms from the factor trainable *now*. A factor frozen with a plain
    requires_grad_(False) still carries its per-sample norms from the previous step; including them (upstream
    behaviour) would clip the active factor with the wrong norms."""
    torch.manual_seed(0)
    model = _lora_model()
    a, b = _factors(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, crit, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=token_loader(),
        noise_multiplier=0.0,
        max_grad_norm=1e-3,
        allow_non_private=True,
        grad_sample_mode="ghost",
        post_hooks=[],
    )
    x, y = next(iter(dl))
    dp_opt.zero_grad()
    crit(gsm(x).logits, y).backward()
    dp_opt.step()  # both factors: stores _norm_sample on A and B
    for p in a:
        p.requires_grad_(False)  # plain freeze: A keeps its stale norms ...
        p._norm_sample = torch.full_like(p._norm_sample, 10.0)  # ... made large, so including them would show
    dp_opt.zero_grad()
    crit(gsm(x).logits, y).backward()
    stale = [p._norm_sample for p in a]
    active = [p._norm_sample for p in gsm.trainable_parameters if p.requires_grad]
    norms = gsm.get_norm_sample()
    assert torch.allclose(norms, torch.stack(active).norm(2, dim=0))
    assert (torch.stack(active + stale).norm(2, dim=0) > 10).all() and (norms < 5).all()


def test_set_trainable_drops_stale_norms():
    torch.manual_seed(0)
    model = _lora_model()
    a, _ = _factors(model)
    for p in a:
        p._norm_sample = torch.ones(4)
    set_trainable(a, False)
    assert all(p._norm_sample is None and p.grad is None and not p.requires_grad for p in a)


def test_per_layer_clipping_with_toggling_is_refused():
    torch.manual_seed(0)
    model = _lora_model()
    a, b = _factors(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(trainable, lr=0.1),
        data_loader=token_loader(),
        noise_multiplier=0.5,
        max_grad_norm=[1.0] * len(trainable),
        clipping="per_layer",
        post_hooks=[],
    )
    x, y = next(iter(dl))
    nn.functional.cross_entropy(gsm(x).logits, y).backward()
    dp_opt.step()  # all trainable: fine
    set_trainable(a, False)
    before = [p.detach().clone() for p in b]
    dp_opt.zero_grad()
    nn.functional.cross_entropy(gsm(x).logits, y).backward()
    with pytest.raises(RuntimeError, match="per_layer"):
        dp_opt.step()
    assert all(torch.equal(s, p) for s, p in zip(before, b, strict=True))


def test_lora_on_embedding_is_named_at_make_private():
    torch.manual_seed(0)
    model = _lora_model(targets=("word_embeddings", "query"))
    engine = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match=r"lora_embedding_A.*ParameterDict"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=token_loader(),
            noise_multiplier=0.5,
            max_grad_norm=1.0,
        )


def test_set_trainable_clears_per_sample_state():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    p.grad_sample = torch.ones(2, 3)
    p.summed_grad = torch.ones(3)
    p._current_grad_sample = torch.ones(2, 3)
    set_trainable([p], False)
    assert not p.requires_grad and p.grad is None and p.grad_sample is None and p.summed_grad is None
    assert not hasattr(p, "_current_grad_sample")
    set_trainable([p], True)
    assert p.requires_grad
