"""Cost of giving every ``p.grad`` fresh memory after the denoisers (the clean-gradient isolation).

With at least one denoiser installed, the engine copies the step's (denoised) gradients into fresh memory
(:func:`opacus_spectral.step.installation.install_fresh_grads`) so that no tensor a denoiser saw is ever written by
a later backward. Measured in one run, on all-MiniLM-L6-v2 with the shapes of ``dp-bench overhead``
(:func:`dp_bench.commands.overhead.prepare`: DP-LoRA r = 16, and DP full fine-tuning of every Linear), one thread:
the median time of that copy over the real gradients of a DP step, and the median time of the DP step itself
(batch 32 × 64, hooks mode), both with :func:`dp_bench.timing.timed_steps`.

    OMP_NUM_THREADS=1 dp-bench isolation-cost
    dp-bench isolation-cost --replot      # the tables of docs/results/isolation_cost.json
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.step.installation import install_fresh_grads
from torch import nn

from opacus_spectral import PrivacyEngine

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..timing import timed_steps
from .overhead import prepare


@dataclass
class Config:
    steps: int = opt(3, "DP steps per case (the first warms up)")
    reps: int = opt(20, "repetitions of the copy")
    cases: str = opt("lora,full", "comma-separated: lora, full")
    batch: int = opt(32, "batch size")
    seq: int = opt(64, "tokens per example")
    out: Path = opt(RESULTS / "isolation_cost.json", "result JSON")
    replot: bool = opt(False, "only print the tables of --out")


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
    batches = list(dl)

    def dp_step(i: int, arm: Any) -> None:
        x, y = batches[i]
        dp_opt.zero_grad()
        nn.functional.cross_entropy(gsm(x).logits, y).backward()
        dp_opt.step()

    step_s = timed_steps(dp_step, len(batches) - 1, warmup=1)[None]  # the first step warms up
    grads = [p.grad.detach().clone() for p in params]
    copy_s = timed_steps(lambda i, arm: install_fresh_grads(params, grads), reps, warmup=1)[None]
    copy = statistics.median(copy_s)
    step = statistics.median(step_s)
    return {
        "trainable_params": sum(p.numel() for p in params),
        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
        "copy_s_median": copy,
        "copy_s_min_max": [min(copy_s), max(copy_s)],
        "step_s_median": step,
        "step_s_min_max": [min(step_s), max(step_s)],
        "copy_over_step": copy / step,
    }


def tables(result: dict[str, Any]) -> str:
    """One line per case: the copy's time, the DP step's and the ratio."""
    return "".join(
        f"{case}: {r['trainable_params']:,} trainable, copy {r['copy_s_median'] * 1e3:.2f} ms, "
        f"DP step {r['step_s_median']:.2f} s -> {100 * r['copy_over_step']:.3f} % of a step\n"
        for case, r in result["cases"].items()
    )


REPORT = runner.Report(tables=tables)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench isolation-cost", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, None)
    res = {**start("isolation-cost", cfg, argv, threads=1), "torch": torch.__version__}
    res["command"] = "OMP_NUM_THREADS=1 " + res["command"]
    res.update(threads=torch.get_num_threads(), batch=cfg.batch, seq=cfg.seq)
    res["cases"] = {case: measure(case, cfg.steps, cfg.reps, cfg.batch, cfg.seq) for case in cfg.cases.split(",")}
    return runner.write(res, REPORT, cfg.out, indent=2)
