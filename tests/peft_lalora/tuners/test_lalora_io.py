"""Save / load / merge / export round trips of a LALoRA adapter: max |Δ logits| <= 1e-6."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from lalora_support import batch, bert_base, build, gpt2_base  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer

import peft_lalora  # noqa: E402
from peft_lalora import LALoraConfig, export_as_lora  # noqa: E402

TOL = 1e-6
BASES = {"bert": bert_base, "gpt2": gpt2_base}


def _trained(arch: str):
    """A LALoRA model whose A, B and classifier head all differ from their initial values."""
    model = build(arch, init_b=True, alternation="round", first_factor="A")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.3)
    return model.eval()


def _logits(model, x) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(params=["bert", "gpt2"])
def saved(request, tmp_path):
    arch = request.param
    model = _trained(arch)
    x, _ = batch(4, seed=1)
    ref = _logits(model, x)
    model.save_pretrained(tmp_path / "adapter")
    return arch, model, x, ref, tmp_path


def test_save_and_from_pretrained(saved) -> None:
    arch, model, x, ref, tmp = saved
    cfg = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["alternation"], cfg["first_factor"]) == ("LALORA", "round", "A")
    loaded = PeftModel.from_pretrained(BASES[arch](0), tmp / "adapter")
    assert isinstance(loaded.peft_config["default"], LALoraConfig)
    assert loaded.peft_config["default"].alternation == "round"
    assert type(loaded.base_model).__name__ == "LALoraModel"
    assert _maxdiff(_logits(loaded, x), ref) <= TOL
    assert _maxdiff(ref, _logits(BASES[arch](0), x)) > 1e-3  # the adapter matters
    assert not any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)
    trainable = PeftModel.from_pretrained(BASES[arch](0), tmp / "adapter", is_trainable=True)
    assert all(p.requires_grad for n, p in trainable.named_parameters() if "lora_" in n)


def test_load_adapter_second_adapter(saved) -> None:
    arch, model, x, ref, tmp = saved
    other = build(arch, seed=0, r=2, alternation="none")  # another LALoRA adapter as "default"
    assert _maxdiff(_logits(other, x), ref) > 1e-3
    other.load_adapter(str(tmp / "adapter"), adapter_name="lalora")
    other.set_adapter("lalora")
    assert isinstance(other.peft_config["lalora"], LALoraConfig)
    assert _maxdiff(_logits(other, x), ref) <= TOL
    # PEFT refuses to mix tuner types in one PeftModel: a plain LoRA model cannot load a LALoRA adapter
    lora = get_peft_model(
        BASES[arch](0),
        LoraConfig(
            r=2,
            target_modules=["query"] if arch == "bert" else ["c_attn"],
            fan_in_fan_out=arch == "gpt2",
            task_type="SEQ_CLS",
        ),
    )
    with pytest.raises(ValueError, match="different peft types"):
        lora.load_adapter(str(tmp / "adapter"), adapter_name="lalora")


def test_transformers_load_adapter(saved) -> None:
    arch, model, x, ref, tmp = saved
    base = BASES[arch](0)
    base.load_adapter(str(tmp / "adapter"), adapter_name="lalora")
    assert any(isinstance(m, LoraLayer) for m in base.modules())
    assert _maxdiff(_logits(base, x), ref) <= TOL


def test_auto_peft_model_offline(tmp_path, monkeypatch) -> None:
    from peft import AutoPeftModelForSequenceClassification

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base_dir = tmp_path / "base"
    bert_base(0).save_pretrained(base_dir)
    model = _trained("bert")
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    model.save_pretrained(tmp_path / "adapter")
    x, _ = batch(4, seed=2)
    auto = AutoPeftModelForSequenceClassification.from_pretrained(str(tmp_path / "adapter"))
    assert isinstance(auto.peft_config["default"], LALoraConfig)
    assert _maxdiff(_logits(auto, x), _logits(model, x)) <= TOL


def test_merge_and_unload(saved) -> None:
    arch, model, x, ref, tmp = saved
    merged = model.merge_and_unload()
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    assert _maxdiff(_logits(merged, x), ref) <= TOL


def test_get_set_peft_model_state_dict(saved) -> None:
    arch, model, x, ref, tmp = saved
    state = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}  # values alias live params
    assert any(".lora_A." in k for k in state) and any(".lora_B." in k for k in state)
    fresh = get_peft_model(BASES[arch](0), model.peft_config["default"])
    assert _maxdiff(_logits(fresh, x), ref) > 1e-3
    result = set_peft_model_state_dict(fresh, state)
    assert not [k for k in result.unexpected_keys if "lora_" in k]
    assert _maxdiff(_logits(fresh, x), ref) <= TOL


def test_export_as_lora_exact(saved) -> None:
    arch, model, x, ref, tmp = saved
    out = export_as_lora(model, tmp / "exported")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and "alternation" not in cfg and "first_factor" not in cfg
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8  # relabel keeps rank and alpha (no SVD re-factoring)
    loaded = PeftModel.from_pretrained(BASES[arch](0), out)
    assert type(loaded.peft_config["default"]) is LoraConfig
    assert _maxdiff(_logits(loaded, x), ref) == 0.0  # bit-exact: same tensors, same forward
    # from a saved directory, too
    out2 = export_as_lora(tmp / "adapter", tmp / "exported2")
    loaded2 = PeftModel.from_pretrained(BASES[arch](0), out2)
    assert _maxdiff(_logits(loaded2, x), ref) == 0.0


def test_export_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="no adapter_config.json"):
        export_as_lora(tmp_path, tmp_path / "out")
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="LALoRA/LoRA adapters only"):
        export_as_lora(tmp_path / "ia3", tmp_path / "out")
    model = _trained("bert")
    with pytest.raises(ValueError, match="not found"):
        export_as_lora(model, tmp_path / "out", adapter_name="nope")


@pytest.mark.slow
def test_fresh_processes_load_saved_and_exported_adapters(tmp_path) -> None:
    """A new interpreter that imports peft_lalora loads the LALoRA adapter; plain PEFT (no peft_lalora)
    loads the exported one and fails clearly without the import."""
    base_dir = tmp_path / "base"
    bert_base(0).save_pretrained(base_dir)
    model = _trained("bert")
    model.save_pretrained(tmp_path / "adapter")
    export_as_lora(model, tmp_path / "exported")
    x, _ = batch(4, seed=3)
    torch.save({"x": x, "ref": _logits(model, x)}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import BertForSequenceClassification
        from peft import PeftModel
        d = torch.load({str(tmp_path / "io.pt")!r})
        def logits(path):
            m = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained({str(base_dir)!r}), path)
            with torch.no_grad():
                return m.eval()(input_ids=d["x"]).logits
        plain = (logits({str(tmp_path / "exported")!r}) - d["ref"]).abs().max().item()
        try:
            logits({str(tmp_path / "adapter")!r}); err = "none"
        except KeyError as e:
            err = "KeyError:" + str(e)
        assert "peft_lalora" not in sys.modules
        import peft_lalora
        lalora = (logits({str(tmp_path / "adapter")!r}) - d["ref"]).abs().max().item()
        print("RESULT", plain, err, lalora)
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][0].split()
    assert float(line[1]) == 0.0
    assert line[2] == "KeyError:'LALORA'"
    assert float(line[3]) <= TOL


def test_peft_save_as_lora_is_only_approximate_comparison(tmp_path) -> None:
    """PEFT's own conversion re-factors ΔW by SVD: close, but not the bit-exact relabel."""
    from peft.tuners.lora import save_as_lora

    model = _trained("bert")
    x, _ = batch(4, seed=1)
    ref = _logits(model, x)
    save_as_lora(tmp_path / "svd", model, rank=4)
    svd = PeftModel.from_pretrained(bert_base(0), tmp_path / "svd")
    diff = _maxdiff(_logits(svd, x), ref)
    assert diff <= 1e-5
    export_as_lora(model, tmp_path / "relabel")
    exact = PeftModel.from_pretrained(bert_base(0), tmp_path / "relabel")
    assert _maxdiff(_logits(exact, x), ref) == 0.0
    assert peft_lalora.is_registered()
