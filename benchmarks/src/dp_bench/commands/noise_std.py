"""Measure the per-entry noise std in ``p.grad`` for each Opacus case and compare it with ``noise_std()``.

A zero clipped sum (loss × 0) leaves ``p.grad`` pure noise; 18,688 entries per case (an MLP 16 → 128 → 128,
nm = 1.3, C = 0.7, B = 16). DDP is measured by ``tests/opacus_spectral/test_ddp.py``. Prints a markdown table (~10 s)::

    dp-bench noise-std
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from opacus_spectral.errors import ReproducibleNoiseWarning
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, PrivacyEngine, noise_std

from ..config import opt, parse_config

NM, C, B, N = 1.3, 0.7, 16, 64

CASES: dict[str, dict[str, Any]] = {
    "flat, mean": {},
    "flat, sum": {"loss_reduction": "sum"},
    "accumulation k=2": {"accumulate": 2},
    "per-layer C=(1,2,0.5,1.5)": {"clipping": "per_layer", "max_grad_norm": [1.0, 2.0, 0.5, 1.5]},
    "ghost": {"mode": "ghost"},
    "functorch": {"mode": "functorch"},
    "AdaClip sigma_u=2": {
        "clipping": "adaptive",
        "target_unclipped_quantile": 0.5,
        "clipbound_learning_rate": 0.2,
        "max_clipbound": 10.0,
        "min_clipbound": 0.01,
        "unclipped_num_std": 2.0,
    },
}


class Capture(Denoiser):
    """Keeps a copy of every step's records (σ and the noisy tensors)."""

    name = "capture"

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[NoisyGradient]] = []

    def output_noise(self, grads: Sequence[NoisyGradient]) -> float:
        return 1.0  # a pass-through

    def __call__(self, grads: Sequence[NoisyGradient]) -> None:
        self.steps.append([NoisyGradient(g.name, g.role, g.tensor.clone(), g.sigma, g.step, g.layer) for g in grads])


def pooled_std(records: Sequence[NoisyGradient]) -> float:
    return float(torch.cat([r.tensor.flatten().double() for r in records]).std())


def one_step(
    *,
    clipping: str = "flat",
    loss_reduction: str = "mean",
    mode: str = "hooks",
    accumulate: int = 1,
    noise_seed: int | None = None,
    **mp_kwargs: Any,
) -> tuple[Capture, Any, float]:
    """One DP step with a zero clipped sum: ``(capture, dp_optimizer, noise_std before the step)``. ``noise_seed``:
    the engine's reproducible noise (the same draws for every case), else OS-entropy noise."""
    model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(N, 16, generator=g), torch.randn(N, 128, generator=g))
    cap = Capture()
    with warnings.catch_warnings():  # a measurement of the noise itself: reproducible on purpose
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant="rdp", noise_seed=noise_seed)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=B),
        noise_multiplier=NM,
        max_grad_norm=mp_kwargs.pop("max_grad_norm", C),
        clipping=clipping,
        loss_reduction=loss_reduction,
        grad_sample_mode=mode,
        poisson_sampling=accumulate == 1,
        post_hooks=[cap],
        **mp_kwargs,
    )
    model, dp_opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.MSELoss(reduction=loss_reduction)
    it = iter(dl)
    for _ in range(accumulate):
        x, y = next(it)
        crit(model(x) * 0.0, torch.zeros_like(y)).backward()  # clipped sum is exactly zero: p.grad = noise
    sigma_now = noise_std(dp_opt)
    dp_opt.step()
    return cap, dp_opt, sigma_now


@dataclass
class Config:
    seed: int = opt(1, "torch seed of every case")


def main(argv: Sequence[str] | None = None) -> dict[str, tuple[float, float]]:
    cfg = parse_config(Config, argv, prog="dp-bench noise-std", description=__doc__)
    print("| case | noise_std() | measured std | measured/noise_std |\n|---|---|---|---|")
    out = {}
    for name, kw in CASES.items():
        torch.manual_seed(cfg.seed)
        cap, _, _ = one_step(noise_seed=cfg.seed, **dict(kw))
        sigma, measured = cap.steps[0][0].sigma, pooled_std(cap.steps[0])
        out[name] = (sigma, measured)
        print(f"| {name} | {sigma:.6g} | {measured:.6g} | {measured / sigma:.4f} |")
    return out
