"""Sigma calibration: the per-entry std of the DP noise in the final ``p.grad``.

Read from the optimizer's state at every step, never from user arguments. The cases follow how Opacus 1.6
really applies noise (``docs/upstream.md`` §1.2):

================================  ===============================================
optimizer                          std of the noise in ``p.grad``
================================  ===============================================
flat, ``loss_reduction="mean"``    nm·C / (B·k)
any, ``loss_reduction="sum"``      nm·C
per-layer clipping                 nm·‖(C_1..C_L)‖₂ / (B·k)  (``max_grad_norm`` holds the norm)
distributed (DDP), mean            nm·C / (B·k·W)   (B is per worker; only rank 0 adds noise)
ghost clipping                     nm·C / B          (k is always 1)
AdaClip                            nm_eff·C_t / (B·k), nm_eff = (nm⁻² − (2·σ_u)⁻²)^(−1/2)
================================  ===============================================

nm = ``noise_multiplier``, C = ``max_grad_norm``, B = ``expected_batch_size``, k =
``accumulated_iterations``, W = world size, σ_u = ``unclipped_num_std``. Under a correlated noise mechanism
(``noise_mechanism="bandmf"``) each case is multiplied by the step's ‖row_t(M⁻¹)‖ (``docs/mechanisms.md``).
"""

from __future__ import annotations

import math

from opacus.optimizers import (
    AdaClipDPOptimizer,
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizer,
)
from opacus.optimizers.ddp_perlayeroptimizer import DistributedPerLayerOptimizer

# SimpleDistributedPerLayerOptimizer derives from DistributedDPOptimizer.
_DISTRIBUTED = (DistributedDPOptimizer, DistributedPerLayerOptimizer, DistributedDPOptimizerFastGradientClipping)


def effective_noise_multiplier(optimizer: DPOptimizer) -> float:
    """The multiplier Opacus actually draws gradient noise with.

    Equal to ``noise_multiplier`` except for AdaClip, which reserves part of the budget for the noisy
    unclipped count (Andrew et al. 2021, Thm. 1): nm_eff = (nm⁻² − (2σ_u)⁻²)^(−1/2).
    """
    nm = float(optimizer.noise_multiplier)
    if isinstance(optimizer, AdaClipDPOptimizer) and nm > 0:
        return (nm**-2 - (2.0 * float(optimizer.unclipped_num_std)) ** -2) ** -0.5
    return nm


def world_size(optimizer: DPOptimizer) -> int:
    """Number of ranks whose noisy gradients are averaged (1 for non-distributed optimizers)."""
    if isinstance(optimizer, _DISTRIBUTED):
        return int(getattr(optimizer, "world_size", 1))
    return 1


def noise_std(optimizer: DPOptimizer) -> float:
    """Per-entry standard deviation of the noise in the final ``p.grad`` after this step's scaling.

    Valid between Opacus' ``add_noise``/``scale_grad`` and the next ``zero_grad`` (``accumulated_iterations``
    is read from the per-sample gradients still attached then). The engine snapshots it in the step hook,
    which for AdaClip runs before the clipping bound C_t is updated.
    """
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(f"noise_std expects an Opacus DPOptimizer, got {type(optimizer).__name__}")
    std = effective_noise_multiplier(optimizer) * float(optimizer.max_grad_norm)
    if optimizer.loss_reduction == "mean":
        denom = float(optimizer.expected_batch_size) * float(optimizer.accumulated_iterations)
        denom *= world_size(optimizer)
        std /= denom
    elif optimizer.loss_reduction != "sum":  # pragma: no cover - Opacus validates this itself
        raise ValueError(f"unknown loss_reduction {optimizer.loss_reduction!r}")
    # a correlated noise mechanism releases σC·‖row_t(M⁻¹)‖ at step t (docs/mechanisms.md): its factor of the step
    std *= float(getattr(optimizer, "_opacus_spectral_std_factor", 1.0))
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"noise std is not a finite non-negative number: {std}")
    return std


def clean_scale(optimizer: DPOptimizer) -> float:
    """Factor that turns ``p.summed_grad`` (the clean clipped sum) into the noise-free counterpart of ``p.grad``.

    Used only by oracle diagnostics (benchmarks); 1/(B·k) for mean reduction, 1 for sum.
    """
    if optimizer.loss_reduction == "mean":
        return 1.0 / (float(optimizer.expected_batch_size) * float(optimizer.accumulated_iterations))
    return 1.0
