"""Cost of giving every ``p.grad`` fresh memory after the denoisers (the clean-gradient isolation).

With at least one denoiser installed, the engine copies the step's (denoised) gradients into fresh memory
(:func:`opacus_spectral.step.installation.install_fresh_grads`) so that no tensor a denoiser saw is ever written by
a later backward. Measured in one run, on all-MiniLM-L6-v2 with the shapes of ``benchmarks/overhead.py``
(:func:`dp_bench.commands.overhead.prepare`: DP-LoRA r = 16, and DP full fine-tuning of every Linear), one thread:
the median time of that copy over the real gradients of a DP step, and the median time of the DP step itself
(batch 32 × 64, hooks mode).

    OMP_NUM_THREADS=1 dp-bench isolation-cost
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.step.installation import install_fresh_grads
from torch import nn

from opacus_spectral import PrivacyEngine

from ..config import command_line, opt, parse_config
from ..meta import RESULTS
from .overhead import prepare


@dataclass
class Config:
    steps: int = opt(3, "DP steps per case (the first warms up)")
    reps: int = opt(20, "repetitions of the copy")
    cases: str = opt("lora,full", "comma-separated: lora, full")
    batch: int = opt(32, "batch size")
    seq: int = opt(64, "tokens per example")
    out: Path = opt(RESULTS / "isolation_cost.json", "result JSON")


def measure(case: str, steps: int, reps: int, batch: int = 32, seq: int = 64) -> dict[str, float]:
    torch.manual_seed(0)
    model, _ = prepare(case, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    n = batch * (steps + 1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 30522, (n, seq)), torch.randint(0, 2, (n,)))
    opt = torch.optim.SGD(params, lr=1e-3)
    gsm, dp_opt, dl = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=opt,
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        post_hooks=[],
    )
    step_s = []
    for i, (x, y) in enumerate(dl):
        t0 = time.perf_counter()
        dp_opt.zero_grad()
        nn.functional.cross_entropy(gsm(x).logits, y).backward()
        dp_opt.step()
        if i:  # the first step warms up
            step_s.append(time.perf_counter() - t0)
    grads = [p.grad.detach().clone() for p in params]
    copy_s = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        install_fresh_grads(params, grads)
        copy_s.append(time.perf_counter() - t0)
    copy = statistics.median(copy_s[1:])
    step = statistics.median(step_s)
    return {
        "trainable_params": sum(p.numel() for p in params),
        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
        "copy_s_median": copy,
        "copy_s_min_max": [min(copy_s[1:]), max(copy_s[1:])],
        "step_s_median": step,
        "step_s_min_max": [min(step_s), max(step_s)],
        "copy_over_step": copy / step,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench isolation-cost", description=__doc__.split("\n")[0])
    torch.set_num_threads(1)
    res = {
        "command": "OMP_NUM_THREADS=1 " + command_line("isolation-cost", argv),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": cfg.batch,
        "seq": cfg.seq,
        "cases": {case: measure(case, cfg.steps, cfg.reps, cfg.batch, cfg.seq) for case in cfg.cases.split(",")},
    }
    for case, r in res["cases"].items():
        print(
            f"{case}: {r['trainable_params']:,} trainable, copy {r['copy_s_median'] * 1e3:.2f} ms, "
            f"DP step {r['step_s_median']:.2f} s -> {100 * r['copy_over_step']:.3f} % of a step"
        )
    cfg.out.write_text(json.dumps(res, indent=2))
    return res
