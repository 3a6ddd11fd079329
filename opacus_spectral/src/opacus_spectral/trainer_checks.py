"""What ``DPTrainer`` refuses when it is built (``docs/trainer.md``, "What cannot work, and is refused"): settings
under which the clipped, noised sum would not be what the accountant assumes, or that would release a statistic of
the private data without noise."""

from __future__ import annotations

import math
from typing import Any

from .trainer_distributed import EVALUATION, unsupported_parallelism

__all__ = ["MODES", "check_supported"]

MODES = ("hooks", "functorch", "ghost")


def check_supported(t: Any) -> None:
    """Raise ``ValueError`` naming the setting of the DPTrainer ``t`` that cannot work, and what to do instead."""
    a = t.args
    if t.grad_sample_mode not in MODES:
        raise ValueError(f"grad_sample_mode must be one of {MODES}, got {t.grad_sample_mode!r}")
    if t.target_delta is None or not 0 < t.target_delta < 1:
        raise ValueError(f"target_delta in (0, 1) is required (the δ of the guarantee), got {t.target_delta}")
    if t.target_epsilon is None and t.noise_multiplier is None:
        raise ValueError("give target_epsilon (σ is calibrated from it) or noise_multiplier")
    if t.target_epsilon is not None and not t.target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {t.target_epsilon}")
    if not (math.isfinite(t.max_grad_norm) and t.max_grad_norm > 0):
        raise ValueError(
            f"max_grad_norm (the per-example clipping bound C) must be finite and > 0, got {t.max_grad_norm}: "
            "the noise std is σ·C, so C sets the privacy guarantee"
        )
    taken = set(t.make_private_kwargs) & {"module", "optimizer", "data_loader", "noise_multiplier", "wrap_model",
                                          "max_grad_norm", "poisson_sampling", "grad_sample_mode", "criterion",
                                          "post_hooks", "doctor"}  # fmt: skip
    if taken:
        raise ValueError(f"make_private_kwargs may not set {sorted(taken)}: DPTrainer sets them")
    parallelism = unsupported_parallelism(t)  # plain data parallel (torchrun) runs: .trainer_distributed
    refusals = [
        (a.fp16, "fp16 mixed precision: its GradScaler scales the loss (Opacus would clip scaled per-example "
         "gradients) and skips steps with inf/NaN after the accountant counted them. Use bf16 or float32."),
        (a.torch_compile or type(t.model).__name__ == "OptimizedModule",
         "torch.compile: Opacus' per-sample hooks do not run inside a compiled graph. Train uncompiled."),
        (a.n_gpu > 1, f"{a.n_gpu} GPUs in one process (nn.DataParallel): Opacus' hooks see only one replica. "
         "Make one GPU visible (CUDA_VISIBLE_DEVICES)."),
        (parallelism is not None, parallelism),
        (t.task == "causal_lm" and a.world_size > 1 and a.eval_strategy != "no", EVALUATION),
        (a.train_sampling_strategy != "random", f"train_sampling_strategy={a.train_sampling_strategy!r}: DP-SGD "
         "needs Poisson sampling, which decides the batches itself. Leave it at 'random'."),
        (a.dataloader_drop_last, "dataloader_drop_last: Poisson batches have no fixed size to drop."),
        (a.auto_find_batch_size, "auto_find_batch_size: changing the batch size changes the sampling rate the "
         "accountant assumed."),
        (bool(getattr(a, "activation_checkpointing", False)), "activation checkpointing: the recomputed forward "
         "pass fires Opacus' activation hooks twice. Train without it."),
        (a.include_num_input_tokens_seen not in ("no", False) and not t.release_nonprivate_stats,
         "include_num_input_tokens_seen: the token count of the sampled batches is not private; pass "
         "release_nonprivate_stats=True to log it anyway."),
        (a.bf16 and t.grad_sample_mode == "ghost", "bf16 under ghost clipping: Opacus computes the per-example norms "
         "from bfloat16 activations and the clipped gradient in a second bfloat16 backward, so a clipped example can "
         "exceed max_grad_norm (opacus_spectral.trainer_precision). Use grad_sample_mode='hooks' or float32."),
        (t.task in ("causal_lm", "token_classification") and bool(t.criterion or t.compute_loss_func
         or a.label_smoothing_factor), f"criterion, compute_loss_func or label_smoothing_factor for task="
         f"{t.task!r}: DPTrainer computes each example's own token mean (opacus_spectral.trainer_loss) and "
         "would ignore them. Remove them."),
    ]
    for bad, why in refusals:
        if bad:
            raise ValueError(f"DPTrainer cannot train with {why}")
