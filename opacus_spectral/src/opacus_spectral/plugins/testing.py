"""Conformance kit for denoiser authors: one call a plugin's own tests run to check the contract.

    from opacus_spectral.plugins.testing import check_denoiser

    def test_conformance():
        check_denoiser(lambda: MyDenoiser(), stateful=False)

It raises ``AssertionError`` naming the first broken rule. What it checks (see ``docs/plugins.md``):

1. float32, float16 and bfloat16 gradients come back with the same shape, dtype and device, and finite, through
   the engine's own validator (:class:`~opacus_spectral.step.pipeline.PostNoisePipeline` with ``on_error="raise"``);
   1-D, empty and ≥3-D tensors are accepted.
2. ``sigma = 0`` leaves every gradient bit-identical (opt out with ``sigma_zero_identity=False`` and document why).
3. Determinism: two fresh instances fed the same sequence give bit-identical outputs (needed for DDP ranks).
4. Records only: record metadata is not modified, and the denoiser keeps no reference to the records or their
   tensors after the call (a stateful denoiser copies what it needs).
5. No retained storage: after every call the memory the denoiser was handed is overwritten (as the next
   ``backward()`` does when ``zero_grad(set_to_none=False)`` keeps ``p.grad``'s memory: it writes the next
   batch's *clean* gradient there, ``docs/upstream.md`` §1.5); the outputs of later steps must not change. This
   catches a denoiser that keeps ``record.tensor.detach()`` (a new tensor object sharing the memory) instead of
   ``.clone()``.
6. Stateful denoisers (``stateful=True``): ``state_dict()`` survives ``torch.save``/``torch.load``, and a fresh
   instance loaded mid-sequence continues with exactly the outputs of an uninterrupted run; ``reset()`` returns
   to the initial behaviour.
7. Honest noise declarations: fed pure Gaussian noise of std ``sigma`` for ``steps`` steps, the outputs of the
   records for which ``output_noise`` declares a gain ``g`` have a measured std within 10 % of ``g × sigma`` at
   every step (a spectral denoiser after this one trusts that number; ``docs/plugins.md``).
"""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..step.parameters import ParamInfo
from ..step.pipeline import PostNoisePipeline
from ..step.records import ROLE_BIAS, ROLE_LORA_A, ROLE_LORA_B, ROLE_WEIGHT, NoisyGradient

#: (name, role, shape) of the gradients the kit feeds: LoRA factors, a Linear weight, a conv kernel, a bias,
#: two same-shape matrices (batching) and an empty tensor.
DEFAULT_LAYOUT: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("layer0.lora_A.weight", ROLE_LORA_A, (4, 48)),
    ("layer0.lora_B.weight", ROLE_LORA_B, (40, 4)),
    ("layer1.lora_A.weight", ROLE_LORA_A, (4, 48)),
    ("layer1.lora_B.weight", ROLE_LORA_B, (40, 4)),
    ("dense.weight", ROLE_WEIGHT, (40, 48)),
    ("conv.weight", ROLE_WEIGHT, (8, 3, 3, 3)),
    ("dense.bias", ROLE_BIAS, (40,)),
    ("empty.weight", ROLE_WEIGHT, (0, 5)),
)


def make_gradients(
    step: int,
    *,
    sigma: float,
    layout: Sequence[tuple[str, str, tuple[int, ...]]] = DEFAULT_LAYOUT,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.Tensor]:
    """Deterministic noisy gradients: a rank-2 signal plus ``sigma``-scaled Gaussian noise, per layout entry."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for _, _, shape in layout:
        if len(shape) >= 2 and all(shape):
            m, n = shape[0], int(torch.tensor(shape[1:]).prod())
            u, v = torch.randn(m, 2, generator=g), torch.randn(2, n, generator=g)
            signal = (u @ v).reshape(shape) * (5.0 * max(sigma, 1e-3))
        else:
            signal = torch.randn(shape, generator=g) * max(sigma, 1e-3)
        out.append((signal + sigma * torch.randn(shape, generator=g)).to(dtype=dtype, device=device))
    return out


def _infos(layout: Sequence[tuple[str, str, tuple[int, ...]]]) -> list[ParamInfo]:
    return [ParamInfo(name, role, name.rsplit(".", 2)[0]) for name, role, _ in layout]


def _run(
    pipe: PostNoisePipeline, grads: list[torch.Tensor], infos: list[ParamInfo], sigma: float
) -> list[torch.Tensor]:
    return [t.clone() for t in pipe.run([g.clone() for g in grads], infos, sigma)]


def _equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _outputs_of(records: Sequence[NoisyGradient], result: Any) -> list[torch.Tensor]:
    if result is None:
        return [r.tensor.clone() for r in records]
    return [(r.tensor if o is None else o).detach().clone() for r, o in zip(records, result, strict=True)]


def _check_no_retained_storage(
    factory: Callable[[], Any],
    name: str,
    infos: Sequence[ParamInfo],
    layout: Sequence[tuple[str, str, tuple[int, ...]]],
    sigma: float,
    steps: int,
    device: str | torch.device,
) -> None:
    runs: list[list[list[torch.Tensor]]] = []
    for scribble in (False, True):
        d = factory()
        gen = torch.Generator().manual_seed(1234)
        seq = []
        for step in range(steps):
            grads = make_gradients(step, sigma=sigma, layout=layout, device=device)
            records = [
                NoisyGradient(i.name, i.role, g, sigma, step, i.layer) for i, g in zip(infos, grads, strict=True)
            ]
            seq.append(_outputs_of(records, d(records)))
            if scribble:  # what a later backward does to p.grad's memory
                for g in grads:
                    g.copy_((100.0 * torch.randn(g.shape, generator=gen)).to(dtype=g.dtype, device=g.device))
        runs.append(seq)
    for step in range(steps):
        assert _equal(runs[0][step], runs[1][step]), (
            f"{name}: keeps the storage of its input gradients (step {step} changed when the memory handed in at an "
            "earlier step was overwritten, as the next backward does): copy what you keep with .clone(), not "
            ".detach() or a view"
        )


def _check_resume(
    factory: Callable[[], Any],
    name: str,
    infos: Sequence[ParamInfo],
    layout: Sequence[tuple[str, str, tuple[int, ...]]],
    sigma: float,
    steps: int,
    device: str | torch.device,
) -> None:
    """A state saved after ``steps`` steps and loaded into a fresh instance continues as the uninterrupted run;
    ``reset()`` restores the start."""
    full = PostNoisePipeline([factory()])
    first = PostNoisePipeline([factory()])
    seq = [make_gradients(s, sigma=sigma, layout=layout, device=device) for s in range(2 * steps)]
    ref_out = [_run(full, g, infos, sigma) for g in seq]
    for g in seq[:steps]:
        _run(first, g, infos, sigma)
    buf = io.BytesIO()
    torch.save(first.denoisers[0].state_dict(), buf)
    buf.seek(0)
    resumed = PostNoisePipeline([factory()])
    resumed.denoisers[0].load_state_dict(torch.load(buf, weights_only=False))
    for s in range(steps, 2 * steps):
        assert _equal(_run(resumed, seq[s], infos, sigma), ref_out[s]), f"{name}: resume differs at step {s}"
    full.denoisers[0].reset()
    assert _equal(_run(full, seq[0], infos, sigma), ref_out[0]), f"{name}: reset() did not restore the start"


def check_denoiser(
    factory: Callable[[], Any],
    *,
    stateful: bool = False,
    device: str | torch.device = "cpu",
    sigma: float = 0.05,
    steps: int = 4,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    sigma_zero_identity: bool = True,
    layout: Sequence[tuple[str, str, tuple[int, ...]]] = DEFAULT_LAYOUT,
) -> None:
    """Check that ``factory()`` builds a denoiser honouring the opacus-spectral contract (module docstring)."""
    infos = _infos(layout)
    name = type(factory()).__name__

    # 1. dtypes, shapes, devices, finiteness — through the engine's validator
    for dtype in dtypes:
        pipe = PostNoisePipeline([factory()], on_error="raise")
        for step in range(steps):
            grads = make_gradients(step, sigma=sigma, layout=layout, dtype=dtype, device=device)
            out = _run(pipe, grads, infos, sigma)
            for (pname, _, shape), o in zip(layout, out, strict=True):
                assert o.dtype == dtype and tuple(o.shape) == shape, f"{name}: {pname} {dtype} changed"
                assert o.device == torch.device(device) or o.device.type == torch.device(device).type
                assert bool(torch.isfinite(o).all()), f"{name}: {pname} became non-finite ({dtype})"

    # 2. sigma = 0
    if sigma_zero_identity:
        pipe = PostNoisePipeline([factory()])
        for step in range(2):
            grads = make_gradients(step, sigma=0.0, layout=layout, device=device)
            assert _equal(_run(pipe, grads, infos, 0.0), grads), f"{name}: sigma=0 changed a gradient"

    # 3. determinism across fresh instances
    seqs = []
    for _ in range(2):
        pipe = PostNoisePipeline([factory()])
        seqs.append(
            [
                _run(pipe, make_gradients(s, sigma=sigma, layout=layout, device=device), infos, sigma)
                for s in range(steps)
            ]
        )
    for s in range(steps):
        assert _equal(seqs[0][s], seqs[1][s]), f"{name}: not deterministic at step {s}"

    # 4. records only: metadata untouched, no reference kept
    d = factory()
    grads = make_gradients(0, sigma=sigma, layout=layout, device=device)
    records = [NoisyGradient(i.name, i.role, g, sigma, 0, i.layer) for i, g in zip(infos, grads, strict=True)]
    meta = [(r.name, r.role, r.sigma, r.step, r.layer) for r in records]
    result = d(records)
    assert meta == [(r.name, r.role, r.sigma, r.step, r.layer) for r in records], f"{name}: changed record metadata"
    refs = [weakref.ref(g) for g in grads]  # a kept record keeps its tensor alive too
    del records, grads, result
    gc.collect()
    assert all(ref() is None for ref in refs), f"{name}: keeps references to the records or their tensors"

    # 5. no retained storage: scribbling on the memory handed in must not change later outputs
    _check_no_retained_storage(factory, name, infos, layout, sigma, steps, device)

    # 6. state_dict round trip
    if stateful:
        _check_resume(factory, name, infos, layout, sigma, steps, device)

    # 7. a declared output-noise gain is the measured one
    _check_declared_noise(factory, name, infos, layout, sigma, steps, device)


def _check_declared_noise(
    factory: Callable[[], Any],
    name: str,
    infos: Sequence[ParamInfo],
    layout: Sequence[tuple[str, str, tuple[int, ...]]],
    sigma: float,
    steps: int,
    device: str | torch.device,
) -> None:
    d = factory()
    declare = getattr(d, "output_noise", None)
    if declare is None:
        return
    gen = torch.Generator().manual_seed(4321)
    for step in range(steps):
        grads = [(sigma * torch.randn(shape, generator=gen)).to(device=device) for _, _, shape in layout]
        records = [NoisyGradient(i.name, i.role, g, sigma, step, i.layer) for i, g in zip(infos, grads, strict=True)]
        outs = _outputs_of(records, d(records))
        gains = declare(records)
        gains = [gains] * len(records) if isinstance(gains, (str, int, float)) else list(gains)
        z = [
            o.double().reshape(-1) / (float(g) * sigma)
            for o, g in zip(outs, gains, strict=True)
            if isinstance(g, (int, float)) and not isinstance(g, bool) and g > 0 and o.numel()
        ]
        if not z:
            continue
        pooled = torch.cat(z)
        if pooled.numel() < 1000:
            continue  # too few entries for a 10 % test
        measured = float(pooled.pow(2).mean().sqrt())
        assert abs(measured - 1.0) <= 0.1, (
            f"{name}: output_noise declares gain(s) {sorted({float(g) for g in gains if isinstance(g, (int, float))})}"
            f" at step {step}, but the measured output std on pure noise is {measured:.3f} × the declared one"
        )
