"""One AlternationController per optimizer (or Trainer): a second is refused until the first is removed.

Before, a second controller on the same optimizer attached a second step hook: both counted every step and
whichever applied its phase last decided silently which factor trained."""

from __future__ import annotations

import pytest
import torch
from lalora_support import batch, build  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset

import peft_lalora  # noqa: E402
from peft_lalora import AlternationController  # noqa: E402


def _opt(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(peft_lalora.lalora_param_groups(model, 1e-2))


def _step(model, opt) -> None:
    x, y = batch(4, seed=3)
    opt.zero_grad()
    model(input_ids=x, labels=y).loss.backward()
    opt.step()


def test_a_second_controller_on_one_optimizer_is_refused_until_remove() -> None:
    model = build("bert", alternation="step")
    model.train()
    opt = _opt(model)
    first = AlternationController(model, opt)
    with pytest.raises(ValueError, match=r"already has an AlternationController.*call \.remove\(\) on the first"):
        AlternationController(model, opt, mode="round", first_factor="A")
    assert first.phase == "B" and all(f.param.requires_grad == (f.factor == "B") for f in first.factors)
    _step(model, opt)
    assert first.total_steps == 1  # the refused controller attached nothing
    first.remove()
    second = AlternationController(model, opt)  # allowed once the first is removed
    _step(model, opt)
    assert (first.total_steps, second.total_steps, second.phase) == (1, 1, "A")
    # a failed construction claims nothing: the optimizer stays free after an error
    second.remove()
    with pytest.raises(ValueError, match="mode"):
        AlternationController(model, opt, mode="sometimes")  # type: ignore[arg-type]
    AlternationController(model, opt)


def test_the_inner_optimizer_of_a_dp_optimizer_is_the_same_optimizer() -> None:
    opacus_spectral = pytest.importorskip("opacus_spectral")
    model = build("bert", alternation="step")
    model.train()
    x, y = batch(16, seed=5)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    _, dp_opt, _ = engine.make_private(
        module=model,
        optimizer=_opt(model),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    ctrl = AlternationController(model, dp_opt, mode="none")  # nothing frozen: the second sees every factor
    for target in (dp_opt, dp_opt.original_optimizer):
        with pytest.raises(ValueError, match="already has an AlternationController"):
            AlternationController(model, target, mode="none")
    ctrl.remove()
    step = AlternationController(model, dp_opt)
    # a factor frozen by a still-attached controller: the error says which controller to remove
    with pytest.raises(ValueError, match=r"must be trainable when make_private.*already has .*call \.remove\(\)"):
        AlternationController(model, dp_opt)
    step.remove()


def test_a_second_controller_on_one_trainer_is_refused(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    model = build("bert")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=[])
    first = AlternationController(model, trainer)
    with pytest.raises(ValueError, match="this Trainer already has an AlternationController"):
        AlternationController(model, trainer)
    first.remove()
    AlternationController(model, trainer)
