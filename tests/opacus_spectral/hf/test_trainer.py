"""DPTrainer (opacus_spectral.hf.dp_trainer): the HF Trainer with DP-SGD. Pinned against a hand-written Opacus loop
(same σ, accountant history and ε; with the same noise_seed the same weights up to summation order), one noise draw per
logical batch, per-example clipping over the whole logical batch under gradient accumulation, empty Poisson
batches, resume, refusals. Privacy around the Trainer (seeds, logs, tampered checkpoints): test_trainer_privacy.py."""

from __future__ import annotations

import warnings

import opacus.optimizers.optimizer as opacus_optimizer
import opacus_spectral.hf.dp_trainer as hf
import pytest
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf.budget import epsilon_after
from opacus_spectral.hf.dp_trainer import DPTrainer
from opacus_spectral.hf.state import DP_STATE_FILE
from peft import PeftModel, get_peft_model
from repo_support import DOCS
from text_support import synthetic_text_task, tiny_bert
from torch import nn
from torch.utils.data import DataLoader
from trainer_support import ACCUM, NOISE_SEED, PHYSICAL, N, Recorder, adamw, args, dataset, lalora_model, trainer
from transformers import Trainer, TrainerCallback, TrainingArguments

import peft_lalora  # noqa: F401  (registers the LALORA PEFT type)
from opacus_spectral import PrivacyEngine
from peft_lalora import AlternationController

pytestmark = pytest.mark.slow


class Seed(TrainerCallback):
    """Reseeds the global RNG where the hand-written loop does (before the first batch is drawn)."""

    def on_train_begin(self, *a, **k):
        torch.manual_seed(123)


def hand_written_loop(steps: int, post_hooks):
    """The same run written against Opacus directly: make_private_with_epsilon + BatchMemoryManager."""
    model = lalora_model()
    ds = dataset()
    ds = ds.rename_column("label", "labels")
    optimizer = adamw(model)
    with pytest.warns(ReproducibleNoiseWarning):
        engine = PrivacyEngine(accountant="rdp", noise_seed=NOISE_SEED)
    _, dp_opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(ds, batch_size=PHYSICAL * ACCUM),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        wrap_model=False,
        post_hooks=post_hooks,
    )
    controller = AlternationController(model, dp_opt)
    torch.manual_seed(123)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL, optimizer=dp_opt) as physical:
        for batch in physical:
            loss = model(**batch).loss
            loss.backward()
            dp_opt.step()
            dp_opt.zero_grad(set_to_none=True)
            if controller.total_steps == steps:
                break
    return model, engine, dp_opt


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_trainer_run_matches_hand_written_opacus_loop(tmp_path):
    model = lalora_model()
    before = lora_state(model)
    with pytest.warns(ReproducibleNoiseWarning, match="NOT differentially private"):
        t = trainer(tmp_path, model, post_hooks=["rmt"], noise_seed=NOISE_SEED)
    t.add_callback(Seed())
    t.train()
    hand_model, hand_engine, hand_opt = hand_written_loop(4, ["rmt"])

    assert t.state.global_step == 4
    assert t.noise_multiplier == hand_opt.noise_multiplier  # σ exactly as Opacus calibrates it
    assert t.privacy_engine.accountant.history == hand_engine.accountant.history == [(t.noise_multiplier, 0.25, 4)]
    eps = t.get_epsilon()
    assert eps == hand_engine.get_epsilon(1e-5) and 2.9 < eps <= 3.0
    logged = [r["epsilon"] for r in t.state.log_history if "epsilon" in r]
    assert len(logged) == 5 and logged[-1] == eps and logged == sorted(logged)
    assert all(r["delta"] == 1e-5 for r in t.state.log_history if "epsilon" in r)
    assert not any("loss" in r for r in t.state.log_history)  # non-private: dropped by default
    after = lora_state(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)  # both factors moved (alternation)
    assert t.controller is not None and t.controller.total_steps == 4
    hand = lora_state(hand_model)
    # the same noise_seed: the same Poisson batches and noise draws; only the split of a logical batch differs
    assert max((after[n] - hand[n]).abs().max().item() for n in after) < 1e-4
    assert t.privacy_engine.post_hooks.diagnostics.steps == 4

    t.save_model(str(tmp_path / "adapter"))  # save / load through PEFT
    loaded = PeftModel.from_pretrained(tiny_bert(seed=0), str(tmp_path / "adapter")).eval()
    x = dataset()[:4]
    model.eval()
    with torch.no_grad():
        kw = {k: x[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
        assert torch.allclose(loaded(**kw).logits, model(**kw).logits, atol=1e-6)


def test_one_noise_draw_per_logical_batch(tmp_path, monkeypatch):
    calls, clips = [], []
    real_noise, real_clip = opacus_optimizer._generate_noise, opacus_optimizer.DPOptimizer.clip_and_accumulate
    monkeypatch.setattr(opacus_optimizer, "_generate_noise", lambda *a, **k: calls.append(1) or real_noise(*a, **k))
    monkeypatch.setattr(
        opacus_optimizer.DPOptimizer, "clip_and_accumulate", lambda self: clips.append(1) or real_clip(self)
    )
    rec = Recorder()
    t = trainer(tmp_path, noise_multiplier=1.1, target_epsilon=None, post_hooks=[rec])
    t.train()
    per_step = [len(s) for s in rec.steps]
    assert per_step == [6, 6, 6, 6]  # active factor (4 tensors) + classifier head (2)
    assert len(calls) == sum(per_step)  # noise drawn once per tensor per logical batch ...
    assert len(clips) == 4 * ACCUM  # ... while every micro-batch is clipped and accumulated
    sigmas = {s for step in rec.steps for _, s in step.values()}
    assert len(sigmas) == 1 and sigmas.pop() == pytest.approx(1.1 / (PHYSICAL * ACCUM))  # the expected LOGICAL batch


class EditedSampler:
    """Opacus' Poisson batch sampler with ``edit(step, batch)`` applied to each logical batch."""

    def __init__(self, sampler, edit):
        self.sampler, self.edit = sampler, edit

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        for step, batch in enumerate(self.sampler):
            yield self.edit(step, [int(i) for i in batch])


def edit_logical_batches(monkeypatch, edit):
    class Edited(hf.PhysicalBatches):
        def __init__(self, logical, k):
            super().__init__(EditedSampler(logical, edit), k)

    monkeypatch.setattr(hf, "PhysicalBatches", Edited)


def test_physical_batches_split_each_logical_batch_in_k():
    logical = [list(range(n)) for n in (0, 1, 3, 7, 20)]
    split = list(hf.PhysicalBatches(logical, 3))
    assert len(hf.PhysicalBatches(logical, 3)) == len(split) == 15
    for i, batch in enumerate(logical):
        chunks = split[3 * i : 3 * i + 3]
        assert sum(chunks, []) == batch  # every example once, in order
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
        assert (len(chunks[-1]) == 0) == (len(batch) == 0)  # the last is empty only for an empty logical batch


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_accumulation_clips_each_example_over_the_logical_batch(tmp_path, monkeypatch, mode):
    """noise 0: the first step's gradient is Σ clip(g_i, C) / 16 over the examples of the first logical batch,
    whatever their split into micro-batches (per-example gradients taken with plain autograd)."""
    seen = []

    def at_least_12(step, batch):
        """Poisson's batch, topped up to 12 examples: the split over two micro-batches must not depend on the
        (securely seeded, so unrepeatable) draw, which leaves <= 8 examples with probability ~1.4 %."""
        batch = batch + [i for i in range(N) if i not in batch][: max(0, 12 - len(batch))]
        seen.append(batch)
        return batch

    edit_logical_batches(monkeypatch, at_least_12)
    reference = lalora_model()
    rec = Recorder()
    C = 0.05  # small: every example is clipped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = trainer(
            tmp_path,
            noise_multiplier=0.0,
            target_epsilon=None,
            per_sample_max_grad_norm=C,
            post_hooks=[rec],
            grad_sample_mode=mode,
            train_args=args(tmp_path, max_steps=1),
            make_private_kwargs={"allow_non_private": True},
            doctor=False,  # the top-up trains on a batch Poisson did not draw, which the doctor reports (by design)
        )
        t.train()
    ds = dataset()
    AlternationController(reference, None)  # phase of step 0: B (+ head) trainable
    trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in trainable}
    for i in seen[0]:
        reference.zero_grad()
        ex = ds[i]
        out = reference(**{k: ex[k][None] for k in ("input_ids", "attention_mask", "token_type_ids")})
        nn.functional.cross_entropy(out.logits, ex["label"][None]).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for _, p in trainable))
        for n, p in trainable:
            total[n] += p.grad * min(1.0, C / (norm.item() + 1e-6))
    got = rec.steps[0]
    assert len(seen[0]) > PHYSICAL  # really split over two micro-batches
    assert set(got) == set(total)
    for n in total:
        assert torch.allclose(got[n][0], total[n] / (PHYSICAL * ACCUM), atol=1e-7, rtol=1e-4), n


def test_empty_poisson_batches_still_add_noise(tmp_path, monkeypatch):
    """An empty logical batch (and an empty first micro-batch) is a DP step: noise only, counted."""

    edit_logical_batches(monkeypatch, lambda step, batch: [] if step == 1 else batch[:1] if step == 2 else batch)
    for mode in ("hooks", "ghost"):
        rec = Recorder()
        # doctor=False: training on batches other than the ones Poisson drew is what the doctor's batch check
        # catches (tests/opacus_spectral/doctor/test_doctor_silent.py); here the edit is the point
        t = trainer(
            tmp_path,
            noise_multiplier=1.0,
            target_epsilon=None,
            post_hooks=[rec],
            grad_sample_mode=mode,
            train_args=args(tmp_path, max_steps=3),
            doctor=False,
        )
        t.train()
        assert t.state.global_step == 3 and t.privacy_engine.accountant.history == [(1.0, 0.25, 3)]
        assert all(g.abs().sum() > 0 for g, _ in rec.steps[1].values())  # pure noise at the empty step


def test_torch_full_backward_hook_warning_shows_once_per_run(tmp_path):
    """torch warns at each backward through the first LoRA layer (its input needs no gradient); the ε read at every
    log step resets Python's once-per-place record, so before DPTrainer's filter it showed at every step (4 here)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        trainer(tmp_path).train()
    assert sum("Full backward hook is firing" in str(w.message) for w in caught) == 1


def test_budget_stops_training_within_target_epsilon(tmp_path):
    t = trainer(tmp_path, noise_multiplier=1.5, target_epsilon=3.0, train_args=args(tmp_path, max_steps=40))
    with pytest.warns(RuntimeWarning, match="one more step would exceed"):
        t.train()
    steps = t.state.global_step
    assert steps == t.budget_steps == 6  # RDP, sigma 1.5, q 1/4: epsilon(6 steps) = 2.878, epsilon(7) = 3.052
    after_one = epsilon_after(t.privacy_engine.accountant, 1, noise_multiplier=1.5, sample_rate=0.25, delta=1e-5)
    assert t.get_epsilon() <= 3.0 < after_one


def test_resume_restores_accountant_and_denoiser_state(tmp_path):
    full = trainer(
        tmp_path / "a", post_hooks=["ema"], train_args=args(tmp_path / "a", save_strategy="steps", save_steps=2)
    )
    full.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / DP_STATE_FILE).is_file() and (ckpt / "adapter_config.json").is_file()

    resumed = trainer(tmp_path / "b", post_hooks=["ema"])
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    assert resumed.get_epsilon() == full.get_epsilon()
    assert resumed.privacy_engine.post_hooks.pipeline.step == full.privacy_engine.post_hooks.pipeline.step == 4
    assert resumed.controller.total_steps == 4  # the alternation fast-forwarded to step 2, then 2 more

    with pytest.raises(ValueError, match="another DP set-up.*denoisers"):
        trainer(tmp_path / "c", post_hooks=["rmt"]).train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(ValueError, match="another DP set-up.*target_delta"):
        trainer(tmp_path / "d", post_hooks=["ema"], target_delta=1e-6).train(resume_from_checkpoint=str(ckpt))
    plain_model = lalora_model()
    plain = Trainer(
        model=plain_model,
        args=args(tmp_path / "e", save_strategy="steps", save_steps=1, max_steps=1),
        train_dataset=dataset(),
    )
    plain.train()
    with pytest.raises(ValueError, match="holds no DP state"):
        trainer(tmp_path / "f").train(resume_from_checkpoint=str(tmp_path / "e" / "checkpoint-1"))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"fp16": True}, "fp16"),
        ({"torch_compile": True}, "torch.compile"),
        ({"train_sampling_strategy": "sequential"}, "Poisson"),
        ({"include_num_input_tokens_seen": "all"}, "not private"),
    ],
)
def test_refuses_what_cannot_work(tmp_path, change, match):
    a = args(tmp_path)
    for k, v in change.items():
        setattr(a, k, v)
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, train_args=a)


@pytest.mark.parametrize("bound", [0.0, -1.0, float("inf"), float("nan")])
def test_refuses_a_clipping_bound_that_is_not_finite_and_positive(tmp_path, bound):
    with pytest.raises(
        ValueError, match=r"per_sample_max_grad_norm \(the per-example clipping bound C\) must be finite"
    ):
        trainer(tmp_path, per_sample_max_grad_norm=bound)


def test_refuses_multi_gpu_without_ddp_and_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="nn.DataParallel"):
        trainer(tmp_path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="target_delta"):
        trainer(tmp_path, target_delta=None)
    with pytest.raises(ValueError, match="target_epsilon.*or noise_multiplier"):
        trainer(tmp_path, target_epsilon=None)
    with pytest.raises(ValueError, match="may not set"):
        trainer(tmp_path, make_private_kwargs={"poisson_sampling": False})
    t = trainer(tmp_path, train_args=args(tmp_path, max_steps=1))
    t.train()
    with pytest.raises(RuntimeError, match="trains once"):
        t.train()


def test_docs_example_runs(tmp_path, monkeypatch):
    """docs/trainer.md's example as written, with the tiny BERT (and its own tokenizer) and generated reviews."""
    import re

    import datasets
    from transformers import BertTokenizerFast

    text = (DOCS / "trainer.md").read_text()
    code = re.search(r"in 20 lines\s+```python\n(.*?)```", text, flags=re.S).group(1)
    assert len(code.strip().splitlines()) <= 22
    words = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "the", "was"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    model_dir = tmp_path / "model"
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(model_dir)
    tiny_bert(seed=0).save_pretrained(model_dir)
    reviews = {
        "text": [f"the movie was {['good', 'awful', 'great', 'poor'][i % 4]}" for i in range(48)],
        "label": [int(i % 4 in (0, 2)) for i in range(48)],
    }
    monkeypatch.setattr(datasets, "load_dataset", lambda name: {"train": datasets.Dataset.from_dict(reviews)})
    monkeypatch.chdir(tmp_path)
    code = code.replace('"sentence-transformers/all-MiniLM-L6-v2"', repr(str(model_dir)))
    ns: dict = {}
    exec(compile(code, "docs/trainer.md", "exec"), ns)
    t = ns["trainer"]
    assert 0 < t.get_epsilon() <= 3.0 and t.state.global_step == 2  # 48 examples, logical batch 256: 1 step / epoch
    assert t.controller is not None and t.privacy_engine.post_hooks is None  # no denoiser at this batch (the docs)
    assert (tmp_path / "dp-lalora" / "adapter" / "adapter_config.json").is_file()


def test_token_level_labels_are_each_examples_own_mean_in_hooks_and_ghost(tmp_path):
    """Token classification (PEFT TOKEN_CLS): each example's loss is the mean over its own labelled tokens (never
    the model's mean over the batch's tokens, which couples the examples), so hooks and ghost mode release the same
    gradient (noise 0, the same noise_seed: the same Poisson batch); the task comes from the PEFT task_type."""
    import datasets
    from peft import LoraConfig
    from text_support import tiny_bert_config
    from transformers import BertForTokenClassification

    base = synthetic_text_task(N, seq_len=16, seed=0)[:]
    ids, mask = base["input_ids"], base["attention_mask"]
    labels = (ids % 2).masked_fill(mask == 0, -100)
    ds = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask, "labels": labels}).with_format("torch")
    released = {}
    for mode in ("hooks", "ghost"):
        torch.manual_seed(0)
        model = get_peft_model(
            BertForTokenClassification(tiny_bert_config()),
            LoraConfig(r=4, target_modules=["query", "value"], task_type="TOKEN_CLS"),
        )
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        rec = Recorder()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = dict(noise_multiplier=0.0, target_epsilon=None, grad_sample_mode=mode, per_sample_max_grad_norm=0.05)
            dp.update(post_hooks=[rec], noise_seed=NOISE_SEED, make_private_kwargs={"allow_non_private": True})
            t = DPTrainer(model=model, args=args(tmp_path, max_steps=1, **dp), train_dataset=ds)
            t.train()
        assert t.task == "token_classification" and t.state.global_step == 1
        released[mode] = rec.steps[0]
    assert set(released["hooks"]) == set(released["ghost"])
    for n, (g, _) in released["hooks"].items():
        torch.testing.assert_close(g, released["ghost"][n][0], atol=1e-7, rtol=1e-4)
