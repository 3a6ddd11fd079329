"""DPTrainer and the privacy record (docs/trainer.md, "A second run on a DP-trained model"): a second trainer on the
same model continues ε instead of restarting it, ``save_model`` writes the record beside the adapter, a
``target_epsilon`` bounds prior + run, and a resumed composed run ends where the uninterrupted one does."""

from __future__ import annotations

import copy
import json
import shutil
import uuid
import warnings

import pytest
import torch
from opacus_spectral.accounting import PrivacyRecord, PrivacyRun, privacy_record_of, read_privacy_record
from opacus_spectral.accounting.record import RECORD_FILE
from opacus_spectral.errors import ComposedPrivacyWarning
from opacus_spectral.hf.state import DP_STATE_FILE
from peft import LoraConfig, get_peft_model
from text_support import tiny_bert
from torch import nn
from trainer_support import args, trainer

from opacus_spectral import epsilon_from_history, load_privacy_record

pytestmark = pytest.mark.slow

DELTA, Q = 1e-5, 0.25  # trainer_support: 64 examples, logical batch 16, 4 steps, RDP
RUN1 = (1.0, Q, 4)


def lora_model() -> nn.Module:
    model = tiny_bert(seed=0)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    model = lora_model()
    t = trainer(tmp_path_factory.mktemp("a"), model, target_epsilon=None, noise_multiplier=1.0)
    t.train()
    assert t.privacy_engine.accountant.history == [RUN1]
    return model


@pytest.fixture
def trained(first_run):
    """A LoRA model after one DPTrainer run of 4 steps at σ = 1 (ε 4.87), carrying its record in memory (a copy
    for each test); the tests' runs go to tmp_path/"b"."""
    return copy.deepcopy(first_run)


def test_a_second_trainer_on_the_same_model_continues_epsilon(trained, tmp_path):
    tmp_path = tmp_path / "b"
    t = trainer(tmp_path, trained, target_epsilon=None, noise_multiplier=1.2)
    prior = epsilon_from_history([RUN1], DELTA, "rdp")
    with pytest.warns(ComposedPrivacyWarning, match=f"epsilon = {prior:.4g} at delta = 1e-05"):
        t.train()
    composed = epsilon_from_history([RUN1, (1.2, Q, 4)], DELTA, "rdp")  # 5.564; the second run alone: 3.585
    assert t.get_epsilon() == composed > epsilon_from_history([(1.2, Q, 4)], DELTA, "rdp") + 1
    assert [r["epsilon"] for r in t.state.log_history if "epsilon" in r][-1] == composed
    t.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    record = read_privacy_record(tmp_path / "adapter")
    assert record == privacy_record_of(trained)
    assert [(r.history, r.delta, r.dataset_size, r.accountant) for r in record.runs] == [
        ((RUN1,), DELTA, 64, "rdp"),
        (((1.2, Q, 4),), DELTA, 64, "rdp"),
    ]


def test_new_privacy_unit_starts_the_second_trainer_from_zero(trained, tmp_path):
    tmp_path = tmp_path / "b"
    t = trainer(tmp_path, trained, target_epsilon=None, noise_multiplier=1.2, new_privacy_unit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComposedPrivacyWarning)
        t.train()
    assert t.get_epsilon() == epsilon_from_history([(1.2, Q, 4)], DELTA, "rdp")
    assert [r.unit for r in privacy_record_of(trained).runs] == [0, 1]


def test_target_epsilon_bounds_prior_and_run_and_a_resume_ends_alike(trained, tmp_path):
    tmp_path = tmp_path / "b"
    target = 7.0
    saving = args(tmp_path, save_strategy="steps", save_steps=2)
    t = trainer(tmp_path, trained, train_args=saving, target_epsilon=target)
    with pytest.warns(ComposedPrivacyWarning):
        t.train()
    run2 = (t.noise_multiplier, Q, 4)
    assert t.privacy_engine.accountant.history == [RUN1, run2] and t.state.global_step == 4
    composed = epsilon_from_history([RUN1, run2], DELTA, "rdp")
    assert target - 0.05 <= composed <= target and t.get_epsilon() == composed
    checkpoint = tmp_path / "checkpoint-2"
    assert [r.steps for r in read_privacy_record(checkpoint).runs] == [4, 2]
    resumed = trainer(tmp_path, lora_model(), train_args=saving, target_epsilon=target)  # a fresh model
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.noise_multiplier == t.noise_multiplier
    assert resumed.privacy_engine.accountant.history == [RUN1, run2] and resumed.get_epsilon() == composed
    assert privacy_record_of(resumed.model) == privacy_record_of(trained)
    # the same model object (its record holds the checkpoint's own run, 4 steps): resumes to the same end
    again = trainer(tmp_path, trained, train_args=saving, target_epsilon=target)
    with pytest.warns(ComposedPrivacyWarning):
        again.train(resume_from_checkpoint=str(checkpoint))
    assert again.privacy_engine.accountant.history == [RUN1, run2] and again.get_epsilon() == composed
    assert privacy_record_of(trained) == privacy_record_of(resumed.model)
    # the checkpoint's history without the composed prefix: refused
    edited = tmp_path / "edited"
    shutil.copytree(checkpoint, edited)
    state = torch.load(edited / DP_STATE_FILE, weights_only=True)
    state["accountant"]["history"] = state["accountant"]["history"][1:]
    torch.save(state, edited / DP_STATE_FILE)
    with pytest.raises(ValueError, match="does not start with the 4 steps"):
        trainer(tmp_path, lora_model(), train_args=saving, target_epsilon=target).train(
            resume_from_checkpoint=str(edited)
        )
    # a model carrying a run the checkpoint's run never composed with: refused (its steps would drop out)
    other = PrivacyRecord((PrivacyRun(uuid.uuid4().hex, 0, ((2.0, Q, 1),), delta=DELTA, accountant="rdp"),))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / RECORD_FILE).write_text(json.dumps(other.to_json()))
    carrying = lora_model()
    load_privacy_record(carrying, tmp_path / "other")
    with pytest.raises(ValueError, match="did not compose with"), pytest.warns(ComposedPrivacyWarning):
        trainer(tmp_path, carrying, train_args=saving, target_epsilon=target).train(
            resume_from_checkpoint=str(checkpoint)
        )


def test_a_prior_that_spends_the_target_is_refused(trained, tmp_path):
    tmp_path = tmp_path / "b"
    t = trainer(tmp_path, trained, target_epsilon=4.0)
    with pytest.raises(ValueError, match="already spends epsilon = 4.871"):
        t.train()


def test_the_budget_stop_counts_the_prior(trained, tmp_path):
    """σ = 1.2 after the first run: ε 5.054, 5.227, 5.400 after 1, 2, 3 steps; target 5.3 stops after 2."""
    t = trainer(tmp_path / "b", trained, target_epsilon=5.3, noise_multiplier=1.2)
    with pytest.warns(RuntimeWarning, match="stopping at step 2"):
        t.train()
    assert t.state.global_step == 2 and t.budget_steps == 2
    assert t.get_epsilon() == epsilon_from_history([RUN1, (1.2, Q, 2)], DELTA, "rdp") <= 5.3
