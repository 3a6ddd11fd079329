"""Overhead of ``rmt`` at LLM shapes: its share of a SmolLM2-135M DP-LoRA step (``docs/results.md`` §4).

Per case (a set of LoRA target modules), one model and one DP optimizer; logical steps of a fixed batch
(``--batch``, no Poisson sampling, so every step has the same work) split into physical batches by Opacus'
BatchMemoryManager, with and without the denoiser interleaved (ABBA order), medians with quartiles:

* ``qv``: LoRA r = 32, α = 64 on every layer's ``q_proj`` / ``v_proj`` (paper A's generation setting);
* ``all7``: LoRA r = 16, α = 32 on ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``.

The denoiser inside the step is the library default ``"rmt"``, timed directly around its call (device synced)
and, as the pipeline records it, the whole post-noise pipeline's time per step; its share is that time over
the median step without it. On the noisy gradients of the first (warm-up) step, both ``"rmt"`` and paper A's
``"rmt_paper"`` are also timed outside the step, with the peak extra memory of one call; the warm-up step gives
the whole step's memory peak (CUDA allocator; CPU: sampled RSS). Loss: ``causal_lm_loss`` (per-example). Data:
Shakespeare blocks of ``--seq`` tokens (``--model smollm2``) or random tokens (``--model tiny``: the tiny random
Llama of the tests). Noise from ``noise_seed`` (a benchmark: the timings are all that is kept). Usage::

    nice -n 5 dp-bench overhead-llm --out docs/results/overhead_llm.json
    dp-bench overhead-llm --device cuda --seq 128 --steps 4 --out docs/results/overhead_llm_gpu.json
    dp-bench overhead-llm --replot                  # the tables of docs/results/overhead_llm.json
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.denoisers.rmt import PAPER_SETTING, RMTDenoiser
from opacus_spectral.errors import ReproducibleNoiseWarning

from opacus_spectral import PrivacyEngine, causal_lm_loss

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..timing import spread, timed_steps
from .overhead import denoiser_peak_memory, peak_extra_memory
from .overhead_regimes import Switch, step_summary

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: case -> (target modules, r, alpha)
CASES: dict[str, tuple[tuple[str, ...], int, int]] = {"qv": (("q_proj", "v_proj"), 32, 64), "all7": (ALL7, 16, 32)}
TARGET_SHARE = 0.01  #: rmt <= 1 % of a SmolLM2 DP-LoRA step at B = 64


@dataclass
class Config:
    model: str = opt(
        "smollm2",
        "smollm2 (the packaged SmolLM2-135M-Instruct) or tiny (random tiny Llama)",
        choices=("smollm2", "tiny"),
    )
    cases: str = opt("qv,all7", "comma-separated: qv (q/v, r = 32), all7 (seven modules, r = 16)")
    device: str = opt("cpu", "cpu or cuda")
    batch: int = opt(64, "logical batch (fixed size, no Poisson sampling)")
    physical: int = opt(16, "physical batch (BatchMemoryManager)")
    seq: int = opt(64, "tokens per example (one Shakespeare block)")
    warmup: int = opt(1, "warm-up logical steps per case (not timed; memory peak and captured gradients)")
    steps: int = opt(4, "measured logical steps with, and as many without, the denoiser (ABBA)")
    reps: int = opt(15, "repetitions of the offline denoiser timing (per setting and thread count)")
    lr: float = opt(1e-3, "AdamW learning rate (the weights move; timings do not depend on them)")
    noise_multiplier: float = opt(1.0, "noise multiplier")
    max_grad_norm: float = opt(1.0, "clipping bound C")
    noise_seed: int = opt(0, "PrivacyEngine noise_seed (reproducible noise: a benchmark, nothing is released)")
    out: Path = opt(RESULTS / "overhead_llm.json", "result JSON")
    replot: bool = opt(False, "only print the tables of --out")

    def validate(self) -> None:
        unknown = [c for c in self.cases.split(",") if c and c not in CASES]
        if unknown:
            raise ValueError(f"unknown cases {unknown}; choose from {sorted(CASES)}")
        if self.batch < 1 or self.physical < 1 or self.physical > self.batch:
            raise ValueError(f"need 1 <= --physical <= --batch, got physical {self.physical}, batch {self.batch}")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError("--steps and --warmup must be >= 1 (the warm-up step gives the memory peak)")
        if self.seq < 2:
            raise ValueError(f"--seq must be >= 2 (a block needs a next-token target), got {self.seq}")


def load_model(name: str, n_rows: int, seq: int) -> tuple[Any, torch.Tensor, str]:
    """(causal LM in training mode, (n_rows, seq) token blocks, description of both)."""
    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        ids = torch.randint(0, 97, (n_rows, seq), generator=torch.Generator().manual_seed(0))
        return LlamaForCausalLM(cfg).train(), ids, "tiny random Llama (vocab 97, hidden 32, 2 layers), random tokens"
    from ..data.llm import load_shakespeare_blocks, load_smollm2

    model, tok = load_smollm2()
    blocks = load_shakespeare_blocks(tok, seq, works=("tempest", "othello", "lear"))["train"][:]["input_ids"]
    ids = blocks[torch.arange(n_rows) % blocks.shape[0]]
    return model.train(), ids, f"SmolLM2-135M-Instruct (packaged, fp32), Shakespeare train blocks ({len(blocks)})"


def wrap(model: Any, case: str, args: Config, ids: torch.Tensor) -> tuple[Any, Any, Any, Any, Switch]:
    """PEFT LoRA for ``case``, then ``opacus_spectral.PrivacyEngine`` with a switchable ``"rmt"``."""
    from peft import LoraConfig, get_peft_model

    targets, r, alpha = CASES[case]
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=args.batch)
    switch = Switch(RMTDenoiser(), torch.device(args.device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant="rdp", noise_seed=args.noise_seed)
    gsm, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm,
        poisson_sampling=False,
        post_hooks=[switch],
    )
    return gsm, dp_opt, loader, engine.post_hooks, switch


def lora_shapes(records: Sequence[Any]) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for r in records:
        if r.tensor.dim() == 2:
            key = "x".join(map(str, r.tensor.shape))
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def _logical_step(it: Any, per_logical: int, gsm: Any, dp_opt: Any, handle: Any, device: torch.device) -> Any:
    """One logical DP step over ``per_logical`` physical batches of ``it`` (checked: exactly one DP step)."""

    def logical_step() -> None:
        before = handle.logical_steps
        for _ in range(per_logical):
            (x,) = next(it)
            x = x.to(device)
            dp_opt.zero_grad(set_to_none=True)
            causal_lm_loss(gsm(input_ids=x).logits, x).backward()
            dp_opt.step()
        if handle.logical_steps != before + 1:
            raise RuntimeError(f"expected one logical DP step, got {handle.logical_steps - before}")

    return logical_step


def _abba_steps(
    case: str, args: Config, device: torch.device, gsm: Any, dp_opt: Any, loader: Any, handle: Any, switch: Switch
) -> tuple[dict[str, list[float]], dict[str, int], int]:
    """Warm-up with the denoiser on (the first step: memory peak, captured gradients), then the ABBA steps
    (:func:`dp_bench.timing.timed_steps`): step and pipeline times (``on`` / ``off`` / ``pipe_on`` / ``pipe_off``),
    the memory entries and the physical batches per step."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    pipe: dict[bool, list[float]] = {True: [], False: []}
    mem: dict[str, int] = {}

    def after(i: int, on: bool, seconds: float) -> None:
        pipe[on].append(handle.pipeline.last_step.seconds)
        print(f"[{case}] step {i}: {'with' if on else 'without'} rmt {seconds:.2f} s", flush=True)

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.physical, optimizer=dp_opt) as bmm:
        per_logical = -(-args.batch // args.physical)
        logical_step = _logical_step(iter(bmm), per_logical, gsm, dp_opt, handle, device)
        switch.on = switch.capture = True  # the memory peak of a whole step with rmt, and its noisy input
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss()
        mem["step_peak_extra_bytes"] = peak_extra_memory(logical_step, device)
        mem["step_peak_bytes"] = base + mem["step_peak_extra_bytes"]
        for _ in range(args.warmup - 1):  # the other warm-up steps: the denoiser's first calls too
            logical_step()

        def step(i: int, on: bool) -> None:
            switch.on = on
            logical_step()

        times = timed_steps(step, args.steps, arms=(True, False), device=device, on_start=switch.clear, after=after)
    return {"on": times[True], "off": times[False], "pipe_on": pipe[True], "pipe_off": pipe[False]}, mem, per_logical


def run_case(case: str, args: Config, device: torch.device) -> dict[str, Any]:
    """One module set: warm-up (memory, captured gradients), ABBA steps, offline timing of both settings."""
    load0 = os.getloadavg()
    n_steps = args.warmup + 2 * args.steps
    model, ids, source = load_model(args.model, n_steps * args.batch, args.seq)
    gsm, dp_opt, loader, handle, switch = wrap(model.to(device), case, args, ids)
    n_trainable = sum(p.numel() for p in gsm.parameters() if p.requires_grad)
    times, mem, per_logical = _abba_steps(case, args, device, gsm, dp_opt, loader, handle, switch)
    summary = step_summary(times["on"], times["off"], switch.seconds, switch.gated)
    records = switch.captured or []
    offline = offline_timings(records, args.reps, device, summary["step_s_without"])
    mem["denoiser_peak_extra_bytes_rmt_paper"] = denoiser_peak_memory(records, device)
    mem["denoised_grad_bytes"] = sum(r.tensor.numel() * r.tensor.element_size() for r in records if r.tensor.dim() == 2)
    mem["process_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    targets, r, alpha = CASES[case]
    out = {
        "weights_and_data": source,
        "target_modules": list(targets),
        "r": r,
        "lora_alpha": alpha,
        "trainable_params": n_trainable,
        "denoised_matrices": int(switch.inner.stats.get("matrices", 0)),
        "matrix_shapes": lora_shapes(records),
        "sigma": records[0].sigma if records else float("nan"),
        "tokens_per_step": args.batch * args.seq,
        "physical_batches_per_step": per_logical,
        **summary,
        "share_rmt_in_step": summary["overhead_ratio"],
        "pipeline_s_with": statistics.median(times["pipe_on"]),
        "pipeline_s_without": statistics.median(times["pipe_off"]),
        "pipeline_s_with_spread": spread(times["pipe_on"]),
        "pipeline_s_without_spread": spread(times["pipe_off"]),
        "offline": offline,
        "memory": mem,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
    }
    out["meets_target_share"] = out["share_rmt_in_step"] <= TARGET_SHARE
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def offline_timings(records: Sequence[Any], reps: int, device: torch.device, step_s: float) -> dict[str, Any]:
    """One call of ``"rmt"`` and ``"rmt_paper"`` on the captured noisy gradients (replacements returned, so the
    records stay the noisy input), medians with quartiles and as a share of the median step without, at the
    run's intra-op thread count and (CPU) at one thread: on a CPU shared with other work, the denoiser's many
    small operations can stall at each parallel region when the other threads are descheduled."""
    threads = [torch.get_num_threads()] + ([1] if device.type == "cpu" and torch.get_num_threads() > 1 else [])
    out: dict[str, Any] = {}
    for name, kwargs in (("rmt", {}), ("rmt_paper", PAPER_SETTING)):
        den = RMTDenoiser(inplace=False, **kwargs)
        den(records)  # warm-up
        out[name] = {"gated": int(den.stats["gated"])}
        for n in threads:
            before = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                ts = timed_steps(lambda i, arm, den=den: den(records), max(1, reps), device=device)[None]
            finally:
                torch.set_num_threads(before)
            med = statistics.median(ts)
            out[name][f"threads_{n}"] = {"seconds": med, "share_of_step_without": med / step_s, "spread": spread(ts)}
    return out


def case_line(case: str, c: dict[str, Any]) -> str:
    """One case's step times, the denoiser's share, its offline timings and the step's memory peak."""
    offline = ", ".join(
        f"{k} {name} {v['seconds'] * 1e3:.1f} ms"
        for name, o in c["offline"].items()
        for k, v in o.items()
        if k.startswith("threads")
    )
    return (
        f"[{case}] step {c['step_s_without']:.2f} s without / {c['step_s_with']:.2f} s with, rmt "
        f"{c['denoiser_s_in_step'] * 1e3:.1f} ms in step ({100 * c['share_rmt_in_step']:.3f} %), offline "
        f"{offline}, step peak {c['memory']['step_peak_bytes'] / 2**30:.2f} GiB"
    )


def tables(result: dict[str, Any]) -> str:
    """One line per case (:func:`case_line`)."""
    return "\n".join(case_line(case, c) for case, c in result["cases"].items()) + "\n"


REPORT = runner.Report(tables=tables)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_config(Config, argv, prog="dp-bench overhead-llm", description=__doc__)
    if args.replot:
        return runner.replot(args.out, REPORT, None)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        **start("overhead-llm", args, argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "cpus": os.cpu_count(),
        "target_share": TARGET_SHARE,
        "loadavg_start": os.getloadavg(),
        "cases": {},
    }
    for case in (c for c in args.cases.split(",") if c):
        t0 = time.perf_counter()
        result["cases"][case] = run_case(case, args, device)
        print(f"{case_line(case, result['cases'][case])} [{time.perf_counter() - t0:.0f} s]", flush=True)
    result["loadavg_end"] = os.getloadavg()
    runner.write(result, REPORT, args.out, indent=2)
    print("wrote", args.out)
    return result
