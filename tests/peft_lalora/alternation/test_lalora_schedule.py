"""The alternation schedule on a plain torch optimizer and an HF Trainer: which factor trains when,
that only it moves (AdamW with weight decay), and checkpoint/resume."""

from __future__ import annotations

import pytest
import torch
from lalora_support import batch, build, changed_factors, factor_snapshot  # noqa: E402

import peft_lalora  # noqa: E402
from peft_lalora import AlternationController, phase_at  # noqa: E402

# Steps 1-3 in round 0, start_round(), steps 4-6 in round 1.
EXPECTED = {
    ("step", "B"): ["B", "A", "B", "B", "A", "B"],
    ("step", "A"): ["A", "B", "A", "A", "B", "A"],
    ("round", "B"): ["B", "B", "B", "A", "A", "A"],
    ("round", "A"): ["A", "A", "A", "B", "B", "B"],
    ("freeze_a", "B"): ["B"] * 6,
    ("none", "B"): ["AB"] * 6,
}


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2, weight_decay=0.1))


def _train_step(model, opt, step: int) -> None:
    x, y = batch(8, seed=100 + step)
    opt.zero_grad()
    model(input_ids=x, labels=y).loss.backward()
    opt.step()


def _adam_state(opt, params) -> list[torch.Tensor | None]:
    out = []
    for p in params:
        st = opt.state.get(p, {})
        out.append(st["exp_avg"].clone() if "exp_avg" in st else None)
    return out


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize(("mode", "first"), list(EXPECTED))
def test_phase_sequence_and_only_active_factor_moves(arch: str, mode: str, first: str) -> None:
    model = build(arch, alternation=mode, first_factor=first)
    model.train()
    opt = _adamw(model)
    ctrl = AlternationController(model, opt)
    head = [p for n, p in model.named_parameters() if "modules_to_save" in n and p.requires_grad]
    assert head, "classifier head should be trainable"
    seen, moved = [], []
    for i in range(6):
        if i == 3:
            ctrl.start_round()
        seen.append(ctrl.phase)
        for f in ctrl.factors:  # requires_grad follows the phase before the step
            assert f.param.requires_grad == (f.factor in ctrl.phase), (i, f.name)
        frozen = [f.param for f in ctrl.factors if f.factor not in ctrl.phase]
        moments = _adam_state(opt, frozen)
        before = factor_snapshot(model)
        head_before = [p.detach().clone() for p in head]
        _train_step(model, opt, i)
        moved.append(changed_factors(before, model))
        assert all(not torch.equal(a, p) for a, p in zip(head_before, head, strict=True)), "head must train every step"
        for m0, m1 in zip(moments, _adam_state(opt, frozen), strict=True):  # frozen factor: AdamW moments untouched
            assert (m0 is None and m1 is None) or torch.equal(m0, m1)
        for p in frozen:
            assert p.grad is None
    assert seen == EXPECTED[(mode, first)]
    assert moved == EXPECTED[(mode, first)]
    assert ctrl.total_steps == 6 and ctrl.step == 3 and ctrl.round == 1


def test_phase_at_pure_function() -> None:
    assert [phase_at("step", "B", k, 0) for k in range(4)] == ["B", "A", "B", "A"]
    assert [phase_at("step", "A", k, 7) for k in range(3)] == ["A", "B", "A"]
    assert [phase_at("round", "B", 5, t) for t in range(3)] == ["B", "A", "B"]
    assert phase_at("freeze_a", "B", 3, 3) == "B" and phase_at("none", "A", 1, 1) == "AB"
    with pytest.raises(ValueError, match="Unknown alternation mode"):
        phase_at("alternate", "B", 0, 0)


def test_start_round_semantics() -> None:
    model = build("bert", alternation="round")
    ctrl = AlternationController(model, _adamw(model))
    ctrl.start_round()  # first call starts server round 1 = schedule round 0
    assert (ctrl.server_round, ctrl.round, ctrl.phase) == (1, 0, "B")
    ctrl.start_round()
    assert (ctrl.server_round, ctrl.round, ctrl.phase) == (2, 1, "A")
    ctrl.start_round(server_round=7)  # federated clients rebuilt per round pass Flower's 1-based server_round
    assert (ctrl.round, ctrl.step, ctrl.phase) == (6, 0, "B")
    with pytest.raises(ValueError, match=">= 1"):
        ctrl.start_round(server_round=0)
    with pytest.raises(ValueError, match=">= 1"):
        ctrl.start_round(server_round=True)


def test_start_round_takes_server_round_by_keyword_only() -> None:
    """A positional round (the removed 0-based ``round_index``) is refused, never read as a 1-based round."""
    model = build("bert", alternation="round", first_factor="A")
    ctrl = AlternationController(model, _adamw(model))
    with pytest.raises(TypeError):
        ctrl.start_round(3)  # type: ignore[misc]
    with pytest.raises(TypeError):
        ctrl.start_round(round_index=3)  # type: ignore[call-arg]
    ctrl.start_round(server_round=4)
    assert (ctrl.round, ctrl.server_round, ctrl.phase, ctrl.state_dict()["round"]) == (3, 4, "B", 3)


def test_schedule_is_passed_not_rediscovered() -> None:
    from peft_lalora.alternation.schedule import AlternationSchedule

    model = build("bert", alternation="step", first_factor="B")
    config = next(iter(model.peft_config.values()))
    assert config.schedule == AlternationSchedule("step", "B")
    # the schedule given wins over the adapter's, and is the one state_dict reports
    ctrl = AlternationController(model, _adamw(model), schedule=AlternationSchedule("round", "A"))
    assert (ctrl.mode, ctrl.first_factor, ctrl.phase) == ("round", "A", "A")
    assert ctrl.state_dict()["mode"] == "round"
    ctrl.remove()
    with pytest.raises(TypeError, match="not both"):
        AlternationController(model, None, schedule=AlternationSchedule(), mode="none")
    with pytest.raises(TypeError, match="AlternationSchedule"):
        AlternationController(model, None, schedule=("step", "B"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contradicts"):
        AlternationSchedule("freeze_a", "A")  # validated once, when built
    with pytest.raises(ValueError, match="Unknown alternation mode"):
        AlternationSchedule("sometimes", "B")  # type: ignore[arg-type]
    assert AlternationSchedule("freeze_a").trained == "B" and not AlternationSchedule("none").freezes


def test_apply_phase_is_the_one_freeze_operation() -> None:
    from peft_lalora.alternation.factors import apply_phase, set_requires_grad

    model = build("bert")
    factors = peft_lalora.find_lora_factors(model)
    for f in factors:
        f.param.grad = torch.ones_like(f.param)
    calls = []
    apply_phase(factors, "B", lambda params, on: calls.append((len(params), on)))
    n_a = sum(f.factor == "A" for f in factors)
    assert calls == [(n_a, False), (len(factors) - n_a, True)]  # A first, then B
    apply_phase(factors, "B")  # default: requires_grad, and grad=None when freezing
    assert all(f.param.requires_grad == (f.factor == "B") for f in factors)
    assert all((f.param.grad is None) == (f.factor == "A") for f in factors)
    set_requires_grad([factors[0].param], True)
    assert factors[0].param.requires_grad


def test_lora_weights_actually_move_and_merge_changes_output() -> None:
    model = build("bert")
    opt = _adamw(model)
    ctrl = AlternationController(model, opt)
    x, _ = batch(4, seed=3)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=x).logits
    model.train()
    for i in range(2):
        _train_step(model, opt, i)
    assert ctrl.total_steps == 2
    deltas = [f.param.detach().abs().max().item() for f in ctrl.factors if f.factor == "B"]
    assert min(deltas) > 1e-4  # B started at exactly zero
    model.eval()
    with torch.no_grad():
        after = model(input_ids=x).logits
    assert (after - before).abs().max().item() > 1e-4


@pytest.mark.parametrize(("mode", "first"), [("step", "B"), ("step", "A"), ("round", "B")])
def test_checkpoint_resume_mid_round_reproduces_uninterrupted_run(mode: str, first: str, tmp_path) -> None:
    def schedule(ctrl, model, opt, steps, log):
        for i in steps:
            if i in (0, 2):
                ctrl.start_round()
            log.append(ctrl.phase)
            _train_step(model, opt, i)

    # uninterrupted: round 0 = steps 0,1; round 1 = steps 2..5
    model = build("gpt2", alternation=mode, first_factor=first, init_b=True)
    opt = _adamw(model)
    ctrl = AlternationController(model, opt)
    full: list[str] = []
    schedule(ctrl, model, opt, range(6), full)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}

    # interrupted after step 3 (mid round 1), restored into fresh objects
    model = build("gpt2", alternation=mode, first_factor=first, init_b=True)
    opt = _adamw(model)
    ctrl = AlternationController(model, opt)
    part: list[str] = []
    schedule(ctrl, model, opt, range(4), part)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ctrl": ctrl.state_dict()}, path)
    del model, opt, ctrl

    ckpt = torch.load(path, weights_only=False)
    model = build("gpt2", alternation=mode, first_factor=first, init_b=False, seed=123)  # different init
    opt = _adamw(model)
    ctrl = AlternationController(model, opt)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    ctrl.load_state_dict(ckpt["ctrl"])
    assert ctrl.state_dict() == ckpt["ctrl"]
    schedule(ctrl, model, opt, range(4, 6), part)
    assert part == full
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), reference[n]), n


def test_load_state_dict_refuses_other_schedule() -> None:
    model = build("bert")
    ctrl = AlternationController(model, _adamw(model))
    state = ctrl.state_dict()
    with pytest.raises(ValueError, match="differs"):
        ctrl.load_state_dict({**state, "mode": "round"})
    with pytest.raises(ValueError, match="missing"):
        ctrl.load_state_dict({"mode": "step"})
    with pytest.raises(ValueError, match="Inconsistent"):
        ctrl.load_state_dict({**state, "phase": "A"})


def test_controller_bad_input() -> None:
    model = build("bert")
    frozen_opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_A" not in n and p.requires_grad])
    with pytest.raises(ValueError, match="not in the optimizer"):
        AlternationController(model, frozen_opt)
    with pytest.raises(ValueError, match="Unknown alternation mode"):
        AlternationController(model, None, mode="sometimes")
    with pytest.raises(TypeError, match="torch optimizer"):
        AlternationController(model, object())
    from lalora_support import bert_base
    from peft import LoraConfig, get_peft_model

    plain = get_peft_model(bert_base(), LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match="pass mode="):
        AlternationController(plain, None)
    ctrl = AlternationController(plain, None, mode="step", first_factor="A")  # plain LoRA + explicit schedule
    assert ctrl.phase == "A" and all(f.param.requires_grad == (f.factor == "A") for f in ctrl.factors)
    ctrl.advance()
    assert ctrl.phase == "B"
    ctrl.remove()
    assert all(f.param.requires_grad for f in ctrl.factors)


def test_param_groups_lr_ratio() -> None:
    model = build("bert")
    groups = peft_lalora.lalora_param_groups(model, 1e-3, b_lr_ratio=2.0, weight_decay=0.01)
    by_name = {g["name"]: g for g in groups}
    assert by_name["lora_A"]["lr"] == 1e-3 and by_name["lora_B"]["lr"] == 2e-3 and by_name["other"]["lr"] == 1e-3
    assert len(by_name["lora_A"]["params"]) == len(by_name["lora_B"]["params"]) == 4  # 2 layers x (query, value)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in groups) == n_trainable
    with pytest.raises(ValueError, match="> 0"):
        peft_lalora.lalora_param_groups(model, 1e-3, b_lr_ratio=0.0)


def test_hf_trainer_counts_real_steps_only(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    model = build("bert")
    x, y = batch(16, seed=9)
    data = [{"input_ids": x[i], "labels": y[i]} for i in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    ctrl = AlternationController(model, trainer)
    assert all(f.param.requires_grad for f in ctrl.factors)  # the Trainer must see both factors
    before = factor_snapshot(model)
    trainer.train()
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(id(f.param) in in_opt for f in ctrl.factors)
    assert ctrl.total_steps == 3  # 3 optimizer steps, not 6 micro-batches
    assert ctrl.phase == "A"  # after B, A, B
    assert changed_factors(before, model) == "AB"


def test_trainer_callback_fast_forwards_on_resume() -> None:
    from types import SimpleNamespace

    model = build("bert")
    opt = _adamw(model)
    ctrl = AlternationController(model, None)
    cb = peft_lalora.LALoraTrainerCallback(ctrl)
    cb.on_train_begin(None, SimpleNamespace(global_step=3), None, optimizer=opt)  # resumed at global step 3
    assert (ctrl.step, ctrl.total_steps, ctrl.phase) == (3, 3, "A")
    assert all(f.param.requires_grad == (f.factor == "A") for f in ctrl.factors)
    cb.on_optimizer_step(None, SimpleNamespace(global_step=4), None)
    assert ctrl.phase == "B"
    bad = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_B" in n])
    with pytest.raises(ValueError, match="not in the optimizer"):
        cb.on_train_begin(None, SimpleNamespace(global_step=0), None, optimizer=bad)
