"""The attachment layer (opacus_spectral.step.attachment): one per DPOptimizer, ordered subscribers to the events of a
DP step, removal that leaves the optimizer exactly as it was, and the checks made once for every subscriber."""

from __future__ import annotations

import warnings

import opacus
import pytest
import torch
from engine_helpers import Recorder, loader, mlp
from opacus_spectral.audit import GradientCanaries
from opacus_spectral.doctor.doctor import install_doctor
from opacus_spectral.errors import DoctorWarning
from opacus_spectral.step.attachment import (
    AFTER_ACCOUNTANT,
    AFTER_STEP,
    BEFORE_ACCOUNTANT,
    BEFORE_INNER_STEP,
    BEFORE_NOISE,
    EVENTS,
    PHYSICAL_BATCH,
    attachment,
    find_attachment,
)
from peft import get_peft_model
from peft_lalora.alternation.schedule import AlternationSchedule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

import peft_lalora
from opacus_spectral import PrivacyEngine, install_post_hooks, set_trainable
from peft_lalora import AlternationController, LALoraConfig

NM, C = 1.0, 1.0


def _without_guard(engine, keep: bool) -> None:
    """These tests attach every subscriber themselves: the engine's own (float32 clipping, docs/engine.md "Reduced
    precision") is removed unless ``keep``."""
    if not keep and getattr(engine, "precision_guard", None) is not None:
        engine.precision_guard.remove()


def _mlp_private(*, doctor=False, post_hooks=None, engine_cls=PrivacyEngine, precision_guard=False, **kw):
    model = mlp(hidden=32, d_out=4)
    engine = engine_cls(accountant="rdp")
    extra = {"doctor": doctor, "post_hooks": post_hooks} if engine_cls is PrivacyEngine else {}
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader(64, 16, d_out=4, sampler_seed=5),
        noise_multiplier=NM,
        max_grad_norm=kw.pop("max_grad_norm", C),
        noise_generator=torch.Generator().manual_seed(7),
        **extra,
        **kw,
    )
    _without_guard(engine, precision_guard)
    return engine, gsm, opt, dl


def _step(gsm, opt, dl, n=1):
    batches = iter(dl)
    for _ in range(n):
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.mse_loss(gsm(x), y).backward()
        opt.step()


def _footprint(opt):
    """Everything the layer may change on an optimizer: its instance attributes and the inner optimizer's hooks."""
    inner = opt.original_optimizer
    return (
        opt.step_hook,
        sorted(opt.__dict__),
        dict(inner._optimizer_step_pre_hooks),
        dict(inner._optimizer_step_post_hooks),
        sorted(inner.__dict__),
    )


def test_events_fire_in_step_order_and_subscribers_by_order_key():
    engine, gsm, opt, dl = _mlp_private()
    att = attachment(opt)
    log = []
    # subscribed out of order: the order key decides, ties keep subscription order
    for event in reversed(EVENTS):
        for order, tag in ((300, "c"), (100, "a"), (300, "c2"), (200, "b")):
            att.subscribe(
                event, lambda arg, e=event, t=tag: log.append((e, t, len(engine.accountant.history))), order=order
            )
    _step(gsm, opt, dl)
    assert [(e, t) for e, t, _ in log] == [(e, t) for e in EVENTS for t in ("a", "b", "c", "c2")]
    counted = {e: n for e, _, n in log}
    assert counted[BEFORE_ACCOUNTANT] == 0 and counted[AFTER_ACCOUNTANT] == 1  # the accountant runs in between
    with pytest.raises(ValueError, match="unknown event"):
        att.subscribe("after_noise", print, order=0)


def test_virtual_steps_reach_only_the_physical_batch_event():
    engine, gsm, opt, dl = _mlp_private()
    seen = []
    for event in EVENTS:
        attachment(opt).subscribe(event, lambda arg, e=event: seen.append(e), order=0)
    x, y = next(iter(dl))
    for skip in (True, False):  # BatchMemoryManager's virtual step, then the logical one
        nn.functional.mse_loss(gsm(x), y).backward()
        opt.signal_skip_step(do_skip=skip)
        opt.step()
        opt.zero_grad()
    assert seen == [PHYSICAL_BATCH, *EVENTS]


def _lora_bert(alternation="step"):
    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        num_labels=2,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    lora = LALoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS", alternation=alternation
    )
    model = get_peft_model(BertForSequenceClassification(cfg), lora)
    model.train()
    return model


def _token_loader():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(1, 100, (32, 6), generator=g), torch.randint(0, 2, (32,), generator=g))
    return DataLoader(data, batch_size=8, generator=torch.Generator().manual_seed(2))


def _lora_private(engine_cls=PrivacyEngine, precision_guard=False, **kw):
    model = _lora_bert()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = engine_cls(accountant="rdp")
    _, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(trainable, lr=0.5),
        data_loader=_token_loader(),
        noise_multiplier=NM,
        max_grad_norm=kw.pop("max_grad_norm", C),
        wrap_model=False,
        noise_generator=torch.Generator().manual_seed(3),
        **kw,
    )
    _without_guard(engine, precision_guard)
    return engine, model, opt, dl


def _train_lora(model, opt, dl, steps=3, between=None):
    done = 0
    while done < steps:
        for x, y in dl:
            if len(x) == 0:
                continue
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(input_ids=x).logits, y).backward()
            opt.step()
            done += 1
            if between is not None:
                between(done)
            if done == steps:
                break
    return [p.detach().clone() for p in model.parameters()]


def test_library_subscribers_keep_their_relative_order_whatever_the_order_of_attaching():
    engine, model, opt, dl = _lora_private(post_hooks=[], doctor=False, precision_guard=True)
    controller = AlternationController(model, opt, mode="none")
    canaries = GradientCanaries(opt, 10, module=model, seed=0)
    doctor = install_doctor(opt, model, accountant=engine.accountant, mode="warn")  # attached last, runs first
    att = find_attachment(opt)
    owners = {e: [fn.__self__ for fn in att.subscribers(e)] for e in EVENTS}
    assert owners[BEFORE_INNER_STEP] == [doctor, engine.post_hooks, canaries]  # pipeline before canary reading
    assert owners[AFTER_STEP] == [doctor, engine.post_hooks, controller]
    assert owners[AFTER_ACCOUNTANT] == [doctor, engine.post_hooks]  # the std snapshot after the doctor's checks
    assert owners[BEFORE_NOISE] == [canaries] and owners[PHYSICAL_BATCH] == [engine.precision_guard, doctor]
    _train_lora(model, opt, dl, steps=2)
    assert canaries.steps == 2 and controller.total_steps == 2 and engine.post_hooks.logical_steps == 2


def test_removing_every_subscriber_restores_the_optimizer_exactly():
    engine, model, opt, dl = _lora_private(doctor=False)
    accountant_hook = opt.step_hook
    before = _footprint(opt)
    handle = install_post_hooks(opt, [Recorder()], module=model)
    doctor = install_doctor(opt, model, accountant=engine.accountant, mode="raise", data_loader=dl)
    canaries = GradientCanaries(opt, 10, module=model, seed=0)
    controller = AlternationController(model, opt)
    assert "add_noise" in opt.__dict__ and "pre_step" in opt.__dict__ and opt.step_hook is not accountant_hook
    assert len(opt.original_optimizer._optimizer_step_pre_hooks) == 1  # one hook for every subscriber
    _train_lora(model, opt, dl, steps=2)
    for part in (canaries, handle, controller, doctor):
        assert find_attachment(opt) is not None
        part.remove()
    assert find_attachment(opt) is None
    assert opt.step_hook is accountant_hook and _footprint(opt) == before
    # the optimizer trains on as plain Opacus: the accountant alone counts the steps
    _train_lora(model, opt, dl, steps=1)
    assert sum(n for _, _, n in engine.accountant.history) == 3


def test_a_method_wrapped_over_the_layer_stays_wrapped_and_the_layer_passes_through():
    engine, gsm, opt, dl = _mlp_private()
    calls = []
    sub = attachment(opt).subscribe(BEFORE_NOISE, lambda o: calls.append("layer"), order=0)
    ours = opt.add_noise

    def theirs():  # e.g. a fault injector wrapping add_noise after the canaries attached
        calls.append("theirs")
        ours()

    opt.add_noise = theirs
    _step(gsm, opt, dl)
    sub.remove()
    assert opt.add_noise is theirs and find_attachment(opt) is None
    _step(gsm, opt, dl)
    assert calls == ["theirs", "layer", "theirs"]
    assert sum(n for _, _, n in engine.accountant.history) == 2


def test_one_detection_of_an_inner_step_without_noise_reaches_pipeline_doctor_and_subscribers():
    engine, gsm, opt, dl = _mlp_private(doctor="warn", post_hooks=[Recorder()])
    seen = []
    attachment(opt).subscribe(BEFORE_INNER_STEP, lambda step: seen.append(step.noised), order=250)
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.original_optimizer.step()  # bypasses Opacus: p.grad is the clean gradient
    doctor = [w for w in caught if issubclass(w.category, DoctorWarning) and "[accounting]" in str(w.message)]
    assert len(caught) == len(doctor) == 1 and seen == [False]  # reported once, by the doctor (the pipeline counts it)
    assert engine.post_hooks.diagnostics.skipped == 1 and engine.post_hooks.denoisers[0].seen == []
    assert [f.check for f in engine.doctor.findings] == ["accounting"]
    opt.zero_grad()
    _step(gsm, opt, dl)  # a DP step: noised, the pipeline runs
    assert seen == [False, True] and len(engine.post_hooks.denoisers[0].seen) == 1


def test_per_layer_clipping_with_toggling_is_refused_once_by_the_layer():
    engine, model, opt, dl = _lora_private(
        post_hooks=[],
        clipping="per_layer",
        max_grad_norm=[1.0] * sum(p.requires_grad for p in _lora_bert().parameters()),
    )
    subscribers = {e: len(find_attachment(opt).subscribers(e)) for e in EVENTS}
    with pytest.raises(ValueError, match=r"alternation='step' cannot be used with Opacus per-layer clipping"):
        AlternationController(model, opt, schedule=AlternationSchedule("step"))
    assert {e: len(find_attachment(opt).subscribers(e)) for e in EVENTS} == subscribers  # nothing attached
    AlternationController(model, opt, mode="none")  # toggles nothing: allowed
    _train_lora(model, opt, dl, steps=1)
    a = [p for n, p in model.named_parameters() if "lora_A" in n]
    set_trainable(a, False)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="per_layer") as err:
        _train_lora(model, opt, dl, steps=1)
    assert "trainable parameters changed" in str(err.value)
    assert sum(n for _, _, n in engine.accountant.history) == 1  # refused before the accountant counted it
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))


def test_two_subscribers_of_the_same_kind_coexist():
    engine, gsm, opt, dl = _mlp_private(post_hooks=[])
    first = GradientCanaries(opt, 20, module=gsm, seed=1)
    second = GradientCanaries(opt, 20, module=gsm, seed=2)
    _step(gsm, opt, dl, n=2)
    att = find_attachment(opt)
    assert [fn.__self__ for fn in att.subscribers(BEFORE_NOISE)] == [first, second]
    first.remove()
    assert [fn.__self__ for fn in att.subscribers(BEFORE_NOISE)] == [second]
    _step(gsm, opt, dl, n=1)
    assert (first.steps, second.steps) == (2, 3)


@pytest.mark.parametrize("stack", ["plain opacus", "alternating"])
def test_a_run_with_pipeline_doctor_and_controller_is_bit_identical(stack):
    """pipeline [] + doctor + controller change no number: against vanilla Opacus (nothing toggles), and against
    this engine with nothing attached and the same phases applied by hand."""
    if stack == "plain opacus":
        _, model, opt, dl = _lora_private(opacus.PrivacyEngine)
        reference = _train_lora(model, opt, dl)
        _, model, opt, dl = _lora_private(post_hooks=[], doctor="raise")
        AlternationController(model, opt, mode="none")
        got = _train_lora(model, opt, dl)
    else:
        _, model, opt, dl = _lora_private(post_hooks=None, doctor=False)
        factors = peft_lalora.find_lora_factors(model)

        def by_hand(done):  # LA-LoRA, B first: the phase after `done` steps
            peft_lalora.alternation.factors.apply_phase(factors, "BA"[done % 2], set_trainable)

        by_hand(0)
        reference = _train_lora(model, opt, dl, steps=4, between=by_hand)
        _, model, opt, dl = _lora_private(post_hooks=[], doctor="raise")
        controller = AlternationController(model, opt)
        got = _train_lora(model, opt, dl, steps=4)
        assert controller.total_steps == 4
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))


def test_a_subscriber_may_remove_the_last_subscription_inside_an_inner_step_event():
    engine, gsm, opt, dl = _mlp_private()
    accountant_hook = opt.step_hook
    hooks = dict(opt.original_optimizer._optimizer_step_post_hooks)
    calls = []

    def once(step):
        calls.append(step.noised)
        sub.remove()  # torch is iterating the inner optimizer's hooks: the detach waits for the next call

    sub = attachment(opt).subscribe(AFTER_STEP, once, order=0)
    _step(gsm, opt, dl, n=2)
    assert calls == [True] and find_attachment(opt) is None
    assert opt.step_hook is accountant_hook and dict(opt.original_optimizer._optimizer_step_post_hooks) == hooks
    assert sum(n for _, _, n in engine.accountant.history) == 2
