"""Measure the per-entry noise std in p.grad for each Opacus case and compare with noise_std().

Zero clipped sum (loss × 0) so p.grad is pure noise; 18,688 entries per case; DDP is measured by
tests/test_ddp.py. Run: python benchmarks/noise_std_table.py  (prints a markdown table, ~10 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from engine_helpers import pooled_std  # noqa: E402
from test_noise_std import _one_step  # noqa: E402

CASES = {
    "flat, mean": {},
    "flat, sum": {"loss_reduction": "sum"},
    "accumulation k=2": {"accumulate": 2},
    "per-layer C=(1,2,0.5,1.5)": {"clipping": "per_layer", "max_grad_norm": [1.0, 2.0, 0.5, 1.5]},
    "ghost": {"mode": "ghost"},
    "functorch": {"mode": "functorch"},
    "AdaClip sigma_u=2": {
        "clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.2,
        "max_clipbound": 10.0, "min_clipbound": 0.01, "unclipped_num_std": 2.0,
    },
}

if __name__ == "__main__":
    print("| case | noise_std() | measured std | measured/noise_std |\n|---|---|---|---|")
    for name, kw in CASES.items():
        torch.manual_seed(1)
        rec, _, _ = _one_step(**kw)
        sigma = rec.seen[0][0]["sigma"]
        measured = pooled_std(rec.seen[0])
        print(f"| {name} | {sigma:.6g} | {measured:.6g} | {measured / sigma:.4f} |")
