"""RMTDenoiser on NoisyGradient records: selection, shapes, grouping, sigma, dtypes, stats."""

from __future__ import annotations

import math
import os

import pytest
import torch
from opacus_spectral.denoisers.rmt import PAPER_SETTING, DenoiseResult, rmt_denoise
from opacus_spectral.denoisers.rmt import RMTDenoiser as _RMTDenoiser
from opacus_spectral.denoisers.rmt import denoiser as rmt_mod
from opacus_spectral.step.parameters import ParamInfo
from opacus_spectral.step.pipeline import PostNoisePipeline

from opacus_spectral import NoisyGradient

DEVICE = torch.device(os.environ.get("OPACUS_SPECTRAL_TEST_DEVICE", "cpu"))


def spiked_matrix(m: int, n: int, s: float, seed: int, strength: float = 5.0, rank: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, rank, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, rank, generator=gen, dtype=torch.float64))[0]
    x = strength * s * (m * n) ** 0.25 * u @ v.T
    return (x + s * torch.randn(m, n, generator=gen, dtype=torch.float64)).float().to(DEVICE)


def rec(name: str, role: str, t: torch.Tensor, sigma: float = 0.1, layer: str | None = None) -> NoisyGradient:
    return NoisyGradient(name=name, role=role, tensor=t, sigma=sigma, step=0, layer=layer)


def RMTDenoiser(**kw: object) -> _RMTDenoiser:  # noqa: N802
    """Paper A's setting (κ gate, noisy-norm rescale) unless a test overrides it: these tests pin paper A's
    formulas against ``rmt.rmt_denoise``; the library's defaults are pinned by ``test_defaults_...``."""
    return _RMTDenoiser(**{"gate": "kappa", "norm_correction": "noisy", **kw})  # type: ignore[arg-type]


def test_defaults_are_the_measured_ones_and_the_paper_setting_is_registered() -> None:
    """Default: Tracy–Widom gate at 1e-3 + clean-norm estimate (docs/results.md §7); "rmt_paper" = κ 1.02 + noisy."""
    from opacus_spectral.plugins.registry import get_registry

    d = _RMTDenoiser()
    assert (d.gate, d.false_alarm, d.norm_correction, d.residual) == ("tracy_widom", 1e-3, "clean_estimate", 0.0)
    p = get_registry().create("rmt_paper")
    assert isinstance(p, _RMTDenoiser)
    assert (p.gate, p.kappa, p.norm_correction) == ("kappa", 1.02, "noisy")
    assert get_registry().create(("rmt_paper", {"kappa": 1.1})).kappa == 1.1  # other options pass through
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(48, generator=g), torch.randn(64, generator=g)
    t = 0.1 * torch.randn(48, 64, generator=g) + 5.0 * torch.outer(u / u.norm(), v / v.norm())  # edge ≈ 1.49
    a, b = t.clone(), t.clone()
    p([rec("w", "weight", a)])
    _RMTDenoiser(gate="kappa", norm_correction="noisy")([rec("w", "weight", b)])
    assert torch.equal(a, b) and not torch.equal(a, t)  # the registered name is exactly the paper setting


def run(d: _RMTDenoiser, recs: list[NoisyGradient]) -> tuple[list[torch.Tensor], list[bool]]:
    """Apply ``d``; returns the resulting tensors and, per record, whether its values changed."""
    before = [r.tensor.clone() for r in recs]
    result = d(recs)
    if result is None:
        after = [r.tensor for r in recs]
    else:
        after = [r.tensor if o is None else o for r, o in zip(recs, result, strict=True)]
        assert all(torch.equal(r.tensor, b) for r, b in zip(recs, before, strict=True))  # records untouched
    changed = [
        not torch.equal(a.nan_to_num(), b.nan_to_num()) or not torch.equal(a.isnan(), b.isnan())
        for a, b in zip(after, before, strict=True)
    ]
    return after, changed


def expected(t: torch.Tensor, sigma: float, **kw: object) -> torch.Tensor:
    mat = t if t.dim() == 2 else t.reshape(t.shape[0], -1)
    return rmt_denoise(mat, sigma, **{**PAPER_SETTING, **kw}).tensor.reshape(t.shape)  # type: ignore[arg-type]


def test_acts_on_every_matrix_role_and_shape() -> None:
    s = 0.1
    lin = spiked_matrix(48, 32, s, 1)  # Linear (out, in)
    a = spiked_matrix(4, 96, s, 2)  # LoRA A (r, in)
    b = spiked_matrix(96, 4, s, 3)  # LoRA B (out, r)
    c1d = spiked_matrix(32, 96, s, 4)  # GPT-2 Conv1D (in, out)
    conv = spiked_matrix(16, 3 * 3 * 3, s, 5).reshape(16, 3, 3, 3)  # conv kernel → (out, in·k·k)
    recs = [
        rec("l.weight", "weight", lin),
        rec("q.lora_A", "lora_A", a),
        rec("q.lora_B", "lora_B", b),
        rec("h.c_attn.weight", "weight", c1d),
        rec("conv.weight", "weight", conv),
    ]
    before = [r.tensor.clone() for r in recs]
    for inplace in (True, False):
        d = RMTDenoiser(inplace=inplace)
        fresh = [rec(r.name, r.role, t.clone()) for r, t in zip(recs, before, strict=True)]
        out, changed = run(d, fresh)
        assert changed == [True] * 5
        for o, t0 in zip(out, before, strict=True):
            assert o.shape == t0.shape and o.dtype == t0.dtype
            torch.testing.assert_close(o, expected(t0, s), rtol=0, atol=0)
    assert d.stats["matrices"] == 5 and int(d.stats["gated"]) == 5
    assert int(d.stats["nonfinite"]) == 0


def test_vectors_scalars_empty_and_integer_tensors_untouched() -> None:
    recs = [
        rec("l.bias", "bias", torch.randn(32, device=DEVICE)),
        rec("ln.weight", "bias", torch.randn(8, device=DEVICE)),
        rec("scalar", "weight", torch.tensor(3.0, device=DEVICE)),
        rec("empty", "weight", torch.zeros(0, 5, device=DEVICE)),
        rec("int", "weight", torch.ones(4, 4, dtype=torch.int64, device=DEVICE)),
    ]
    d = RMTDenoiser()
    assert run(d, recs)[1] == [False] * len(recs)
    assert d.stats["matrices"] == 0


def through_pipeline(d: _RMTDenoiser, recs: list[NoisyGradient]) -> list[bool]:
    """Per record, whether it changed when the pipeline hands ``d`` the records its selector picks (as in training)."""
    before = [r.tensor.clone() for r in recs]
    infos = [ParamInfo(r.name, r.role, r.layer) for r in recs]
    out = PostNoisePipeline([d]).run([r.tensor for r in recs], infos, sigma=recs[0].sigma)
    return [not torch.equal(o, b) for o, b in zip(out, before, strict=True)]


def test_the_pipeline_hands_it_the_roles_it_selects_and_it_acts_on_what_it_is_handed() -> None:
    def recs() -> list[NoisyGradient]:
        return [rec("emb.weight", "embedding", spiked_matrix(50, 16, 0.1, 1)), rec("b", "bias", torch.randn(8))]

    assert through_pipeline(RMTDenoiser(), recs()) == [False, False]  # the embedding role is not a default one
    assert through_pipeline(RMTDenoiser(roles=("embedding",)), recs()) == [True, False]  # opted in
    assert run(RMTDenoiser(), recs())[1] == [True, False]  # handed directly: the denoiser does not select again


def test_roles_and_params_filters() -> None:
    s = 0.1
    recs = [
        rec("enc.q.lora_A", "lora_A", spiked_matrix(4, 64, s, 1)),
        rec("enc.q.lora_B", "lora_B", spiked_matrix(64, 4, s, 2)),
        rec("enc.dense.weight", "weight", spiked_matrix(64, 64, s, 3)),
        rec("head.weight", "weight", spiked_matrix(2, 64, s, 4)),
    ]

    def copies() -> list[NoisyGradient]:
        return [rec(r.name, r.role, r.tensor.clone()) for r in recs]

    assert through_pipeline(RMTDenoiser(roles=("lora_A", "lora_B")), copies()) == [True, True, False, False]
    assert through_pipeline(RMTDenoiser(params=["dense", "lora_B"]), copies()) == [False, True, True, False]
    by_pred = RMTDenoiser(params=lambda name: name.startswith("head"), inplace=False)
    assert through_pipeline(by_pred, copies()) == [False, False, False, True]


def test_sigma_comes_from_record_only() -> None:
    with pytest.raises(TypeError):
        RMTDenoiser(sigma=0.1)  # type: ignore[call-arg]
    t = spiked_matrix(40, 60, 0.1, 7)
    d = RMTDenoiser()
    assert run(d, [rec("w", "weight", t.clone(), sigma=0.0)])[1] == [False]  # no noise → unchanged
    assert run(d, [rec("w", "weight", t.clone(), sigma=1.0)])[1] == [False]  # claimed noise 10×: inside the bulk
    assert int(d.stats["gated"]) == 0
    got = run(d, [rec("w", "weight", t.clone(), sigma=0.1)])[0][0]
    assert torch.equal(got, expected(t, 0.1))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sigma"):
            d([rec("w", "weight", t, sigma=bad)])


def test_groups_by_shape_and_dtype_one_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = rmt_mod.rmt_denoise

    def spy(g: torch.Tensor, sigma: torch.Tensor, **kw: object) -> DenoiseResult:
        calls.append((tuple(g.shape), g.dtype))
        return real(g, sigma, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rmt_mod, "rmt_denoise", spy)
    s = 0.1
    recs = [rec(f"l{i}.lora_A", "lora_A", spiked_matrix(4, 64, s, i)) for i in range(5)]
    recs += [rec(f"l{i}.lora_B", "lora_B", spiked_matrix(64, 4, s, 10 + i)) for i in range(3)]
    recs += [rec("half.lora_A", "lora_A", spiked_matrix(4, 64, s, 20).half())]
    out = RMTDenoiser(inplace=False)(recs)
    assert sorted(calls, key=str) == sorted(
        [((5, 4, 64), torch.float32), ((3, 64, 4), torch.float32), ((1, 4, 64), torch.float16)], key=str
    )
    for r, o in zip(recs, out, strict=True):  # batched == one at a time
        assert o is not None and torch.equal(o, expected(r.tensor, s))
    calls.clear()
    chunked = RMTDenoiser(max_batch=2, inplace=False)(recs)
    assert len(calls) == 3 + 2 + 1
    assert all(torch.equal(a, b) for a, b in zip(out, chunked, strict=True))  # type: ignore[arg-type]


def test_per_record_sigma_within_a_group() -> None:
    t1, t2 = spiked_matrix(30, 50, 0.1, 1), spiked_matrix(30, 50, 0.1, 2)
    out, changed = run(
        RMTDenoiser(), [rec("a", "weight", t1.clone(), sigma=0.1), rec("b", "weight", t2.clone(), sigma=10.0)]
    )
    assert changed == [True, False]
    assert torch.equal(out[0], expected(t1, 0.1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtype_preserved(dtype: torch.dtype) -> None:
    t = spiked_matrix(8, 200, 0.05, 3).to(dtype)
    (out,), changed = run(RMTDenoiser(), [rec("q.lora_A", "lora_A", t.clone(), sigma=0.05)])
    assert out.dtype == dtype and changed == [True]
    clean_dir = expected(t.float(), 0.05)
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), clean_dir.flatten(), dim=0) > 0.999


def test_nonfinite_counted_and_untouched() -> None:
    t = spiked_matrix(30, 50, 0.1, 1)
    bad = t.clone()
    bad[2, 3] = float("nan")
    d = RMTDenoiser()
    _, changed = run(d, [rec("good", "weight", t), rec("bad", "weight", bad)])
    assert int(d.stats["nonfinite"]) == 1 and int(d.stats["gated"]) == 1
    assert changed == [True, False]


def test_tracy_widom_gate_option() -> None:
    s = 0.1
    t = spiked_matrix(8, 300, s, 5)
    d = RMTDenoiser(gate="tracy_widom", false_alarm=1e-3)
    ref = rmt_denoise(t, s, gate="tracy_widom", false_alarm=1e-3, norm_correction="noisy").tensor
    (out,), _ = run(d, [rec("q.lora_A", "lora_A", t, sigma=s)])
    assert torch.equal(out, ref) and int(d.stats["gated"]) == 1
    with pytest.raises(ValueError):
        RMTDenoiser(gate="tw")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RMTDenoiser(gate="tracy_widom", false_alarm=0.9)
    with pytest.raises(ValueError):
        RMTDenoiser(kappa=-1.0)
    with pytest.raises(ValueError):
        RMTDenoiser(compute_dtype=torch.float16)


def test_norm_correction_switch_and_float64() -> None:
    t = spiked_matrix(20, 300, 0.1, 6)
    on = run(RMTDenoiser(), [rec("w", "weight", t.clone())])[0][0]
    off = run(RMTDenoiser(norm_correction=False), [rec("w", "weight", t.clone())])[0][0]
    assert math.isclose(on.norm().item(), t.norm().item(), rel_tol=1e-5)
    assert off.norm().item() < 0.9 * t.norm().item()
    f64 = run(RMTDenoiser(compute_dtype="float64"), [rec("w", "weight", t.clone())])[0][0]
    assert f64.dtype == torch.float32
    torch.testing.assert_close(f64, on, rtol=1e-4, atol=1e-6)


def test_per_matrix_stats_entropy_and_norms() -> None:
    s = 0.1
    t = spiked_matrix(40, 64, s, 8)
    noise = (0.1 * torch.randn(40, 64, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    d = RMTDenoiser(per_matrix_stats=True)
    d([rec("sig", "weight", t.clone()), rec("noise", "weight", noise)])
    pm = d.stats["per_matrix"]
    assert bool(pm["sig"]["gated"]) and not bool(pm["noise"]["gated"])
    assert float(pm["sig"]["entropy_after"]) < 0.1 < float(pm["sig"]["entropy_before"])  # rank-1 after
    assert float(pm["noise"]["entropy_after"]) == pytest.approx(float(pm["noise"]["entropy_before"]))
    assert float(pm["sig"]["norm_after"]) == pytest.approx(float(pm["sig"]["norm_before"]), rel=1e-5)
    assert "per_matrix" not in RMTDenoiser().stats


def test_deterministic_and_truncated_path() -> None:
    recs = [rec(f"w{i}", "weight", spiked_matrix(96, 128, 0.05, i, rank=2)) for i in range(3)]
    d = RMTDenoiser(gram_max=32, inplace=False)  # 96-wide → the gate-first truncated path
    a, b = d(recs), d(recs)
    assert all(x is not None and torch.equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    full = RMTDenoiser(method="full", inplace=False)(recs)
    for x, y in zip(a, full, strict=True):
        assert x is not None and y is not None
        assert ((x - y).norm() / y.norm()).item() < 1e-4
    pure = [
        rec(
            "n",
            "weight",
            (0.05 * torch.randn(96, 128, generator=torch.Generator().manual_seed(3))).to(DEVICE),
            sigma=0.05,
        )
    ]
    assert d(pure) == [None]  # gate-first: nothing decomposed, nothing returned
    ref = pure[0].tensor.clone()
    assert RMTDenoiser(gram_max=32)(pure) is None and torch.equal(pure[0].tensor, ref)  # and nothing written


@pytest.mark.parametrize(
    "kwargs", [{}, {"gate": "tracy_widom", "false_alarm": 0.01}, {"method": "truncated", "per_matrix_stats": True}]
)
def test_rmt_conformance_kit(kwargs: dict[str, object]) -> None:
    from opacus_spectral.plugins.testing import check_denoiser

    check_denoiser(lambda: RMTDenoiser(**kwargs), device=DEVICE, steps=2)  # type: ignore[arg-type]


def test_lone_matrix_is_denoised_in_its_own_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of one matrix is passed as a view of the gradient (no stacked copy) and written in place."""
    seen: list[int] = []
    real = rmt_mod.rmt_denoise

    def spy(g: torch.Tensor, sigma: float, **kw: object) -> DenoiseResult:
        seen.append(g.data_ptr())
        return real(g, sigma, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rmt_mod, "rmt_denoise", spy)
    t = spiked_matrix(96, 160, 0.05, 3, rank=2)
    ref = expected(t, 0.05)
    r = rec("w", "weight", t.clone(), sigma=0.05)
    ptr = r.tensor.data_ptr()
    assert RMTDenoiser()([r]) is None
    assert seen == [ptr] and r.tensor.data_ptr() == ptr
    torch.testing.assert_close(r.tensor, ref, rtol=1e-5, atol=1e-6)


def test_chunks_are_bounded_by_max_extra_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 matrices of 256 KiB: chunks of at most max(0.5·total/3, 1 MiB) = 1 MiB (4 matrices); None: one call."""
    sizes: list[int] = []
    real = rmt_mod.rmt_denoise

    def spy(g: torch.Tensor, sigma: float, **kw: object) -> DenoiseResult:
        sizes.append(g.shape[0])
        return real(g, sigma, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rmt_mod, "rmt_denoise", spy)
    noise = torch.randn(20, 256, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    recs = [rec(f"w{i}", "weight", noise[i].clone(), sigma=1.0) for i in range(20)]
    RMTDenoiser()(recs)
    assert sizes == [4] * 5
    sizes.clear()
    RMTDenoiser(max_extra_memory=None)(recs)
    assert sizes == [20]
    with pytest.raises(ValueError, match="max_extra_memory"):
        RMTDenoiser(max_extra_memory=0)
