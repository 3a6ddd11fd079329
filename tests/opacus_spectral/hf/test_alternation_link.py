"""How DPTrainer and peft-lalora's alternation find each other: the ``opacus_spectral_alternation_controller`` hook
(declared in opacus_spectral.hookspecs, implemented by peft-lalora's entry-point plugin) and the trainer's
``set_trainable``, where both used to look each other up in ``sys.modules``."""

from __future__ import annotations

import re

import pytest
import torch
from opacus_spectral.plugins.registry import get_registry
from peft_lalora.alternation.factors import find_lora_factors, set_requires_grad
from repo_support import ROOT
from text_support import tiny_bert
from trainer_support import lalora_model, trainer

from opacus_spectral import hookimpl
from peft_lalora import AlternationController, LALoraTrainerCallback


def test_neither_library_finds_the_other_through_sys_modules():
    """No look-up of the other library in ``sys.modules`` (peft_lalora's ``__init__`` does ask whether ``peft`` is
    imported yet, to register its PEFT type: that is PEFT, not opacus-spectral)."""
    other = re.compile(r"sys\.modules[^\n]*(opacus_spectral|peft_lalora)")
    found = [
        str(p.relative_to(ROOT))
        for src in ("opacus_spectral/src", "peft_lalora/src")
        for p in (ROOT / src).rglob("*.py")
        if other.search(p.read_text())
    ]
    assert found == []


def test_peft_lalora_implements_the_hook_through_its_entry_point():
    registry = get_registry()
    registry.load()
    impls = registry.pm.hook.opacus_spectral_alternation_controller.get_hookimpls()
    assert "peft_lalora" in [impl.plugin_name for impl in impls]


def test_a_lalora_model_gets_its_controller_freezing_through_the_trainer(tmp_path):
    t = trainer(tmp_path)
    t._attach_alternation()  # what train() does first
    controller = t.controller
    assert isinstance(controller, AlternationController) and controller._set_trainable == t.set_trainable
    a = [f.param for f in controller.factors if f.factor == "A"]
    for p in a:
        p.grad_sample = torch.zeros(1)
    controller.advance(0)  # phase "B": A frozen, Opacus' per-sample state dropped with it
    assert all(not p.requires_grad and p.grad_sample is None for p in a)


def test_the_base_model_of_a_lalora_model_gets_its_controller_too(tmp_path):
    """``get_base_model()`` (the transformers model PEFT injected LoRA into) answers ``active_adapters`` as a method,
    not PEFT's property: DPTrainer raised a raw "'method' object is not iterable"."""
    t = trainer(tmp_path, lalora_model().get_base_model())
    t._attach_alternation()
    assert isinstance(t.controller, AlternationController) and {f.factor for f in t.controller.factors} == {"A", "B"}


def test_alternation_false_attaches_nothing(tmp_path):
    t = trainer(tmp_path, alternation=False)
    t._attach_alternation()
    assert t.controller is None and all(f.param.requires_grad for f in find_lora_factors(t.model))
    assert not any(isinstance(cb, LALoraTrainerCallback) for cb in t.callback_handler.callbacks)


def test_a_controller_the_user_attaches_to_a_dptrainer_freezes_through_it_and_a_plain_trainer_through_torch(tmp_path):
    from transformers import Trainer

    t = trainer(tmp_path, alternation=False)
    assert AlternationController(t.model, t)._set_trainable == t.set_trainable
    model = lalora_model()
    plain = Trainer(model=model, args=t.args)
    assert AlternationController(model, plain)._set_trainable is set_requires_grad


class ThirdParty:
    """A plugin answering for a model that carries no LALoRA adapter."""

    def __init__(self):
        self.asked = []

    @hookimpl
    def opacus_spectral_alternation_controller(self, trainer):
        self.asked.append(trainer)
        return "controller" if not hasattr(trainer.model, "peft_config") else None


def test_any_plugin_can_answer_the_hook(tmp_path):
    from peft import LoraConfig, get_peft_model

    plugin, registry = ThirdParty(), get_registry()
    assert registry.register(plugin, name="third-party-alternation")
    try:
        lalora = trainer(tmp_path / "a")
        lalora._attach_alternation()
        model = tiny_bert(seed=0)
        other = trainer(tmp_path / "b", model=model)  # no adapter at all: only the third party answers
        other._attach_alternation()
        lora = trainer(tmp_path / "c", model=get_peft_model(tiny_bert(seed=0), LoraConfig(target_modules=["query"])))
        lora._attach_alternation()  # a plain LoRA adapter: nobody answers
    finally:
        registry.unregister("third-party-alternation")
    assert isinstance(lalora.controller, AlternationController)
    assert other.controller == "controller" and lora.controller is None
    # the order every hook is called in, oldest registration first: peft-lalora (an entry point) answers for its
    # LALoRA model before the third party is asked (pluggy's own dispatch, LIFO, asked the newest first)
    assert plugin.asked == [other, lora]


def test_the_oldest_registration_answers_first_and_a_refusal_reaches_the_caller(tmp_path):
    class Refusing:
        @hookimpl
        def opacus_spectral_alternation_controller(self, trainer):
            raise ValueError("this set-up is refused")

    registry = get_registry()
    first, second = ThirdParty(), Refusing()
    assert registry.register(first, name="third-party-first") and registry.register(second, name="third-party-second")
    try:
        t = trainer(tmp_path, model=tiny_bert(seed=0))
        t._attach_alternation()  # the older registration answers: the refusing newer one is never asked
        assert t.controller == "controller"
        registry.unregister("third-party-first")
        with pytest.raises(ValueError, match="this set-up is refused"):
            trainer(tmp_path / "b", model=tiny_bert(seed=0))._attach_alternation()
    finally:
        for name in ("third-party-first", "third-party-second"):
            if registry.pm.get_plugin(name) is not None:
                registry.unregister(name)
