"""The README's code examples run as written (with a tiny model and generated data filled in)."""

from __future__ import annotations

import re

import torch
from repo_support import ROOT
from tiny_models import tiny_bert, token_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

README = ROOT / "README.md"


def _blocks() -> dict[str, str]:
    text = README.read_text()
    out = {}
    for title, code in re.findall(r"## (\S+) in 20 lines\s+```python\n(.*?)```", text, flags=re.S):
        out[title] = code
    return out


def test_opacus_spectral_example_runs():
    code = _blocks()["opacus_spectral"]

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))

        def forward(self, x):
            return self.net(x)

    g = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)), batch_size=16
    )
    ns = {"MyModel": MyModel, "loader": loader}
    exec(compile(code, "README:opacus_spectral", "exec"), ns)
    assert ns["engine"].post_hooks.diagnostics.steps >= 1
    assert ns["engine"].get_epsilon(1e-5) > 0


def test_peft_lalora_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks()["peft_lalora"]
    ns = {"base_model": tiny_bert(), "device": "cpu", "loader": token_loader()}
    exec(compile(code, "README:peft_lalora", "exec"), ns)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter-lora" / "adapter_config.json").exists()
    assert ns["controller"].mode == "step"
