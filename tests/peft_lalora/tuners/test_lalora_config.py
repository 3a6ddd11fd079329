"""LALoraConfig validation and PEFT registration."""

from __future__ import annotations

import subprocess
import sys

import pytest
from peft import LoraConfig, mapping
from peft_lalora.tuners.lalora.registration import register

import peft_lalora
from peft_lalora import LALoraConfig, LALoraModel, LALoraPeftType


def test_peft_type_is_str_enum_and_defaults() -> None:
    cfg = LALoraConfig(r=4, target_modules=["q"])
    assert cfg.peft_type is LALoraPeftType.LALORA
    assert cfg.peft_type == "LALORA" and cfg.peft_type.value == "LALORA"
    assert (cfg.alternation, cfg.first_factor) == ("step", "B")
    assert isinstance(cfg, LoraConfig)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alternation": "stepwise"}, "Unknown alternation mode 'stepwise'.*'step'.*'round'.*'freeze_a'.*'none'"),
        ({"alternation": None}, "Unknown alternation mode None"),
        ({"first_factor": "b"}, "first_factor must be 'B'.*or 'A'.*got 'b'"),
        ({"alternation": "freeze_a", "first_factor": "A"}, "never trains A"),
        ({"alternation": "step", "use_dora": True}, "does not support use_dora=True"),
    ],
)
def test_bad_config_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LALoraConfig(r=4, target_modules=["q"], **kwargs)


def test_valid_combinations() -> None:
    for mode in ("step", "round", "freeze_a", "none"):
        assert LALoraConfig(r=2, target_modules=["q"], alternation=mode).alternation == mode
    assert LALoraConfig(r=2, target_modules=["q"], alternation="none", use_dora=True).use_dora
    assert LALoraConfig(r=2, target_modules=["q"], alternation="round", first_factor="A").first_factor == "A"


def test_registration_tables_and_idempotence() -> None:
    assert mapping.PEFT_TYPE_TO_CONFIG_MAPPING["LALORA"] is LALoraConfig
    assert mapping.PEFT_TYPE_TO_TUNER_MAPPING["LALORA"] is LALoraModel
    assert mapping.PEFT_TYPE_TO_PREFIX_MAPPING["LALORA"] == "lora_"
    sizes = [len(t) for t in (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, mapping.PEFT_TYPE_TO_TUNER_MAPPING)]
    register()
    register()
    assert [len(t) for t in (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, mapping.PEFT_TYPE_TO_TUNER_MAPPING)] == sizes
    assert peft_lalora.is_registered()
    # LoRA itself untouched
    assert mapping.PEFT_TYPE_TO_CONFIG_MAPPING["LORA"] is LoraConfig


def test_registration_refuses_to_overwrite_foreign_entry() -> None:
    class OtherConfig(LoraConfig):
        pass

    table = mapping.PEFT_TYPE_TO_CONFIG_MAPPING
    table["LALORA"] = OtherConfig
    try:
        with pytest.raises(RuntimeError, match="refusing to overwrite"):
            register()
        assert table["LALORA"] is OtherConfig  # nothing changed
        assert mapping.PEFT_TYPE_TO_TUNER_MAPPING["LALORA"] is LALoraModel
        assert not peft_lalora.is_registered()
    finally:
        del table["LALORA"]
        register()
    assert peft_lalora.is_registered()


_ORDERS = {
    # our names before PEFT: the registration that importing PEFT triggers must not meet a half-imported module
    "config-first": "from peft_lalora import LALoraConfig",
    "model-module-first": "from peft_lalora.tuners.lalora.model import LALoraModel",
    # transformers probes PEFT with importlib.util.find_spec before anything imports it: a probe is not an import
    "controller-first": "from peft_lalora import AlternationController\nimport peft",
    "probe-then-import": "import peft_lalora\nimport importlib.util\nimportlib.util.find_spec('peft')\nimport peft",
}


@pytest.mark.parametrize(
    "order",
    [
        "config-first",
        "probe-then-import",
        pytest.param("model-module-first", marks=pytest.mark.slow),
        pytest.param("controller-first", marks=pytest.mark.slow),
    ],
)
def test_lalora_is_registered_whatever_is_imported_first(order) -> None:
    """A fresh interpreter: PEFT knows "LALORA" (config class and tuner) after each import order a user may write."""
    code = (
        f"{_ORDERS[order]}\n"
        "from peft import mapping\n"
        "import peft_lalora\n"
        "assert peft_lalora.is_registered()\n"
        "assert mapping.PEFT_TYPE_TO_CONFIG_MAPPING['LALORA'] is peft_lalora.LALoraConfig\n"
        "assert mapping.PEFT_TYPE_TO_TUNER_MAPPING['LALORA'] is peft_lalora.LALoraModel\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
