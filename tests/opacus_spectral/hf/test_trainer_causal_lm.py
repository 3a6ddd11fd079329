"""DPTrainer on causal LMs (opacus_spectral.hf.dp_trainer, opacus_spectral.hf.loss): the released gradient is each
example's own next-token gradient, clipped (hooks and ghost), the same run as a hand-written Opacus loop with the
per-example loss, the per-token evaluation loss, a learnable corpus, rmt / lowpass / ema and LA-LoRA on all seven
Llama module types (GQA), bf16 autocast, adapter reload, task detection and refusals."""

from __future__ import annotations

import math
import warnings

import opacus.optimizers.optimizer as opacus_optimizer
import opacus_spectral.hf.dp_trainer as hf
import pytest
import torch
from causal_lm_support import (
    LLAMA_MODULES,
    SEED,
    VOCAB,
    args,
    collator,
    corpus,
    llama,
    lm_dataset,
    lora_llama,
    tokenizer,
    trainer,
)
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.doctor.doctor import accounted_steps
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf.dp_trainer import DPTrainer
from opacus_spectral.hf.loss import resolve_task
from opacus_spectral.losses import ghost_causal_lm_loss, per_sequence_loss
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

import peft_lalora  # noqa: F401  (registers the LALORA PEFT type)
from opacus_spectral import PrivacyEngine, causal_lm_loss
from peft_lalora import LALoraConfig

pytestmark = pytest.mark.slow


class Recorder:
    """A post-hook keeping every step's released (noisy) gradients."""

    name = "recorder"

    def __init__(self):
        self.steps = []

    def __call__(self, records):
        self.steps.append({r.name: r.tensor.detach().clone() for r in records})


def example_gradients(model, data, loss_fn) -> list[dict[str, torch.Tensor]]:
    """Each example's gradient alone (a batch of one, no padding) by plain autograd."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for ex in data:
        model.zero_grad()
        ids = torch.tensor(ex["input_ids"])[None]
        loss_fn(model(input_ids=ids).logits, ids).sum().backward()
        out.append({n: p.grad.detach().clone() for n, p in trainable.items()})
    return out


def clipped_mean(grads, C: float, n: int) -> dict[str, torch.Tensor]:
    total = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    for g in grads:
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values())).item()
        for k in total:
            total[k] += g[k] * min(1.0, C / (norm + 1e-6))
    return {k: v / n for k, v in total.items()}


def unshifted_loss(logits, ids):
    """What the ghost path trained before: the logit at t scored against the token AT t (copying)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[k].flatten() for k in a])
    y = torch.cat([b[k].flatten() for k in a])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_released_gradient_is_the_clipped_per_example_next_token_gradient(tmp_path, mode):
    """Noise 0, sample rate 1 (every example in the one step), 8 sequences of 3-11 tokens padded per micro-batch:
    the gradient DPTrainer releases is Σ_i clip_C(∇ℓ_i) / 8, ℓ_i example i's own mean next-token loss."""
    data = lm_dataset(8, seed=3)
    model = lora_llama()
    reference = example_gradients(lora_llama(), data, per_sequence_loss)
    norms = sorted(math.sqrt(sum(float(v.pow(2).sum()) for v in g.values())) for g in reference)
    C = (norms[3] + norms[4]) / 2  # half the examples are clipped
    rec = Recorder()
    t = trainer(tmp_path, model, data, grad_sample_mode=mode, per_sample_max_grad_norm=C, post_hooks=[rec])
    assert t.task == "causal_lm"
    t.train()
    assert t.sample_rate == 1.0 and len(rec.steps) == 1
    want = clipped_mean(reference, C, 8)
    got = {n.replace("base_model.model.", "", 1): g for n, g in rec.steps[0].items()}
    want = {n.replace("base_model.model.", "", 1): g for n, g in want.items()}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-7, rtol=1e-4)
    copying = clipped_mean(example_gradients(lora_llama(), data, unshifted_loss), C, 8)
    assert _cosine(got, {n.replace("base_model.model.", "", 1): g for n, g in copying.items()}) < 0.95


def hand_written_loop(mode: str, data, steps: int, sigma: float, C: float, lr: float):
    """The same run against Opacus directly: Poisson loader, BatchMemoryManager, the per-example causal-LM loss."""
    model = lora_llama()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    with pytest.warns(ReproducibleNoiseWarning):
        engine = PrivacyEngine(accountant="rdp", noise_seed=SEED)
    extra = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
    out = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=8, collate_fn=collator()),
        noise_multiplier=sigma,
        max_grad_norm=C,
        grad_sample_mode=mode,
        wrap_model=False,
        **extra,
    )
    dp_opt, loader = out[1], out[-1]
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=dp_opt) as physical:
        for batch in physical:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            if mode == "ghost":
                loss = ghost_causal_lm_loss(out[2], logits, batch["labels"], batch["attention_mask"])
            else:
                loss = causal_lm_loss(logits, batch["labels"], batch["attention_mask"])
            loss.backward()
            dp_opt.step()
            dp_opt.zero_grad(set_to_none=True)
            if accounted_steps(engine.accountant) == steps:
                break
    return model, engine


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_matches_a_hand_written_opacus_loop_with_the_per_example_loss(tmp_path, mode):
    """σ = 0.8, C = 0.5, q = 1/4 (32 sequences, logical batch 8 = 2 × 4), 3 steps, the same noise_seed: the same
    Poisson batches, noise, accountant history and LoRA weights (up to the order of float sums)."""
    data = lm_dataset(32, seed=5)
    model = lora_llama()
    t = trainer(
        tmp_path,
        model,
        data,
        grad_sample_mode=mode,
        noise_multiplier=0.8,
        per_sample_max_grad_norm=0.5,
        lr=0.5,
        noise_seed=SEED,
        make_private_kwargs={},
        train_args=args(tmp_path, max_steps=3),
    )
    t.train()
    hand, engine = hand_written_loop(mode, data, 3, 0.8, 0.5, 0.5)
    assert t.privacy_engine.accountant.history == engine.accountant.history == [(0.8, 0.25, 3)]
    assert t.get_epsilon() == engine.get_epsilon(1e-5)
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = dict(hand.named_parameters())
    start = lora_llama().state_dict()
    moved = [float((ours[n].detach() - start[n]).abs().max()) for n in ours]
    assert min(moved) > 1e-3
    for n, p in ours.items():
        torch.testing.assert_close(p, theirs[n], atol=1e-5, rtol=1e-4)


def per_token_mean(model, data) -> float:
    """The evaluation set's next-token cross-entropy summed over every target and divided by their number, one
    unpadded sequence at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in data:
            ids = torch.tensor(ex["input_ids"])[None]
            logits = model(input_ids=ids).logits[0, :-1]
            total += float(nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    return total / count


def test_next_token_loss_falls_eval_is_per_token_and_the_adapter_reloads(tmp_path):
    """LoRA on all seven module types, AdamW lr 2e-2, B = 16 (8 × 2), σ = 0.5, 20 steps, noise from OS entropy."""
    train, held = lm_dataset(64, seed=0), lm_dataset(24, seed=1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_MODULES, lora_dropout=0.0, task_type="CAUSAL_LM")
    model = lora_llama(config)
    run = dict(max_steps=20, learning_rate=2e-2, per_device_train_batch_size=8, logging_steps=10)
    a = args(tmp_path, **run, noise_multiplier=0.5, accountant="prv", make_private_kwargs=None)
    t = DPTrainer(model=model, args=a, train_dataset=train, eval_dataset=held, data_collator=collator())
    before = t.evaluate()  # batches of 8 padded sequences of 3-11 tokens
    model.eval()
    direct = per_token_mean(model, held)
    assert before["eval_loss"] == pytest.approx(direct, rel=1e-6)
    assert before["eval_perplexity"] == pytest.approx(math.exp(direct), rel=1e-6)
    t.train()
    after = t.evaluate()
    assert t.state.global_step == 20 and 0 < t.get_epsilon()
    assert after["eval_loss"] < before["eval_loss"] - 0.15, (before["eval_loss"], after["eval_loss"])
    model.eval()
    assert after["eval_loss"] == pytest.approx(per_token_mean(model, held), rel=1e-6)

    t.save_model(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(llama(), str(tmp_path / "adapter")).eval()
    n = min(len(held[0]["input_ids"]), len(held[1]["input_ids"]))
    ids = torch.tensor([held[0]["input_ids"][:n], held[1]["input_ids"][:n]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    prompt = tokenizer()(["w1 w2 w3"], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 9) and torch.equal(out, loaded.generate(**prompt, max_new_tokens=6, do_sample=False))


def test_the_batch_audits_backward_does_not_show_torchs_full_backward_hook_warning(tmp_path):
    """The per-example-gradient audit runs a backward of its own before the first step's: only the step's shows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        t = trainer(tmp_path, lora_llama(), lm_dataset(32), train_args=args(tmp_path, max_steps=2))
        t.train()
    assert t.batch_check_result is not None and t.batch_check_result.outcome is not None  # the audit ran
    assert sum("Full backward hook is firing" in str(w.message) for w in caught) == 1


def _module_type(name: str) -> str:
    return next(m for m in LLAMA_MODULES if f".{m}." in name)


def test_denoisers_and_lalora_alternation_on_all_seven_llama_modules(tmp_path):
    """LA-LoRA (B, A, B, A) on q k v o gate up down of both layers, GQA (k/v project 32 -> 16), with rmt, lowpass
    and ema in the pipeline: each step releases only the active factor of all 14 LoRA modules, in its shape, and
    the denoisers run on every one of them."""
    config = LALoraConfig(
        r=4, lora_alpha=8, target_modules=LLAMA_MODULES, lora_dropout=0.0, task_type="CAUSAL_LM", alternation="step"
    )
    model = lora_llama(config)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    pre, post = Recorder(), Recorder()
    t = trainer(
        tmp_path,
        model,
        lm_dataset(32),
        noise_multiplier=1.0,
        make_private_kwargs={},
        lr=0.1,
        post_hooks=[pre, "rmt", "lowpass", "ema", post],
        train_args=args(tmp_path, max_steps=4),
    )
    t.train()
    diag = t.privacy_engine.post_hooks.diagnostics
    assert diag.steps == 4 and t.controller is not None and t.controller.total_steps == 4
    assert all(diag.calls[d] == 4 for d in ("rmt", "lowpass", "ema"))
    assert not diag.errors and not any(diag.fallbacks.values())
    out = {"q_proj": 32, "k_proj": 16, "v_proj": 16, "o_proj": 32, "gate_proj": 64, "up_proj": 64, "down_proj": 32}
    inp = {m: 64 if m == "down_proj" else 32 for m in LLAMA_MODULES}
    for step, (noisy, denoised) in enumerate(zip(pre.steps, post.steps, strict=True)):
        factor = "lora_B" if step % 2 == 0 else "lora_A"
        assert len(noisy) == 14 and all(factor in n for n in noisy)
        for n, g in noisy.items():
            m = _module_type(n)
            assert tuple(g.shape) == ((out[m], 4) if factor == "lora_B" else (4, inp[m]))
            assert denoised[n].shape == g.shape and not torch.equal(denoised[n], g), n
    end = dict(model.named_parameters())
    assert all(not torch.equal(start[n], end[n].detach()) for n in start)  # both factors of every module moved


def single_example_batches(monkeypatch):
    """Every Poisson logical batch cut to its first example: the released gradient is then one example's."""

    class FirstOnly:
        def __init__(self, sampler):
            self.sampler = sampler

        def __len__(self):
            return len(self.sampler)

        def __iter__(self):
            for batch in self.sampler:
                yield [int(batch[0])] if len(batch) else []

    class First(hf.PhysicalBatches):
        def __init__(self, logical, k):
            super().__init__(FirstOnly(logical), k)

    monkeypatch.setattr(hf, "PhysicalBatches", First)


def test_bf16_autocast_clips_in_float32_and_releases_float32(tmp_path, monkeypatch):
    """bf16=True (CPU autocast), hooks mode, noise 0, every example clipped (C = 1e-3): the per-sample gradients
    Opacus clips are float32, each clipped example's norm is C to float32 precision (Opacus' bfloat16 norms gave up
    to 1.007·C), and the released gradient the denoisers receive is float32."""
    single_example_batches(monkeypatch)
    dtypes = []
    real = opacus_optimizer.DPOptimizer.clip_and_accumulate

    def spy(self):
        dtypes.append({p.grad_sample.dtype for p in self.params})
        return real(self)

    monkeypatch.setattr(opacus_optimizer.DPOptimizer, "clip_and_accumulate", spy)
    rec, C = Recorder(), 1e-3
    data = lm_dataset(16, seed=2)
    t = trainer(
        tmp_path,
        lora_llama(),
        data,
        per_sample_max_grad_norm=C,
        post_hooks=[rec],
        doctor=False,  # it sees the edit
        train_args=args(tmp_path, bf16=True, max_steps=8, gradient_accumulation_steps=1),
    )
    t.train()
    expected_batch = 4  # 16 examples, sample rate 4/16
    norms = [
        torch.sqrt(sum(g.double().pow(2).sum() for g in step.values())).item() * expected_batch for step in rec.steps
    ]
    norms = [n for n in norms if n > 0]  # an empty Poisson batch (probability 1 % per step) releases 0 here
    assert len(norms) >= 5 and all(C * (1 - 1e-4) < n <= C * (1 + 1e-6) for n in norms), [n / C for n in norms]
    assert dtypes and all(d == {torch.float32} for d in dtypes)
    assert all(g.dtype == torch.float32 for step in rec.steps for g in step.values())


def test_bf16_refusals(tmp_path):
    with pytest.raises(ValueError, match="bf16 under ghost clipping"):
        trainer(tmp_path, lora_llama(), lm_dataset(8), grad_sample_mode="ghost", train_args=args(tmp_path, bf16=True))
    low = get_peft_model(
        llama().to(torch.bfloat16),
        LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        autocast_adapter_dtype=False,
    )
    with pytest.raises(ValueError, match=r"cannot train parameters in \['torch.bfloat16'\]"):
        trainer(tmp_path, low, lm_dataset(8)).train()


class TokenHead(nn.Module):
    """A model no table places: (batch, seq_len, classes) logits."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.emb.weight.requires_grad_(False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.head(self.emb(input_ids))}


def test_the_task_is_detected_or_refused(tmp_path):
    from text_support import tiny_bert_config
    from transformers import BertForTokenClassification

    assert resolve_task(lora_llama(), None) == resolve_task(llama(), None) == "causal_lm"
    no_type = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"]))  # the class decides
    assert resolve_task(no_type, None) == "causal_lm"
    assert resolve_task(BertForTokenClassification(tiny_bert_config()), None) == "token_classification"
    assert resolve_task(TokenHead(), None) is None and resolve_task(TokenHead(), "causal_lm") == "causal_lm"
    clash = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match="ambiguous"):
        resolve_task(clash, None)
    with pytest.raises(ValueError, match="task must be one of"):
        resolve_task(llama(), "next_token")

    with pytest.raises(ValueError, match=r"pass DPTrainer\(task='causal_lm'\)"):
        trainer(tmp_path, TokenHead(), lm_dataset(8)).train()
    t = trainer(tmp_path, TokenHead(), lm_dataset(8), task="causal_lm")
    t.train()
    assert t.state.global_step == 1
    with pytest.raises(ValueError, match="would ignore them"):
        trainer(tmp_path, lora_llama(), lm_dataset(8), criterion=nn.CrossEntropyLoss())
    unlabeled = lm_dataset(8)
    from transformers import DataCollatorWithPadding

    t = trainer(tmp_path, lora_llama(), unlabeled)
    t.data_collator = DataCollatorWithPadding(tokenizer())
    with pytest.raises(ValueError, match="needs 'labels'.*DataCollatorForLanguageModeling"):
        t.train()


def test_docs_example_runs(tmp_path, monkeypatch):
    """docs/llm.md's libraries-only example as written: the tiny Llama and its word-level tokenizer saved to the
    folder it names, toy lines in train.txt / valid.txt, 3 steps instead of 200, use_cpu=True (bf16 without a GPU)."""
    import re

    import datasets
    from repo_support import DOCS

    text = (DOCS / "llm.md").read_text()
    code = re.search(r"with DPTrainer, libraries only\s+```python\n(.*?)```", text, flags=re.S).group(1)
    imports = set(re.findall(r"^(?:from|import) (\w+)", code, flags=re.M))
    assert imports == {"torch", "datasets", "peft", "transformers", "opacus_spectral"}  # the libraries only
    assert "max_steps=200" in code and "bf16=True" in code
    llama().save_pretrained(tmp_path / "SmolLM2-135M-Instruct")
    tokenizer().save_pretrained(tmp_path / "SmolLM2-135M-Instruct")
    (tmp_path / "train.txt").write_text("\n\n".join(corpus(64)))  # blank lines between: filtered out
    (tmp_path / "valid.txt").write_text("\n".join(corpus(16, seed=1)))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    code = code.replace("max_steps=200", "max_steps=3").replace("bf16=True", "bf16=True, use_cpu=True")
    ns: dict = {}
    exec(compile(code, "docs/llm.md", "exec"), ns)
    t = ns["trainer"]
    assert t.task == "causal_lm" and t.state.global_step == 3 and 0 < t.get_epsilon() <= 8.0
    assert len(t.train_dataset) == 64 and t.privacy_engine.post_hooks.diagnostics.steps == 3
    assert math.isfinite(ns["before"]) and (tmp_path / "dp-lm" / "adapter" / "adapter_config.json").is_file()
