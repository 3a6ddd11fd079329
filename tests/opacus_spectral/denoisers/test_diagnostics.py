"""Spectrum reports (``opacus_spectral.denoisers.spectrum_report``): spectral entropy, oracle cosine report, spectrum
plot."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from opacus_spectral.denoisers.spectrum_report import cosine_report, plot_spectrum, spectral_entropy

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))


def test_spectral_entropy_values() -> None:
    sv = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 1.0, 0.0]], device=DEVICE)
    h = spectral_entropy(sv)
    p = torch.tensor([0.8, 0.2])
    assert h.tolist() == pytest.approx([0.0, math.log(3), 0.0, float(-(p * p.log()).sum())], abs=1e-6)
    assert spectral_entropy(sv, normalized=True)[1].item() == pytest.approx(1.0)


def test_cosine_report_per_tensor_and_global() -> None:
    clean = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 10.0, 0.0])}
    noisy = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0, 1.0, 1.0])}
    den = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, -1.0, 0.0])}
    r = cosine_report(noisy, den, clean)
    assert r["per_tensor"]["a"]["noisy"] == pytest.approx(1 / math.sqrt(2))
    assert r["per_tensor"]["a"]["denoised"] == pytest.approx(1.0)
    assert r["per_tensor"]["b"]["denoised"] == pytest.approx(-1.0)
    assert r["per_tensor"]["a"]["gain"] == pytest.approx(1 - 1 / math.sqrt(2))
    # global: over the concatenation, not the mean of the per-tensor cosines
    assert r["global"]["noisy"] == pytest.approx(11 / (2 * math.sqrt(101)))
    assert r["global"]["denoised"] == pytest.approx(-9 / (math.sqrt(2) * math.sqrt(101)))
    seq = cosine_report(list(noisy.values()), list(den.values()), list(clean.values()))
    assert seq["global"] == r["global"] and set(seq["per_tensor"]) == {"0", "1"}
    assert math.isnan(cosine_report([torch.ones(2)], [torch.ones(2)], [torch.zeros(2)])["global"]["noisy"])
    with pytest.raises(ValueError):
        cosine_report({"a": torch.ones(2)}, {"b": torch.ones(2)}, {"a": torch.ones(2)})
    with pytest.raises(ValueError):
        cosine_report([torch.ones(2)], [torch.ones(3)], [torch.ones(2)])


def test_plot_spectrum_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(30, 2, generator=gen) @ torch.randn(2, 40, generator=gen)
    noisy = clean + 0.1 * torch.randn(30, 40, generator=gen)
    out = plot_spectrum(clean, noisy, clean, 0.1, tmp_path / "s.png", title="t")
    data = Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    conv = plot_spectrum(None, noisy.reshape(30, 4, 10), noisy.reshape(30, 4, 10), 0.1, tmp_path / "c.png")
    assert Path(conv).exists()
