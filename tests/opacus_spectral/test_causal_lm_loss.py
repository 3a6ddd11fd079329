"""The per-example causal-LM loss (opacus_spectral.losses): the privacy property itself, in hooks / functorch /
ghost modes, against HF's batch-token mean run through the same harness; equality with HF's loss at equal token
counts; empty / all -100 / length-1 sequences; Opacus' ghost averaging; the errors."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("peft")
from opacus.utils.fast_gradient_clipping_utils import (  # noqa: E402
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)
from opacus_spectral.losses import ghost_causal_lm_loss, next_token_targets, per_sequence_loss  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import opacus_spectral  # noqa: E402
from opacus_spectral import causal_lm_loss  # noqa: E402

VOCAB, T, C = 97, 16, 0.5
MODES = ["hooks", "functorch", "ghost"]
#: example 0 is long, the others short: under a batch-token mean its presence rescales everybody else.
LENGTHS = [16, 3, 4, 2, 5, 3, 4, 2]


def tiny_lora_llama() -> nn.Module:
    """The seeded tiny Llama + LoRA on q_proj / v_proj (both factors random, so both get gradients)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = get_peft_model(
            LlamaForCausalLM(config),
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False),
        )
    return model.train()


def make_batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels): right padding with id 0, labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    return ids, mask, ids.masked_fill(mask == 0, -100)


def rows(batch, keep) -> tuple[torch.Tensor, ...]:
    return tuple(t[keep] for t in batch)


def hf_token_mean_vector(logits, labels) -> torch.Tensor:
    """HF's loss written as per-example terms (what a per-sample wrapper of it clips): B·s_i/N, mean = HF's."""
    targets = labels[:, 1:]
    counts = (targets != -100).sum(dim=1)
    sums = per_sequence_loss(logits, labels) * counts.clamp(min=1)
    return sums * len(labels) / counts.sum()


def clipped_sum(mode: str, kind: str, batch, reduction: str = "mean", wrap_model: bool = True) -> torch.Tensor:
    """Σ_i clip_C(g_i) over the batch (Opacus' ``summed_grad``, no noise) for the per-example loss (``ours``)
    or HF's batch-token mean (``hf``: the model's own ``labels=`` loss, or its per-example form in ghost mode)."""
    ids, mask, labels = batch
    model = tiny_lora_llama()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loader = DataLoader(TensorDataset(ids), batch_size=len(ids))
    kw = {"criterion": nn.CrossEntropyLoss(reduction=reduction)} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opacus_spectral.PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            grad_sample_mode=mode,
            loss_reduction=reduction,
            allow_non_private=True,
            post_hooks=[],
            poisson_sampling=False,
            wrap_model=wrap_model,
            **kw,
        )
    private, dp_opt = (out[0] if wrap_model else model), out[1]
    res = private(input_ids=ids, attention_mask=mask, labels=labels if kind == "hf" else None)
    if mode == "ghost":
        if kind == "ours":
            loss = ghost_causal_lm_loss(out[2], res.logits, labels, mask)
        else:
            vector = hf_token_mean_vector(res.logits, labels)
            torch.testing.assert_close(vector.mean(), res.loss)
            loss = DPTensorFastGradientClipping(out[2].module, dp_opt, vector, reduction)
        loss.backward()
        dp_opt.accumulate()
    else:
        loss = causal_lm_loss(res.logits, labels, mask, reduction=reduction) if kind == "ours" else res.loss
        loss.backward()
        dp_opt.clip_and_accumulate()
    return torch.cat([p.summed_grad.flatten() for p in dp_opt.params])


def _batches() -> dict[str, tuple[torch.Tensor, ...]]:
    base = make_batch(LENGTHS)
    short = tuple(t.clone() for t in base)
    short[0][0, 2:], short[1][0, 2:], short[2][0, 2:] = 0, 0, -100
    empty = (base[0], base[1], base[2].clone())
    empty[2][0] = -100
    first = [0]
    return {
        "D": base,
        "remove": rows(base, slice(1, None)),
        "empty": empty,
        "length": short,
        "alone": rows(base, first),
        "alone_short": rows(short, first),
    }


BATCHES = _batches()
#: neighbour of D -> example 0's batch of one in D and in the neighbour (None: the neighbour lacks it)
NEIGHBOURS = {"remove": ("alone", None), "empty": ("alone", None), "length": ("alone", "alone_short")}


@functools.cache
def named_sum(mode: str, kind: str, name: str) -> torch.Tensor:
    return clipped_sum(mode, kind, BATCHES[name])


def own_change(mode: str, name: str) -> torch.Tensor:
    """Example 0's own clipped gradient in D minus its own in the neighbour (each computed alone; with one
    example in the batch HF's batch-token mean is that example's own mean, so the per-example loss is used)."""
    alone, after = NEIGHBOURS[name]
    return named_sum(mode, "ours", alone) - (named_sum(mode, "ours", after) if after is not None else 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_neighbouring_batches_differ_only_by_the_changed_example(mode):
    """Per-example loss: S(D) − S(D′) is exactly example 0's own change (its clipped gradient computed alone),
    so ‖S(D) − S(D′)‖ ≤ C for add/remove (an all -100 example counts as removed) and ≤ 2C for a changed
    length (a replace-one neighbour)."""
    for name in NEIGHBOURS:
        diff = named_sum(mode, "ours", "D") - named_sum(mode, "ours", name)
        torch.testing.assert_close(diff, own_change(mode, name), atol=1e-5, rtol=1e-4, msg=f"{mode}/{name}")
        bound = 2 * C if name == "length" else C
        assert 0.0 < diff.norm().item() <= bound * (1 + 1e-5), (mode, name, diff.norm().item())


@pytest.mark.parametrize("mode", MODES)
def test_same_harness_fails_for_hf_batch_token_mean(mode):
    """HF's batch-token mean through the same harness: the other examples' clipped gradients change with
    example 0's presence or length, and the add/remove difference exceeds C."""
    for name in NEIGHBOURS:
        diff = named_sum(mode, "hf", "D") - named_sum(mode, "hf", name)
        assert (diff - own_change(mode, name)).norm().item() > 0.1 * C, (mode, name)
        if name != "length":
            assert diff.norm().item() > 1.05 * C, (mode, name, diff.norm().item())


def test_hf_loss_on_one_example_is_its_own_mean():
    """What own_change relies on: for a batch of one the two losses give the same clipped gradient."""
    torch.testing.assert_close(named_sum("hooks", "hf", "alone"), named_sum("hooks", "ours", "alone"))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_sum_reduction_gives_the_same_clipped_sum(mode):
    torch.testing.assert_close(
        clipped_sum(mode, "ours", BATCHES["D"], reduction="sum"), named_sum(mode, "ours", "D"), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_wrap_model_false_gives_the_same_clipped_sum(mode):
    """DPTrainer's setting (hooks on the user's PeftModel, no GradSampleModule)."""
    torch.testing.assert_close(clipped_sum(mode, "ours", BATCHES["D"], wrap_model=False), named_sum(mode, "ours", "D"))


def random_logits(batch: int, steps: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, steps, VOCAB, generator=g, requires_grad=True)


def test_equals_hf_loss_when_every_sequence_has_the_same_number_of_tokens():
    model = tiny_lora_llama()
    ids, mask, labels = make_batch([16, 16, 16])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(causal_lm_loss(out.logits, labels, mask), out.loss)
    # the same token count placed differently: a -100 prompt in one row, right padding in another
    logits = random_logits(3, 10)
    labels = torch.randint(0, VOCAB, (3, 10))
    labels[0, :4] = -100
    labels[1, 7:] = -100
    labels[2, 1:4] = -100
    hf = ForCausalLMLoss(logits, labels, VOCAB)
    torch.testing.assert_close(causal_lm_loss(logits, labels), hf)
    labels[0, 4] = -100  # one row loses a token: the batch-token mean now weighs the rows differently
    assert not torch.allclose(causal_lm_loss(logits, labels), ForCausalLMLoss(logits, labels, VOCAB))


def test_each_sequence_is_averaged_over_its_own_tokens():
    logits = random_logits(2, 6)
    labels = torch.randint(0, VOCAB, (2, 6))
    labels[1, 3:] = -100
    ce = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="none")
    ce = ce.view(2, 5)
    expected = torch.stack([ce[0].mean(), ce[1, :2].mean()])
    torch.testing.assert_close(per_sequence_loss(logits, labels), expected)
    torch.testing.assert_close(causal_lm_loss(logits, labels, reduction="sum"), expected.sum())


def test_empty_sequences_give_zero_loss_and_zero_gradient_not_nan():
    logits = random_logits(3, 5)
    labels = torch.randint(0, VOCAB, (3, 5))
    labels[1] = -100  # all ignored
    labels[2, 1:] = -100  # only the first token: nothing to predict
    mask = torch.ones_like(labels)
    losses = per_sequence_loss(logits, labels, mask)
    assert torch.isfinite(losses).all() and losses[1] == 0 and losses[2] == 0 and losses[0] > 0
    losses.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[1:].abs().max() == 0
    one = random_logits(2, 1)  # length-1 sequences have no next-token target
    single = per_sequence_loss(one, torch.randint(0, VOCAB, (2, 1)))
    assert single.tolist() == [0.0, 0.0]
    single.sum().backward()
    assert one.grad.abs().max() == 0


def test_an_empty_batch_gives_zero_not_nan():
    empty = per_sequence_loss(random_logits(0, 4), torch.zeros(0, 4, dtype=torch.long))
    assert empty.shape == (0,)
    assert causal_lm_loss(random_logits(0, 4), torch.zeros(0, 4, dtype=torch.long)).item() == 0.0


def test_attention_mask_masks_padding_on_either_side():
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])  # right padding, left padding
    expected = torch.tensor([[6, 7, -100], [-100, -100, 12]])
    assert torch.equal(next_token_targets(labels, mask), expected)


def test_half_precision_logits_give_a_float32_loss():
    logits = random_logits(2, 4).detach()
    labels = torch.randint(0, VOCAB, (2, 4))
    loss = per_sequence_loss(logits.to(torch.bfloat16), labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, per_sequence_loss(logits.to(torch.bfloat16).float(), labels))


def test_ghost_vector_equals_opacus_per_sequence_averaging():
    """Opacus' DPLossFastGradientClipping (mean, ``shape=``) averages each row over its non-ignore_index
    targets: on shifted, padding-masked targets it gives exactly :func:`per_sequence_loss`."""
    model = tiny_lora_llama()
    ids, mask, labels = make_batch(LENGTHS)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loader = DataLoader(TensorDataset(ids), batch_size=len(ids))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, criterion, _ = opacus_spectral.PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            grad_sample_mode="ghost",
            allow_non_private=True,
            post_hooks=[],
            poisson_sampling=False,
            criterion=nn.CrossEntropyLoss(),
        )
    logits = random_logits(len(LENGTHS), T)
    targets = next_token_targets(labels, mask)
    theirs = criterion(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), shape=(len(LENGTHS), T - 1))
    ours = ghost_causal_lm_loss(criterion, logits, labels, mask)
    torch.testing.assert_close(ours.loss_per_sample, theirs.loss_per_sample)
    assert isinstance(criterion, DPLossFastGradientClipping)


def test_bad_input_is_refused_with_the_fix():
    logits = random_logits(2, 4)
    labels = torch.randint(0, VOCAB, (2, 4))
    with pytest.raises(ValueError, match="unflattened"):
        per_sequence_loss(logits.reshape(8, VOCAB), labels)
    with pytest.raises(ValueError, match="unshifted labels"):
        per_sequence_loss(logits, labels[:, 1:])
    with pytest.raises(ValueError, match="attention_mask"):
        per_sequence_loss(logits, labels, torch.ones(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        per_sequence_loss(labels[..., None].expand(2, 4, 3), labels)
    with pytest.raises(ValueError, match="loss_reduction"):
        causal_lm_loss(logits, labels, reduction="none")
    with pytest.raises(TypeError, match="causal_lm_loss"):
        ghost_causal_lm_loss(nn.CrossEntropyLoss(), logits, labels)
