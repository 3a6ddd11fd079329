"""The doctor (opacus_spectral.doctor.doctor): each silent DP failure reproduced, caught with its cause named, and
silence on correct runs (hooks and ghost, BatchMemoryManager, LA-LoRA alternation)."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate.utils import set_module_tensor_to_device
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.doctor.doctor import accounted_steps, install_doctor, resolve_mode
from opacus_spectral.errors import DoctorError, DoctorWarning, ReproducibleNoiseWarning
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_bert, token_loader
from torch import nn

from opacus_spectral import PrivacyEngine


def lora_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"], task_type="SEQ_CLS")
        return get_peft_model(tiny_bert(seed=seed), cfg)


def private(model, optimizer=None, *, mode="hooks", doctor="raise", nm=1.0, C=1.0, wrap=False, noise_seed=None, **kw):
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)  # noise_seed: the paired runs need the same noise
        engine = PrivacyEngine(accountant="rdp", noise_seed=noise_seed)
    out = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=token_loader(),
        noise_multiplier=nm,
        max_grad_norm=C,
        grad_sample_mode=mode,
        wrap_model=wrap,
        doctor=doctor,
        **kw,
    )
    return engine, out


def sgd(model, lr):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)


def step(model, out, mode="hooks"):
    x, y = next(iter(out[-1]))  # a Poisson batch of the DP loader (the doctor pairs each DP step with one)
    logits = model(input_ids=x).logits
    loss = out[2](logits, y) if mode == "ghost" else nn.functional.cross_entropy(logits, y)
    loss.backward()
    out[1].step()
    out[1].zero_grad(set_to_none=True)


def lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_silent_on_a_correct_run_with_alternation_and_batch_memory_manager(mode):
    from peft_lalora import AlternationController

    model = lora_model()
    engine, out = private(model, mode=mode, post_hooks=["rmt"])
    controller = AlternationController(model, out[1], mode="step")
    crit = out[2] if mode == "ghost" else nn.functional.cross_entropy
    with warnings.catch_warnings():
        warnings.simplefilter("error", DoctorWarning)
        with BatchMemoryManager(data_loader=out[-1], max_physical_batch_size=8, optimizer=out[1]) as loader:
            for x, y in loader:
                crit(model(input_ids=x).logits, y).backward()
                out[1].step()
                out[1].zero_grad(set_to_none=True)
    assert controller.total_steps == len(out[-1]) == 4
    assert engine.doctor.findings == [] and engine.doctor.first_step_checked


def test_820_parameters_replaced_after_make_private():
    """model.to(device) re-creating parameters after get_peft_model / make_private: the optimizer and Opacus hold
    the old tensors. Upstream Opacus fails with an AttributeError that names neither; the doctor names the cause."""
    for doctor in (False, "raise"):
        model = lora_model()
        engine, out = private(model, doctor=doctor)
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            model.to("cpu")  # re-creates every Parameter (what a device move does in this mode)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        if doctor is False:
            with pytest.raises(AttributeError, match="_forward_counter"):
                step(model, out)
        else:
            with pytest.raises(DoctorError, match=r"no longer uses.*replaced.*#820.*device -> get_peft_model"):
                step(model, out)


def test_820_lazy_materialization():
    """The lazy-loading path (accelerate's set_module_tensor_to_device materializes a NEW Parameter), caught before
    the forward; a model still on the meta device is refused at make_private."""
    model = lora_model()
    engine, out = private(model, doctor="warn")
    name = next(n for n, p in model.named_parameters() if "lora_A" in n)
    old = model.get_parameter(name)
    set_module_tensor_to_device(model, name, "cpu", value=old.detach().clone())
    assert model.get_parameter(name) is not old
    with pytest.warns(DoctorWarning, match="no longer uses"), pytest.raises(AttributeError):
        step(model, out)  # the doctor speaks first; Opacus then fails on the new tensor
    assert [f.check for f in engine.doctor.findings] == ["optimizer_params"]
    assert engine.doctor.findings[0].params == (name,)

    with torch.device("meta"):
        meta = get_peft_model(tiny_bert(), LoraConfig(r=4, target_modules=["query"], task_type="SEQ_CLS"))
    with pytest.raises(DoctorError, match="meta device"):
        private(meta)


def peft_after_optimizer():
    """The wrong order: the optimizer is built on the base model, then get_peft_model adds (and trains) adapters."""
    base = tiny_bert()
    optimizer = torch.optim.SGD(base.parameters(), lr=0.1)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")), optimizer


def test_optimizer_built_before_get_peft_model_trains_nothing():
    """Silent upstream: the DPOptimizer holds no trainable parameter, so Opacus steps without noise or accounting;
    the adapter never moves and epsilon stays 0."""
    model, optimizer = peft_after_optimizer()
    engine, out = private(model, optimizer, doctor=False)
    before = lora(model)
    step(model, out)
    assert all(torch.equal(before[n], p) for n, p in lora(model).items()) and engine.accountant.history == []

    with pytest.raises(DoctorError, match="not in the optimizer.*before get_peft_model"):
        private(*peft_after_optimizer())
    model, optimizer = peft_after_optimizer()
    with pytest.warns(DoctorWarning) as caught:
        engine, out = private(model, optimizer, doctor="warn")
        step(model, out)
    assert {f.check for f in engine.doctor.findings} == {"optimizer_params", "accounting"}
    assert any("WITHOUT noise" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_requires_grad_toggled_on_after_make_private(mode):
    """A parameter frozen at make_private and unfrozen later has no per-sample hooks. Ghost clipping then updates it
    without clipping it (no error upstream: the guarantee is void); hooks mode fails with an unrelated message."""
    model = lora_model()
    pooler = model.base_model.model.bert.pooler.dense.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # holds the frozen pooler too
    C = 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine, out = private(model, optimizer, mode=mode, doctor=False, nm=0.0, C=C, allow_non_private=True)
    pooler.requires_grad_(True)
    if mode == "hooks":
        with pytest.raises(ValueError, match="Per sample gradient not found"):
            step(model, out, mode)
    else:  # one example: its clipped contribution must have norm <= C over ALL trained parameters
        x, y = next(iter(token_loader(seed=1)))
        out[2](model(input_ids=x[:1]).logits, y[:1]).backward()
        out[1].step()
        norm = torch.sqrt(sum(p.summed_grad.pow(2).sum() for p in out[1].params)).item()
        others = torch.sqrt(sum(p.summed_grad.pow(2).sum() for p in out[1].params if p is not pooler)).item()
        assert others == pytest.approx(C, rel=1e-4) and norm > 1.1 * C  # the pooler's share escaped clipping

    model = lora_model()
    pooler = model.base_model.model.bert.pooler.dense.weight
    engine, out = private(model, torch.optim.SGD(model.parameters(), lr=0.1), mode=mode)
    pooler.requires_grad_(True)
    expected = "NOT clipped" if mode == "ghost" else "no per-sample gradient"
    with pytest.raises(DoctorError, match=rf"became trainable after make_private.*{expected}.*set_trainable"):
        step(model, out, mode)


def test_accountant_steps_equal_optimizer_steps(tmp_path):
    # the accountant's step hook replaced: noise is added but never counted, epsilon under-reported
    model = lora_model()
    engine, out = private(model, doctor=False)
    out[1].step_hook = None
    step(model, out)
    assert engine.accountant.history == []  # silent upstream
    model = lora_model()
    engine, out = private(model, doctor="warn")
    out[1].step_hook = None
    with pytest.warns(DoctorWarning, match=r"\[accounting\].*replaced"):
        step(model, out)
    # the inner optimizer stepped directly
    model = lora_model()
    engine, out = private(model)
    x, y = next(iter(token_loader()))
    nn.functional.cross_entropy(model(input_ids=x).logits, y).backward()
    with pytest.raises(DoctorError, match="without a noisy, accounted DP step"):
        out[1].original_optimizer.step()
    # an accountant hook missing from, or doubled in, the step_hook chain the doctor joins
    for hook, word in ((None, "counted 0 steps.*under-reported"), ("twice", "counted 2 steps.*over-reported")):
        model = lora_model()
        engine, out = private(model, doctor=False)
        engine.precision_guard.remove()  # the engine's last subscriber: the step_hook chain is Opacus' alone again
        accountant_hook = out[1].step_hook
        out[1].step_hook = None if hook is None else (lambda opt, h=accountant_hook: (h(opt), h(opt)))
        install_doctor(out[1], out[0], accountant=engine.accountant, mode="raise")
        with pytest.raises(DoctorError, match=word):
            step(model, out)
    # restoring an accountant's history between steps (checkpoints, federated clients) is not a finding
    model = lora_model()
    engine, out = private(model)
    step(model, out)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=out[1])
    step(model, out)
    engine.load_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=out[1])
    step(model, out)
    assert accounted_steps(engine.accountant) == 2 and engine.doctor.findings == []


def test_parameters_that_did_not_move():
    model = lora_model()
    engine, out = private(model, sgd(model, 1e-12), doctor="warn")  # the update rounds away in float32
    with pytest.warns(DoctorWarning, match=r"\[unchanged\].*did not change"):
        step(model, out)
    model = lora_model()
    engine, out = private(model, sgd(model, 0.0))  # lr 0 (e.g. warm-up): not a finding, checked at a later step
    step(model, out)
    assert engine.doctor.findings == [] and not engine.doctor.first_step_checked


def test_switch_and_zero_effect_on_training():
    finals = []
    for doctor in (False, "raise"):
        torch.manual_seed(0)  # dropout
        model = lora_model()
        engine, out = private(model, doctor=doctor, noise_seed=0)
        for _ in range(2):
            step(model, out)
        finals.append(lora(model))
        if doctor is False:
            audit = engine.batch_check  # the batch-independence audit stays for the run: its one hook
            audit_hooks = 0 if audit is None or audit._hook is None else 1
            assert engine.doctor is None and len(model._forward_pre_hooks) == audit_hooks
        else:
            assert engine.doctor.mode == "raise" and engine.doctor.first_step_checked
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])  # bit-identical with and without
    assert [resolve_mode(s) for s in (True, "warn", "raise", False, None)] == ["warn", "warn", "raise", None, None]

    model = lora_model()
    engine, out = private(model, wrap=True)
    first = engine.doctor
    engine.make_private(
        module=out[0], optimizer=sgd(model, 0.1), data_loader=token_loader(), noise_multiplier=1.0, max_grad_norm=1.0
    )
    # the old doctor and batch check were removed: the new doctor's hook and the new (not yet run) check's remain
    assert engine.doctor is not first and len(model._forward_pre_hooks) == 2

    engine = PrivacyEngine(accountant="rdp")
    model = lora_model()
    engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=token_loader(),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        wrap_model=False,
        doctor="raise",
    )
    assert engine.doctor.mode == "raise"
    with pytest.raises(ValueError, match="doctor must be"):
        private(lora_model(), doctor="loud")
