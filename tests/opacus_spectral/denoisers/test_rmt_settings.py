"""RMTSettings (validated once, one set of defaults), rmt_denoise's stage results and RMTDenoiser's settings
(``docs/denoisers.md``, ``docs/math.md`` §1)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from opacus_spectral.denoisers.rmt import (
    PAPER_SETTING,
    PAPER_SETTINGS,
    RMTDenoiser,
    RMTSettings,
    bulk_edge,
    gate_threshold,
    rmt_denoise,
)
from opacus_spectral.denoisers.rmt import denoiser as denoiser_mod
from opacus_spectral.plugins.registry import get_registry

from opacus_spectral import NoisyGradient

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))


def spiked(b: int, m: int, n: int, s: float, strengths: tuple[float, ...], seed: int = 0) -> torch.Tensor:
    """``s·Z`` plus orthonormal spikes at ``strengths`` × the BBP threshold, per matrix of a batch."""
    gen = torch.Generator().manual_seed(seed)
    x = s * torch.randn(b, m, n, generator=gen, dtype=torch.float64)
    k = len(strengths)
    if k:
        u = torch.linalg.qr(torch.randn(b, m, k, generator=gen, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(b, n, k, generator=gen, dtype=torch.float64))[0]
        lam = s * (m * n) ** 0.25 * torch.tensor(strengths, dtype=torch.float64)
        x += (u * lam) @ v.mT
    return x.float().to(DEVICE)


def recs(x: torch.Tensor, s: float) -> list[NoisyGradient]:
    return [NoisyGradient(f"l{i}.weight", "weight", t.clone(), s, 0) for i, t in enumerate(x)]


BAD = [
    ("gate", "tw", "gate"),
    ("kappa", -1.0, "kappa"),
    ("kappa", float("inf"), "kappa"),
    ("kappa", True, "kappa"),
    ("false_alarm", 0.9, "false_alarm"),
    ("tw_centering", "ma2", "tw_centering"),
    ("norm_correction", "clean", "norm_correction"),
    ("residual", 1.5, "residual"),
    ("residual", True, "residual"),
    ("method", "svd", "method"),
    ("gram_max", 0, "gram_max"),
    ("screen", "lanczos", "screen"),
    ("krylov_min", 1.5, "krylov_min"),
    ("oversample", -2, "oversample"),
    ("max_iter", 0, "max_iter"),
    ("tol", 0.0, "tol"),
    ("false_shut", 1e-2, "false_shut"),
    ("compute_dtype", torch.float16, "compute_dtype"),
    ("compute_dtype", "half", "compute_dtype"),
    ("seed", 1.5, "seed"),
]


@pytest.mark.parametrize(("field", "value", "match"), BAD)
def test_each_bad_value_is_one_clear_error(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        RMTSettings(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(err.value) or str(value) in str(err.value)  # the message shows the bad value
    with pytest.raises(ValueError, match=match):  # the denoiser's keyword form: the same check
        RMTDenoiser(**{field: value})
    with pytest.raises(ValueError, match=match):  # and rmt_denoise's
        rmt_denoise(torch.ones(2, 3, device=DEVICE), 1.0, **{field: value})


def test_values_are_normalised_and_the_settings_are_frozen() -> None:
    st = RMTSettings(norm_correction=True, compute_dtype="float64", kappa=1, residual=1)
    assert (st.norm_correction, st.compute_dtype, st.kappa, st.residual) == ("noisy", torch.float64, 1.0, 1.0)
    assert RMTSettings(norm_correction=False).norm_correction == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.gate = "kappa"  # type: ignore[misc]
    assert st.replace(gate="kappa").gate == "kappa" and st.gate == "tracy_widom"
    with pytest.raises(ValueError, match="gate"):
        st.replace(gate="nope")  # type: ignore[arg-type]


def test_one_set_of_defaults_for_the_denoiser_rmt_denoise_and_the_registry() -> None:
    st = RMTSettings()
    assert (st.gate, st.false_alarm, st.norm_correction, st.residual) == ("tracy_widom", 1e-3, "clean_estimate", 0.0)
    assert RMTDenoiser().settings == st == get_registry().create("rmt").settings
    assert get_registry().create("rmt_paper").settings == PAPER_SETTINGS == st.replace(**PAPER_SETTING)
    x = spiked(3, 40, 60, 0.1, (2.0,), seed=1)
    a, b = x.clone(), x.clone()
    RMTDenoiser()(recs(a, 0.1))
    RMTDenoiser(settings=RMTSettings())(recs(b, 0.1))
    ra, rb = recs(x, 0.1), recs(x, 0.1)
    RMTDenoiser()(ra)
    RMTDenoiser(settings=st)(rb)
    assert all(torch.equal(p.tensor, q.tensor) for p, q in zip(ra, rb, strict=True))
    one = ra[0].tensor
    assert torch.equal(one, rmt_denoise(x[0], 0.1).tensor) and not torch.equal(one, x[0])  # rmt_denoise: same defaults


KEYWORD_FORMS = [
    {},
    PAPER_SETTING,
    {"gate": "kappa", "norm_correction": True},
    {"norm_correction": False, "residual": "james_stein"},
    {"residual": 0.5, "method": "full"},
    {"method": "truncated", "screen": "krylov", "oversample": 4, "compute_dtype": "float64"},
    {"method": "truncated", "screen": "cholesky", "tw_centering": "ma", "false_alarm": 0.05},
]


@pytest.mark.parametrize("kw", KEYWORD_FORMS)
def test_keyword_form_equals_the_settings_form_bitwise(kw: dict[str, object]) -> None:
    x = spiked(4, 48, 72, 0.1, (3.0, 1.5), seed=2)
    x[1] = spiked(1, 48, 72, 0.1, (), seed=3)[0]  # one pure-noise matrix: its gate stays shut
    old, new = rmt_denoise(x, 0.1, **kw), rmt_denoise(x, 0.1, settings=RMTSettings(**kw))  # type: ignore[arg-type]
    for f in ("tensor", "gated", "finite", "top", "tau", "spikes"):
        assert torch.equal(getattr(old, f), getattr(new, f)), f
    assert old.work == new.work and old.gated.any()
    a, b = recs(x, 0.1), recs(x, 0.1)
    RMTDenoiser(**kw)(a)  # type: ignore[arg-type]
    RMTDenoiser(settings=RMTSettings(**kw))(b)  # type: ignore[arg-type]
    assert all(torch.equal(p.tensor, q.tensor) for p, q in zip(a, b, strict=True))
    with pytest.raises(TypeError, match="not both"):
        rmt_denoise(x, 0.1, settings=RMTSettings(), gate="kappa")
    with pytest.raises(TypeError, match="not both"):
        RMTDenoiser(settings=RMTSettings(), gate="kappa")
    with pytest.raises(TypeError, match="RMTSettings"):
        RMTDenoiser(settings=dict(kw))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RMTDenoiser(sigma=0.1)  # an unknown keyword


@pytest.mark.parametrize("method", ["gram", "truncated", "full"])
@pytest.mark.parametrize("gate", ["kappa", "tracy_widom"])
def test_the_result_carries_tau_and_spike_counts(method: str, gate: str) -> None:
    s = torch.tensor([0.1, 0.1, 0.5, 0.0])
    x = spiked(4, 30, 50, 0.1, (4.0, 3.0), seed=4)
    res = rmt_denoise(x, s, gate=gate, method=method)  # type: ignore[arg-type]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    assert res.tau is not None and res.spikes is not None
    assert torch.equal(res.tau, gate_threshold(safe, 30, 50, gate))  # type: ignore[arg-type]
    if gate == "kappa":
        torch.testing.assert_close(res.tau, 1.02 * bulk_edge(safe, 30, 50), rtol=1e-6, atol=0)
    assert res.gated.tolist() == [True, True, False, False]  # s × 5: the spikes sink into the bulk; s = 0: left
    assert res.spikes.tolist() == [2, 2, 0, 0]
    assert bool((res.top[res.gated] > res.tau[res.gated]).all())


def test_the_denoiser_uses_the_tau_of_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The marginal count (``top < 1.05 τ``) reads τ from ``rmt_denoise``'s result: equal to the threshold."""
    seen: list[object] = []
    real = denoiser_mod.rmt_denoise

    def spy(g: torch.Tensor, sigma: object, **kw: object) -> object:
        res = real(g, sigma, **kw)  # type: ignore[arg-type]
        seen.append((res, kw["settings"], g.shape))
        return res

    monkeypatch.setattr(denoiser_mod, "rmt_denoise", spy)
    x = spiked(6, 16, 256, 1.0, (), seed=5)
    d = RMTDenoiser(gate="kappa", kappa=0.98, warn_after=0)  # pure noise crosses this gate, barely: marginal gates
    d(recs(x, 1.0))
    ((res, st, shape),) = seen
    assert st is d.settings and shape == (6, 16, 256)
    expected_tau = gate_threshold(torch.full((6,), 1.0), 16, 256, "kappa", 0.98)
    assert torch.equal(res.tau, expected_tau)  # type: ignore[union-attr]
    marginal = int((res.gated & (res.top < 1.05 * expected_tau)).sum())  # type: ignore[union-attr]
    assert int(d.stats["marginal"]) == marginal > 0 and int(d.stats["gated"]) == int(res.gated.sum())  # type: ignore[union-attr]


def test_per_matrix_stats_in_the_harness_form_and_no_other_name() -> None:
    paper = get_registry().create(("rmt_paper", {"per_matrix_stats": True}))  # as dp-bench regime-map builds it
    assert paper.per_matrix_stats and paper.settings == PAPER_SETTINGS and not RMTDenoiser().per_matrix_stats
    with pytest.raises(TypeError, match="diagnostics"):
        RMTDenoiser(diagnostics=True)  # type: ignore[call-arg]


def test_the_declared_selector_and_the_thin_selects() -> None:
    d = RMTDenoiser(roles=("lora_A", "lora_B"), params="enc")
    assert d.selector.matches("enc.q.lora_A", "lora_A") and not d.selector.matches("enc.q.lora_A", "weight")
    assert not d.selects("dec.q.lora_B", "lora_B") and d.selects("enc.q.lora_B", "lora_B")
    assert d.roles == frozenset({"lora_A", "lora_B"}) and d.params == "enc"
    assert "lora_A" in str(d.selector) and "enc" in str(d.selector)
    assert (d.gate, d.kappa, d.compute_dtype) == ("tracy_widom", 1.02, torch.float32)  # settings read through
    with pytest.raises(AttributeError, match="nope"):
        _ = d.nope  # type: ignore[attr-defined]
