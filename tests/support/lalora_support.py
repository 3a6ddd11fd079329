"""Shared builders for the peft-lalora tests (tiny random BERT / GPT-2, generated data). No tests here."""

from __future__ import annotations

import torch
from peft import get_peft_model
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

import peft_lalora
from peft_lalora import LALoraConfig

VOCAB = 1000
SEQ = 8


def bert_base(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        num_labels=2,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


def gpt2_base(seed: int = 0) -> GPT2ForSequenceClassification:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        num_labels=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2ForSequenceClassification(cfg)


def lalora_config(arch: str, **kw: object) -> LALoraConfig:
    if arch == "bert":
        base = dict(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS", lora_dropout=0.0)
    else:  # GPT-2 Conv1D layers: fan_in_fan_out
        base = dict(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="SEQ_CLS", lora_dropout=0.0
        )
    base.update(kw)
    return LALoraConfig(**base)  # type: ignore[arg-type]


def build(arch: str = "bert", seed: int = 0, **kw: object):
    """A fresh PEFT model with a LALoRA adapter; B is initialised non-zero when ``init_b`` is set."""
    init_b = kw.pop("init_b", False)
    base = bert_base(seed) if arch == "bert" else gpt2_base(seed)
    model = get_peft_model(base, lalora_config(arch, **kw))
    if init_b:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for f in peft_lalora.find_lora_factors(model):
                if f.factor == "B":
                    f.param.copy_(0.1 * torch.randn(f.param.shape, generator=g))
    return model


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def factor_snapshot(model) -> dict[str, torch.Tensor]:
    return {f.name: f.param.detach().clone() for f in peft_lalora.find_lora_factors(model)}


def changed_factors(before: dict[str, torch.Tensor], model) -> str:
    """Which factors moved since ``before``: "A", "B", "AB" or "" — asserting all-or-none per factor."""
    moved: dict[str, list[bool]] = {"A": [], "B": []}
    for f in peft_lalora.find_lora_factors(model):
        moved[f.factor].append(not torch.equal(before[f.name], f.param.detach()))
    out = ""
    for k in ("A", "B"):
        if any(moved[k]):
            assert all(moved[k]), f"only some {k} factors moved: {moved[k]}"
            out += k
    return out
