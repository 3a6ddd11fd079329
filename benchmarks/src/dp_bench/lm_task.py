"""The causal-LM bed of ``dp-bench grid --model smollm2`` (``docs/results.md`` §10): SmolLM2-135M-Instruct on
Shakespeare blocks split by work, DP-LoRA r = 32, α = 64 on ``q_proj`` / ``v_proj`` of every layer.

* :func:`smollm2_shakespeare_task` — the pretrained model (frozen, kept once) and the token blocks as
  ``TensorDataset(input_ids, labels)`` (labels = input ids; :func:`opacus_spectral.causal_lm_loss` shifts them),
  the validation and test splits cut to fixed leading subsets (the same blocks for every arm and seed).
* :func:`lora_model` — a fresh LoRA adapter on a copy of the base (PEFT; ``A`` drawn from the seed, ``B = 0``, so
  every run starts at the pretrained model).
* :func:`lm_score` — the evaluator: minus the mean per-token negative log-likelihood (nats), i.e. ``-log``
  perplexity, so that larger is better like the accuracy of the other beds (``perplexity = exp(-score)``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "LMTask",
    "LORA",
    "lm_score",
    "lora_model",
    "perplexity",
    "run_options",
    "smollm2_shakespeare_task",
    "tiny_lm_task",
]

#: paper A's generation setting: LoRA rank, alpha and target modules
LORA: dict[str, Any] = {"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


@dataclass
class LMTask:
    """A pretrained causal LM and its token-block splits (each ``TensorDataset(input_ids, labels)``)."""

    base: nn.Module
    train: torch.utils.data.TensorDataset
    val: torch.utils.data.TensorDataset
    test: torch.utils.data.TensorDataset
    info: dict[str, Any] = field(default_factory=dict)
    input_names: tuple[str, ...] = ("input_ids",)
    #: the test score of the unchanged base (every run's step 0: LoRA's B starts at 0), computed once
    initial_test: float | None = None


def _blocks(split: Any, limit: int | None = None) -> torch.utils.data.TensorDataset:
    ids = split[:]["input_ids"]
    ids = ids[:limit] if limit else ids
    return torch.utils.data.TensorDataset(ids, ids.clone())


def smollm2_shakespeare_task(
    block_size: int = 32,
    *,
    val_blocks: int = 256,
    test_blocks: int = 512,
    works: Sequence[str] | None = None,
    max_lines: int | None = None,
    eval_batch: int = 32,
) -> LMTask:
    """SmolLM2-135M-Instruct (fp32, frozen, eval mode) and Shakespeare blocks of ``block_size`` tokens split by
    work (:func:`dp_bench.data.llm.load_shakespeare_blocks`); validation and test cut to their first
    ``val_blocks`` / ``test_blocks`` blocks (0: all). ``works`` / ``max_lines`` take a slice (tests)."""
    from .data.llm import load_shakespeare_blocks, load_smollm2

    model, tokenizer = load_smollm2()
    model.requires_grad_(False)
    splits = load_shakespeare_blocks(tokenizer, block_size, works=works, max_lines=max_lines)
    task = LMTask(
        base=model.eval(),
        train=_blocks(splits["train"]),
        val=_blocks(splits["validation"], val_blocks),
        test=_blocks(splits["test"], test_blocks),
    )
    task.info = {
        "bed": "SmolLM2-135M-Instruct (packaged, fp32) on Shakespeare, split by work",
        "block_size": block_size,
        "train_blocks": len(task.train),
        "val_blocks": len(task.val),
        "test_blocks": len(task.test),
        "blocks_available": {k: len(v) for k, v in splits.items()},
        "lora": dict(LORA),
        "lora_matrices": 2 * len(LORA["target_modules"]) * model.config.num_hidden_layers,
        "score": "-log perplexity (minus the mean per-token NLL in nats); perplexity = exp(-score)",
    }
    task.initial_test = lm_score(task.base, task.test, eval_batch)
    return task


def tiny_lm_task(n_train: int = 64, n_eval: int = 8, block_size: int = 8, seed: int = 0) -> LMTask:
    """A random tiny Llama (vocab 61, hidden 32, 2 layers) on random token blocks: the plumbing of the LLM
    commands without the packaged model (tests, ``--model tiny``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).requires_grad_(False).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 61, (n, block_size), generator=gen) for n in (n_train, n_eval, n_eval)]
    task = LMTask(model, *(torch.utils.data.TensorDataset(x, x.clone()) for x in ids))
    task.info = {"bed": "tiny random Llama, random tokens", "block_size": block_size, "train_blocks": n_train}
    task.info["lora_matrices"] = 2 * len(LORA["target_modules"]) * config.num_hidden_layers
    task.initial_test = lm_score(model, task.test)
    return task


def run_options(task: LMTask) -> dict[str, Any]:
    """What :func:`dp_bench.train.run_dp` needs for a causal LM (hooks modes): the per-example loss, the score
    (:func:`lm_score`, batches of 32) and the base model's test score as step 0 (LoRA's B starts at 0)."""
    from opacus_spectral import causal_lm_loss

    return {"criterion": causal_lm_loss, "evaluator": lm_score, "eval_batch": 32, "initial_accuracy": task.initial_test}


def lora_model(task: LMTask, seed: int) -> nn.Module:
    """PEFT LoRA (:data:`LORA`) on a copy of ``task.base``, in training mode; ``A`` drawn from ``seed``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(task_type="CAUSAL_LM", **copy.deepcopy(LORA))
    return get_peft_model(copy.deepcopy(task.base), config).train()


@torch.no_grad()
def lm_score(model: nn.Module, data: torch.utils.data.TensorDataset, batch: int = 32) -> float:
    """``-(Σ token NLL) / (number of predicted tokens)`` over ``data`` (next-token targets: every block predicts
    its tokens 2..L), batch sums added in float64; evaluated in eval mode, the model's mode restored."""
    ids = data.tensors[0]
    if len(ids) == 0:
        raise ValueError("empty evaluation set")
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    try:
        for i in range(0, len(ids), batch):
            x = ids[i : i + batch]
            out = model(input_ids=x)
            logits = getattr(out, "logits", out)
            nll = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += nll.double()
            count += x[:, 1:].numel()
    finally:
        model.train(was_training)
    return -float(total) / count


def perplexity(score: float) -> float:
    """Perplexity of an :func:`lm_score` value."""
    return math.exp(-score)
