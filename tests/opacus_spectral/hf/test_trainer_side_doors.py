"""DPTrainer's side doors and silent-wrong losses: the progress bar shows no per-step timing (it tracks the Poisson
batch size, like ``train_runtime``), and ghost clipping refuses the sequence-classification losses it cannot
reproduce per example (multi-label, regression) instead of training softmax cross-entropy on them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from opacus_spectral.hf.dp_trainer import DPTrainer
from opacus_spectral.hf.progress import DPProgressCallback
from tiny_models import tiny_bert
from torch import nn
from torch.utils.data import Dataset
from trainer_support import args, dataset, trainer
from transformers import PrinterCallback, ProgressCallback

pytestmark = pytest.mark.slow

#: what tqdm prints of time: a rate, an elapsed / remaining time
TIMING = re.compile(r"it/s|s/it|\d\d:\d\d|\?it")


def test_the_progress_bar_of_a_dp_run_shows_steps_and_epsilon_but_no_timing(tmp_path, capsys):
    """The Trainer's default bar printed ``2/2 [00:01<00:00, 1.9it/s]``: the per-step time grows with the number of
    sampled records. A bar added after construction is replaced too; so is the evaluation bar."""
    t = trainer(tmp_path, train_args=args(tmp_path, max_steps=2, disable_tqdm=False))
    assert not any(type(cb) is ProgressCallback for cb in t.callback_handler.callbacks)
    t.add_callback(ProgressCallback)  # the user's own, after construction: replaced when training starts
    capsys.readouterr()
    t.train()
    t.evaluate(dataset().select(range(8)))
    err = capsys.readouterr().err
    assert "2/2" in err and "1/1" in err  # the steps, and the evaluation's one batch
    assert re.search(r"ε=\d", err), err
    assert not TIMING.search(err), err
    bars = [cb for cb in t.callback_handler.callbacks if isinstance(cb, ProgressCallback)]
    assert [type(cb) for cb in bars] == [DPProgressCallback]


@pytest.mark.parametrize(
    ("kw", "kept"),
    [
        ({"release_nonprivate_stats": True}, ProgressCallback),  # the user asked for non-private statistics
        ({}, PrinterCallback),  # disable_tqdm=True: no bar at all, the (filtered) log records printed
    ],
)
def test_the_default_bar_stays_only_where_the_user_chose(tmp_path, kw, kept):
    tqdm = "release_nonprivate_stats" in kw
    t = trainer(tmp_path, train_args=args(tmp_path, disable_tqdm=not tqdm), **kw)
    kinds = {type(cb) for cb in t.callback_handler.callbacks}
    assert kept in kinds and DPProgressCallback not in kinds


# -- ghost clipping's loss --------------------------------------------------------------------------------------


class Records(Dataset):
    """``n`` token sequences with the given labels (one row each)."""

    def __init__(self, labels: torch.Tensor, seq: int = 8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(10, 1000, (len(labels), seq), generator=g)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def head(kind: str) -> tuple[nn.Module, Dataset]:
    """A tiny BERT with a multi-label, regression or float-labelled head, and 16 records for it (embeddings frozen:
    BERT's position embeddings see a batch of one, which Opacus cannot clip per example)."""
    g = torch.Generator().manual_seed(1)
    if kind == "multi_label":
        model = tiny_bert(num_labels=3)
        model.config.problem_type = "multi_label_classification"
        data = Records(torch.randint(0, 2, (16, 3), generator=g).float())
    elif kind == "regression":  # num_labels=1, problem_type unset: Hugging Face's regression (MSE)
        model, data = tiny_bert(num_labels=1), Records(torch.randn(16, generator=g))
    else:  # problem_type unset, float labels: Hugging Face's forward picks multi-label BCE from the labels' dtype
        model, data = tiny_bert(num_labels=2), Records(torch.randint(0, 2, (16, 2), generator=g).float())
    model.bert.embeddings.requires_grad_(False)
    return model, data


def dp_trainer(tmp_path, kind: str, criterion=None, **kw) -> DPTrainer:
    model, data = head(kind)
    run = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=1)
    a = args(tmp_path, **run, target_epsilon=None, noise_multiplier=1.0, **kw)
    return DPTrainer(model=model, args=a, train_dataset=data, criterion=criterion)


@pytest.mark.parametrize("kind", ["multi_label", "regression", "float_labels"])
def test_ghost_clipping_refuses_a_loss_it_cannot_compute_per_example_and_hooks_trains_it(tmp_path, kind):
    """Ghost mode's per-example loss is softmax cross-entropy on the logits: on a multi-label head it trained
    silently (soft-target cross-entropy instead of the model's BCE), on a regression head it failed in torch."""
    with pytest.raises(ValueError, match=r"ghost clipping.*grad_sample_mode='hooks'") as err:
        dp_trainer(tmp_path, kind, grad_sample_mode="ghost")
    assert ("regression" if kind == "regression" else "multi-label") in str(err.value)
    t = dp_trainer(tmp_path, kind, grad_sample_mode="hooks")  # the model's own loss: trains
    t.train()
    assert t.state.global_step == 1 and t.privacy_engine.accountant.history == [(1.0, 0.25, 1)]


class ExampleBCE(nn.Module):
    """Multi-label BCE, one value per example under ``reduction="none"`` (what ghost clipping needs)."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_example = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(dim=1)
        return per_example if self.reduction == "none" else per_example.mean()


def test_ghost_clipping_trains_any_head_with_the_users_per_example_criterion(tmp_path):
    t = dp_trainer(tmp_path, "multi_label", grad_sample_mode="ghost", criterion=ExampleBCE())
    t.train()
    assert t.state.global_step == 1 and t.privacy_engine.accountant.history == [(1.0, 0.25, 1)]


def test_ghost_clipping_keeps_single_label_classification(tmp_path):
    model = tiny_bert(num_labels=2)
    model.config.problem_type = "single_label_classification"
    data = Records(torch.arange(16) % 2)
    a = args(tmp_path, target_epsilon=None, noise_multiplier=1.0, accountant="prv", grad_sample_mode="ghost")
    t = DPTrainer(model=model, args=a, train_dataset=data)
    assert t.args.grad_sample_mode == "ghost"
