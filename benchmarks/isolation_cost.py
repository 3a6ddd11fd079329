"""Cost of giving every ``p.grad`` fresh memory after the denoisers (the clean-gradient isolation).

With at least one denoiser installed, the engine copies the step's (denoised) gradients into fresh memory
(:func:`opacus_spectral.installation.install_fresh_grads`) so that no tensor a denoiser saw is ever written by
a later backward. Measured in one run, on all-MiniLM-L6-v2 with the shapes of ``benchmarks/overhead.py``
(DP-LoRA r = 16, and DP full fine-tuning of every Linear), one thread: the median time of that copy over
the real gradients of a DP step, and the median time of the DP step itself (batch 32 × 64, hooks mode).

    OMP_NUM_THREADS=1 python benchmarks/isolation_cost.py --out docs/results/isolation_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from overhead import prepare
from torch import nn

from opacus_spectral import PrivacyEngine
from opacus_spectral.installation import install_fresh_grads


def measure(case: str, steps: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, _ = prepare(case, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    data = torch.utils.data.TensorDataset(torch.randint(0, 30522, (32 * (steps + 1), 64)), torch.randint(0, 2, (32 * (steps + 1),)))
    opt = torch.optim.SGD(params, lr=1e-3)
    gsm, dp_opt, dl = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, batch_size=32),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, post_hooks=[],
    )  # fmt: skip
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="docs/results/isolation_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {
        "command": f"OMP_NUM_THREADS=1 python benchmarks/isolation_cost.py --steps {args.steps} --reps {args.reps}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": {case: measure(case, args.steps, args.reps) for case in ("lora", "full")},
    }
    for case, r in res["cases"].items():
        print(f"{case}: {r['trainable_params']:,} trainable, copy {r['copy_s_median'] * 1e3:.2f} ms, "
              f"DP step {r['step_s_median']:.2f} s -> {100 * r['copy_over_step']:.3f} % of a step")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
