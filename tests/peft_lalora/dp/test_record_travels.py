"""The privacy record travels on the paths users take (issue 49, item 5): the model's and the adapter's configs carry
it, so PEFT's ``save_pretrained`` / ``from_pretrained``, ``merge_and_unload`` and transformers' ``save_pretrained`` /
``from_pretrained`` (and ``push_to_hub``, which saves the same files) keep it without this library in the loop, and
the next DP run composes with it instead of restarting ε."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

opacus_spectral = pytest.importorskip("opacus_spectral")
from lalora_support import batch, build  # noqa: E402
from opacus_spectral.accounting.record import privacy_record_of  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

DELTA = 1e-5


def _trained(model, steps=3):
    return _run(model, steps)[0]


def _run(model, steps):
    """A DP run of ``steps`` steps on ``model``; returns its engine and a function taking more steps."""
    model.train()
    x, y = batch(48, seed=5)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    private, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    batches = iter(dl)

    def more(k):
        for _ in range(k):
            xb, yb = next(batches)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(private(xb).logits, yb).backward()
            opt.step()

    more(steps)
    return engine, more


def _composed_epsilon(model):
    """ε after one more DP step on ``model`` with a new engine: the record's steps plus one."""
    engine = _trained(model, steps=1)
    return engine, engine.get_epsilon(DELTA)


def test_a_lalora_adapter_saved_and_loaded_by_peft_keeps_its_record(tmp_path):
    model = build("bert", alternation="none")
    first = _trained(model)
    runs = privacy_record_of(model).runs
    model.save_pretrained(tmp_path / "adapter")  # PEFT's own save: no call of ours
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["privacy_record"]
    assert saved["runs"][0]["history"] == [list(e) for e in runs[0].history]
    base = build("bert", alternation="none").get_base_model()
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    assert privacy_record_of(loaded).runs == runs
    engine, eps = _composed_epsilon(loaded)
    assert sum(n for *_, n in engine.accountant.history) == 3 + 1  # the prefix composed, not restarted
    assert eps > first.get_epsilon(DELTA)


def test_merge_and_unload_and_a_saved_base_model_keep_the_record(tmp_path):
    model = build("bert", alternation="none")
    first = _trained(model)
    runs = privacy_record_of(model).runs
    merged = model.merge_and_unload()
    assert privacy_record_of(merged).runs == runs
    merged.save_pretrained(tmp_path / "merged")  # transformers' own save (push_to_hub writes the same files)
    assert "opacus_spectral_privacy_record" in json.loads((tmp_path / "merged" / "config.json").read_text())
    reloaded = BertForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert privacy_record_of(reloaded).runs == runs
    for name, p in reloaded.named_parameters():  # a head-only second run (a full BERT is not Opacus-ready)
        p.requires_grad_(name.startswith("classifier"))
    engine, eps = _composed_epsilon(reloaded)
    assert eps > first.get_epsilon(DELTA)


def test_a_record_saved_later_is_the_record_at_save_time(tmp_path):
    """The configs hold the record live: a save after more steps writes them all (never a stale, smaller ε)."""
    model = build("bert", alternation="none")
    _, more = _run(model, 2)
    model.save_pretrained(tmp_path / "a")
    more(2)
    model.save_pretrained(tmp_path / "b")
    a = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["privacy_record"]
    b = json.loads((tmp_path / "b" / "adapter_config.json").read_text())["privacy_record"]
    assert sum(e[2] for r in a["runs"] for e in r["history"]) == 2
    assert sum(e[2] for r in b["runs"] for e in r["history"]) == 4


def test_a_fully_trainable_transformer_gets_the_librarys_error_not_opacus_stack_error():
    """Full fine-tuning of a BERT/GPT-2 under Opacus: the position embedding sees position ids of batch 1, so its
    per-sample gradient has one row, and Opacus stopped with "stack expects each tensor to be equal size"."""
    model = build("bert", alternation="none").merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.raises(ValueError, match="position_embeddings.weight do not have one row per record"):
        _trained(model, steps=1)
