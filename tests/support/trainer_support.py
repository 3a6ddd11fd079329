"""The DPTrainer tests' shared setup (no tests here): a tiny LA-LoRA BERT, the synthetic text task, the Trainer's
arguments (logical batch 16 = 2 accumulated physical batches of 8 out of 64 examples) and a post-hook recorder."""

from __future__ import annotations

import dataclasses

import torch
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from peft import get_peft_model
from text_support import synthetic_text_task, tiny_bert
from torch import nn

import peft_lalora  # noqa: F401  (registers the LALORA PEFT type)
from peft_lalora import LALoraConfig

N, PHYSICAL, ACCUM, LR = 64, 8, 2, 1e-2  # logical batch 16, sample rate 1/4, 4 steps per epoch
NOISE_SEED = 2024  # the comparison with the hand-written loop needs the same noise (reproducible, not private)


def lalora_model(seed: int = 0, alternation: str = "step") -> nn.Module:
    model = tiny_bert(seed=seed)
    for m in model.modules():  # no dropout: the two loops then consume the global RNG identically
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    cfg = LALoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["query", "value"],
        task_type="SEQ_CLS",
        alternation=alternation,
    )
    with torch.random.fork_rng(devices=[]):  # LoRA's A is drawn from the global RNG
        torch.manual_seed(seed)
        return get_peft_model(model, cfg)


def dataset():
    return synthetic_text_task(N, seq_len=16, seed=0)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


#: the DP settings of :func:`trainer` unless a test gives others
DP = dict(target_epsilon=3.0, noise_multiplier=None, target_delta=1e-5, per_sample_max_grad_norm=1.0, accountant="rdp")


def quiet_cpu_args(tmp_path, **kw) -> DPTrainingArguments:
    """The Trainer on the CPU in ``tmp_path``: constant lr, a log record every step, no checkpoints, no
    integrations, no progress bar, no loader workers, δ = 1e-5 and the RDP accountant; ``kw`` sets or overrides any
    argument (and must give ``target_epsilon`` or ``noise_multiplier``)."""
    base = dict(
        target_delta=1e-5,
        accountant="rdp",
        output_dir=str(tmp_path),
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return DPTrainingArguments(**{**base, **kw})


def args(tmp_path, **kw) -> DPTrainingArguments:
    run = dict(per_device_train_batch_size=PHYSICAL, gradient_accumulation_steps=ACCUM, max_steps=4, learning_rate=LR)
    return quiet_cpu_args(tmp_path, **{**run, "target_epsilon": 3.0, **kw})


def with_dp(train_args: DPTrainingArguments, defaults: dict, **kw) -> DPTrainingArguments:
    """``train_args`` with the DP settings ``defaults``, overridden by ``kw`` (a copy; ``train_args`` itself when it
    holds them already, so that a test may have set a field without ``__post_init__``)."""
    changes = {k: v for k, v in {**defaults, **kw}.items() if getattr(train_args, k) != v}
    return dataclasses.replace(train_args, **changes) if changes else train_args


def split(kw: dict) -> tuple[dict, dict]:
    """``kw`` as (DPTrainingArguments fields, the rest: DPTrainer's keyword arguments)."""
    names = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    return {k: v for k, v in kw.items() if k in names}, {k: v for k, v in kw.items() if k not in names}


def trainer(tmp_path, model=None, *, train_args=None, **kw) -> DPTrainer:
    """A DPTrainer on the tiny LA-LoRA BERT: ``train_args`` (default :func:`args`) with :data:`DP` and the argument
    fields of ``kw`` applied over it; the rest of ``kw`` goes to DPTrainer (``criterion``, ``eval_dataset``, ...)."""
    model = model if model is not None else lalora_model()
    settings, rest = split(kw)
    return DPTrainer(
        model=model,
        args=with_dp(train_args or args(tmp_path), DP, **settings),
        train_dataset=dataset(),
        optimizers=(adamw(model), None),
        **rest,
    )


class Recorder:
    """A post-hook that keeps every step's noisy gradients (copies) and sigma."""

    name = "recorder"

    def __init__(self):
        self.steps = []

    def __call__(self, records):
        self.steps.append({r.name: (r.tensor.detach().clone(), r.sigma) for r in records})
