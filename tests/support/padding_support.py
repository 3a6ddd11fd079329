"""The batch-independence tests' DPTrainer set-up (no tests here): a one-layer GPT-2 with LoRA on ``c_attn`` (learned
absolute positions) and a tiny BERT with LoRA on query/value, six records of 3–12 tokens (record 0 the longest),
collators padding on either side, and the sum of clipped gradients one DPTrainer step releases (noise 0, sample rate 1,
C = 1e-3: every record clipped). Used in one process and by the torchrun worker of test_trainer_ddp.py."""

from __future__ import annotations

import warnings

import datasets
import torch
from causal_lm_support import tokenizer
from opacus_spectral.hf.dp_trainer import DPTrainer
from peft import LoraConfig, get_peft_model
from text_support import tiny_bert_config
from trainer_support import quiet_cpu_args
from transformers import (
    BertForSequenceClassification,
    BertForTokenClassification,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
)

C = 1e-3
VOCAB = 97
LENGTHS = [12, 3, 7, 5, 9, 4]  # record 0 is the longest


def texts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def model(task: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if task == "causal_lm":
            config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, pad_token_id=0)
            config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0  # exact comparisons: no dropout
            base = GPT2LMHeadModel(config)
            cfg = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
        else:
            kind = BertForTokenClassification if task == "token_classification" else BertForSequenceClassification
            config = tiny_bert_config(num_labels=3, vocab_size=VOCAB)
            config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
            base = kind(config)
            cfg = LoraConfig(
                r=4,
                target_modules=["query", "value"],
                task_type="TOKEN_CLS" if kind is BertForTokenClassification else "SEQ_CLS",
            )
        cfg.lora_dropout, cfg.init_lora_weights = 0.0, False
        return get_peft_model(base, cfg)


def data(task: str, rows: list[int]) -> datasets.Dataset:
    ids = [texts()[i] for i in rows]
    columns = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}
    if task == "token_classification":
        columns["labels"] = [[t % 3 for t in x] for x in ids]
    elif task == "sequence_classification":
        columns["labels"] = [i % 3 for i in rows]
    return datasets.Dataset.from_dict(columns)


def collator(task: str, side: str):
    tok = tokenizer()
    tok.padding_side = side
    if task == "causal_lm":
        return DataCollatorForLanguageModeling(tok, mlm=False)
    if task == "token_classification":
        return DataCollatorForTokenClassification(tok)
    return DataCollatorWithPadding(tok)


class Grab(TrainerCallback):
    def __init__(self) -> None:
        self.trainer: DPTrainer | None = None
        self.grad: torch.Tensor | None = None

    def on_optimizer_step(self, args, state, control, **kwargs):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.grad = torch.cat([p.grad.detach().flatten().double() for p in params])


def clipped_sum(
    tmp_path, task: str, side: str, rows: list[int], *, data_of=None, collator_of=None, model_of=None, seen=None, **kw
):
    """One DP step on ``rows`` (one logical batch: sample rate 1), noise 0: the sum of the clipped gradients (across
    processes: the all-reduced one). ``data_of`` / ``collator_of`` / ``model_of`` replace :func:`data` /
    :func:`collator` / :func:`model`; ``seen["trainer"]``: the trainer, when ``seen`` is a dict."""
    grab = Grab()
    m = (model_of or model)(task)
    extra = {"ddp_backend": "gloo"} if int(__import__("os").environ.get("WORLD_SIZE", "1")) > 1 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = dict(noise_multiplier=0.0, per_sample_max_grad_norm=C, make_private_kwargs={"allow_non_private": True})
        t = DPTrainer(
            model=m,
            args=quiet_cpu_args(
                tmp_path, per_device_train_batch_size=8, max_steps=1, learning_rate=0.0, **extra, **dp, **kw
            ),
            train_dataset=(data_of or data)(task, rows),
            data_collator=(collator_of or collator)(task, side),
            optimizers=(torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0), None),
            callbacks=[grab],
        )
        grab.trainer = t
        if seen is not None:
            seen["trainer"] = t
        t.train()
    assert t.sample_rate == 1.0
    return grab.grad * len(rows)
