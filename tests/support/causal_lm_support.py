"""The causal-LM DPTrainer tests' shared setup (no tests here): a word-level tokenizer over a 97-word vocabulary,
learnable toy text, a tiny random Llama with LoRA on q/v, the Trainer's arguments and a DPTrainer with noise 0 by
default."""

from __future__ import annotations

import warnings

import datasets
import torch
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from trainer_support import quiet_cpu_args, split, with_dp
from transformers import (
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB = 97
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 11  # noise_seed of the comparisons (reproducible, NOT private)
#: the DP settings of :func:`trainer` unless a test gives others: noise 0 (a clipping-only run)
DP = dict(
    noise_multiplier=0.0,
    target_epsilon=None,
    target_delta=1e-5,
    per_sample_max_grad_norm=1.0,
    accountant="rdp",
    make_private_kwargs={"allow_non_private": True},
)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "[PAD] [UNK] [EOS] w0 ... w93" (97 ids, the tiny Llama's vocabulary)."""
    words = ["[PAD]", "[UNK]", "[EOS]"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def corpus(n: int, seed: int = 0, words: int = 10) -> list[str]:
    """Learnable toy text: runs of 3-11 words cycling through w0 ... w9 (next word = this word + 1 mod 10)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length, start = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((3, 12), (0, words)))
        out.append(" ".join(f"w{(start + j) % words}" for j in range(length)))
    return out


def lm_dataset(n: int, seed: int = 0) -> datasets.Dataset:
    tok = tokenizer()
    return datasets.Dataset.from_dict({"text": corpus(n, seed)}).map(
        lambda b: tok(b["text"]), batched=True, remove_columns=["text"]
    )


def collator() -> DataCollatorForLanguageModeling:
    return DataCollatorForLanguageModeling(tokenizer(), mlm=False)  # labels = ids, -100 on padding


def llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def lora_llama(config=None, seed: int = 0) -> nn.Module:
    config = config or LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(llama(seed), config)


def args(tmp_path, **kw) -> DPTrainingArguments:
    """The causal-LM runs' settings (the DP ones: :data:`DP`); ``kw`` sets or overrides any of them."""
    run = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        learning_rate=1.0,
        per_device_eval_batch_size=8,
    )
    return quiet_cpu_args(tmp_path, **{**run, **DP, **kw})


def trainer(tmp_path, model, data, *, train_args=None, lr: float = 1.0, **kw) -> DPTrainer:
    """A DPTrainer on ``model`` and ``data``: ``train_args`` (default :func:`args`) with :data:`DP` and the argument
    fields of ``kw`` applied over it; the rest of ``kw`` goes to DPTrainer (``criterion``, ``eval_dataset``, ...)."""
    settings, rest = split(kw)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # noise 0 (allow_non_private) warns
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        return DPTrainer(
            model=model,
            args=with_dp(train_args or args(tmp_path), DP, **settings),
            train_dataset=data,
            data_collator=collator(),
            optimizers=(sgd, None),
            **rest,
        )
