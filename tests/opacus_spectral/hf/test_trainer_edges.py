"""DPTrainer at its edges: the Trainer's loss settings (an overridden ``compute_loss``, ``compute_loss_func``,
``label_smoothing_factor``) in every grad-sample mode, runs of zero steps, an empty training set, and noise 0
(ε = inf logged, not an accountant overflow)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus_spectral.hf.budget import epsilon_after
from opacus_spectral.hf.dp_trainer import DPTrainer
from torch import nn
from trainer_support import DP, NOISE_SEED, Recorder, adamw, args, dataset, lalora_model, trainer, with_dp

NON_PRIVATE = {"allow_non_private": True}


class OwnLoss(DPTrainer):
    """A subclass with its own loss: the model's, on the flipped labels."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {**inputs, "labels": 1 - inputs["labels"]}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def build(tmp_path, *, cls=DPTrainer, train_args=None, criterion=None, compute_loss_func=None, **kw) -> DPTrainer:
    model = lalora_model()
    return cls(
        model=model,
        args=with_dp(train_args or args(tmp_path), DP, **kw),
        train_dataset=dataset(),
        optimizers=(adamw(model), None),
        criterion=criterion,
        compute_loss_func=compute_loss_func,
    )


def released(tmp_path, *, mode: str, cls=DPTrainer, clip: float = 0.05, **train_kw) -> dict[str, torch.Tensor]:
    """The first step's released gradient (noise 0, the same Poisson batch; C = 0.05 clips every example)."""
    model = lalora_model()
    rec = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # noise 0 warns
        dp = dict(noise_multiplier=0.0, target_epsilon=None, per_sample_max_grad_norm=clip, grad_sample_mode=mode)
        dp.update(post_hooks=[rec], noise_seed=NOISE_SEED, make_private_kwargs=NON_PRIVATE)
        t = cls(
            model=model,
            args=args(tmp_path, max_steps=1, **train_kw, **dp),
            train_dataset=dataset(),
            optimizers=(adamw(model), None),
        )
        t.train()
    return {n: g for n, (g, _) in rec.steps[0].items()}


def assert_same(a, b):
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-7, rtol=1e-4)


def test_label_smoothing_is_applied_per_example_in_ghost_mode_as_in_hooks_mode(tmp_path):
    """label_smoothing_factor: hooks mode smooths the model's loss (the Trainer's LabelSmoother); ghost mode used to
    ignore it (a bit-identical update) and now smooths its per-example cross-entropy the same way. No example is
    clipped (C = 1e6): with two classes smoothing changes each example's gradient norm, not its direction."""
    with_ls = {m: released(tmp_path / m, mode=m, clip=1e6, label_smoothing_factor=0.4) for m in ("hooks", "ghost")}
    plain = released(tmp_path / "plain", mode="ghost", clip=1e6)
    assert_same(with_ls["ghost"], with_ls["hooks"])
    assert any(not torch.allclose(with_ls["ghost"][n], plain[n], atol=1e-6) for n in plain)


def test_an_overridden_compute_loss_is_honoured_in_hooks_mode(tmp_path):
    """Hooks mode trains on the subclass's loss (ghost mode refuses it: below)."""
    own = released(tmp_path / "own", mode="hooks", cls=OwnLoss)
    plain = released(tmp_path / "plain", mode="hooks")
    assert set(own) == set(plain)
    assert any(not torch.allclose(own[n], plain[n], atol=1e-6) for n in plain)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tp: build(tp, grad_sample_mode="ghost", cls=OwnLoss), "overridden OwnLoss.compute_loss under ghost"),
        (
            lambda tp: build(tp, grad_sample_mode="ghost", compute_loss_func=lambda o, y, **k: o.logits.sum()),
            "compute_loss_func under ghost",
        ),
        (
            lambda tp: build(
                tp,
                grad_sample_mode="ghost",
                criterion=nn.CrossEntropyLoss(),
                train_args=args(tp, label_smoothing_factor=0.1),
            ),
            "label_smoothing_factor with a criterion",
        ),
        (lambda tp: build(tp, task="token_classification", cls=OwnLoss), "overridden compute_loss for task"),
        (
            lambda tp: build(tp, task="causal_lm", grad_sample_mode="ghost", cls=OwnLoss),
            "overridden compute_loss for task",
        ),
    ],
    ids=["ghost-override", "ghost-loss-func", "ghost-criterion-smoothing", "token-override", "causal-ghost-override"],
)
def test_a_loss_the_mode_would_bypass_is_refused_at_construction(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path)


@pytest.mark.parametrize("length", [{"max_steps": 0}, {"max_steps": -1, "num_train_epochs": 0}])
def test_a_run_of_zero_steps_is_refused_instead_of_hanging_in_calibration(tmp_path, length):
    """max_steps=0 with target_epsilon hung in get_noise_multiplier(steps=0); with a noise_multiplier the
    Trainer still took one step."""
    with pytest.raises(ValueError, match="a run of 0 steps"):
        trainer(tmp_path, train_args=args(tmp_path, **length))
    with pytest.raises(ValueError, match="a run of 0 steps"):
        trainer(tmp_path, noise_multiplier=1.0, target_epsilon=None, train_args=args(tmp_path, **length))


def test_a_run_whose_trainer_counts_zero_steps_is_refused_before_calibration(tmp_path):
    """The guard at calibration, for a state that reaches create_optimizer with 0 steps anyway."""
    t = trainer(tmp_path)
    t.args.max_steps = 0
    with pytest.raises(ValueError, match="a run of 0 steps"):
        t.train()


def test_an_empty_training_set_is_refused_clearly(tmp_path):
    model = lalora_model()
    with pytest.raises(ValueError, match="empty train_dataset"):
        DPTrainer(model=model, args=args(tmp_path), train_dataset=dataset().select([]), optimizers=(adamw(model), None))
    t = trainer(tmp_path)
    t.train_dataset = dataset().select([])  # emptied after construction: refused when the loader is built
    with pytest.raises(ValueError, match="empty train_dataset"):
        t.train()


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_noise_zero_trains_and_logs_infinite_epsilon(tmp_path, accountant):
    """noise_multiplier=0 (allow_non_private): the PRV accountant overflowed at the first log; ε is inf."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = trainer(
            tmp_path,
            noise_multiplier=0.0,
            target_epsilon=None,
            accountant=accountant,
            train_args=args(tmp_path, max_steps=2),
            make_private_kwargs=NON_PRIVATE,
        )
        t.train()
    assert t.state.global_step == 2
    assert t.get_epsilon() == math.inf and t.get_epsilon(1e-3) == math.inf
    assert [r["epsilon"] for r in t.state.log_history if "epsilon" in r][:2] == [math.inf, math.inf]
    acc = t.privacy_engine.accountant
    assert epsilon_after(acc, 1, noise_multiplier=1.0, sample_rate=0.25, delta=1e-5) == math.inf


def test_noise_zero_with_a_target_epsilon_is_refused(tmp_path):
    with pytest.raises(ValueError, match="noise_multiplier=0 spends epsilon = inf"):
        trainer(tmp_path, noise_multiplier=0.0, target_epsilon=3.0, make_private_kwargs=NON_PRIVATE)


def test_alternation_gets_the_adapters_schedule_and_a_removed_controller_does_not_block_it(tmp_path):
    from peft_lalora.alternation.schedule import AlternationSchedule

    from peft_lalora import AlternationController, LALoraTrainerCallback

    t = build(tmp_path)
    first = AlternationController(t.model, t)  # the user's own, removed before train()
    first.remove()
    t._attach_alternation()  # what train() does first
    assert t.controller is not None and t.controller is not first
    assert t.controller.schedule == AlternationSchedule("step", "B")  # the LALoraConfig's, passed
    t._attach_alternation()  # a live controller: no second one
    live = [cb for cb in t.callback_handler.callbacks if isinstance(cb, LALoraTrainerCallback) and cb.controller]
    assert len(live) == 1
    # the DPTrainer's controller freezes with opacus_spectral.set_trainable: Opacus' per-sample state goes too
    a = [f.param for f in t.controller.factors if f.factor == "A"]
    for p in a:
        p.grad_sample = torch.zeros(1)
    t.controller.advance(0)  # phase "B": A frozen
    assert all(not p.requires_grad and p.grad_sample is None for p in a)
