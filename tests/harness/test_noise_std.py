"""noise_std is measured, not assumed: with a zero clipped sum, p.grad is pure noise whose empirical std must
match both noise_std(optimizer) (what denoisers receive as sigma) and the closed form of each Opacus case."""

from __future__ import annotations

import math

import pytest
import torch
from dp_bench.commands.noise_std import NM, B, C, one_step, pooled_std
from engine_helpers import mlp

from opacus_spectral import noise_std


@pytest.mark.parametrize(
    ("case", "kwargs", "expected"),
    [
        ("flat-mean", {}, NM * C / B),
        ("flat-sum", {"loss_reduction": "sum"}, NM * C),
        ("accumulate-k2", {"accumulate": 2}, NM * C / (2 * B)),
        (
            "per-layer",
            {"clipping": "per_layer", "max_grad_norm": [1.0, 2.0, 0.5, 1.5]},
            NM * math.sqrt(1 + 4 + 0.25 + 2.25) / B,
        ),
        ("ghost", {"mode": "ghost"}, NM * C / B),
        ("functorch", {"mode": "functorch"}, NM * C / B),
        (
            "adaclip",
            {
                "clipping": "adaptive",
                "target_unclipped_quantile": 0.5,
                "clipbound_learning_rate": 0.2,
                "max_clipbound": 10.0,
                "min_clipbound": 0.01,
                "unclipped_num_std": 2.0,
            },
            (NM**-2 - (2 * 2.0) ** -2) ** -0.5 * C / B,
        ),
    ],
)
def test_measured_noise_std_matches(case, kwargs, expected):
    torch.manual_seed(1)
    cap, dp_opt, sigma_before_step = one_step(**kwargs)
    assert len(cap.steps) == 1
    records = cap.steps[0]
    sigmas = {r.sigma for r in records}
    assert len(sigmas) == 1
    sigma = sigmas.pop()
    # Opacus computes the per-layer norm ‖C‖ in float32
    assert sigma == pytest.approx(expected, rel=1e-6), f"{case}: calibrated sigma"
    if case != "adaclip":  # AdaClip updates C after the step; the engine snapshots it before
        assert sigma_before_step == pytest.approx(expected, rel=1e-6)
    measured = pooled_std(records)
    assert measured == pytest.approx(expected, rel=0.03), f"{case}: measured {measured} vs {expected}"


def test_adaclip_sigma_uses_bound_before_update():
    torch.manual_seed(2)
    cap, dp_opt, _ = one_step(
        clipping="adaptive",
        target_unclipped_quantile=0.9,
        clipbound_learning_rate=0.5,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=2.0,
    )
    assert float(dp_opt.max_grad_norm) != pytest.approx(C)  # the bound moved after the step
    assert cap.steps[0][0].sigma == pytest.approx((NM**-2 - 4.0**-2) ** -0.5 * C / B, rel=1e-9)


def test_noise_std_rejects_plain_optimizer():
    with pytest.raises(TypeError, match="DPOptimizer"):
        noise_std(torch.optim.SGD(mlp().parameters(), lr=0.1))
