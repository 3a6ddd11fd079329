"""The one DP training loop of the harness (every centralized command trains through :func:`run_dp`).

Opacus DP-SGD through ``opacus_spectral.PrivacyEngine``: Poisson sampling, flat clipping, logical batches of
expected size ``batch_size`` split into physical batches by Opacus' ``BatchMemoryManager``, the given
``post_hooks``. The noise generator and the Poisson sampler are derived from ``noise_seed=seed + 1`` (the
engine's explicit reproducible mode, docs/engine.md "Noise, seeds and reproducibility": an experiment, not a
release), so runs of different methods with the same ``seed`` share their batches and noise draws (common random
numbers). A logical step is recognised through the post-hook handle's
``logical_steps`` counter (not by comparing diagnostics). Per logical step it records the loss, σ, and —
with ``oracle=True`` — cos(noisy, clean) and cos(denoised, clean) globally and per parameter, and which
matrices ``rmt`` gated; test accuracy at ``eval_at`` steps through :func:`peft_lalora.federated.evaluate.
classification_metrics`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from peft_lalora.federated.evaluate import classification_metrics
from torch import nn

from .meta import quiet_warnings

__all__ = ["LengthSortedBatches", "evaluate", "run_dp", "step_record"]


class LengthSortedBatches(torch.utils.data.Sampler[list[int]]):
    """The batches of ``batches`` (Opacus's Poisson batches), each with its indices sorted by ``lengths``.

    Every logical batch holds the same examples as without it, and DP-SGD sums their clipped gradients, so the
    order changes nothing but float rounding (privacy and accounting are untouched: the sampler below draws the
    same batches). What it buys: the physical batches that ``BatchMemoryManager`` splits from a sorted logical
    batch hold sequences of similar length, which a model that drops all-padding columns
    (:class:`dp_bench.frozen.BertTop` with ``trim_padding=True``) computes in fewer tokens."""

    def __init__(self, batches: Iterable[Sequence[int]], lengths: Sequence[int]) -> None:
        self.batches = batches
        self.lengths = [int(x) for x in lengths]

    def __iter__(self) -> Any:
        for idx in self.batches:
            yield sorted((int(i) for i in idx), key=lambda i: (self.lengths[i], i))

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]


def evaluate(
    model: nn.Module, data: torch.utils.data.Dataset, input_names: Sequence[str] | None, batch: int = 512
) -> dict[str, float]:
    """Accuracy and loss of ``model`` on ``data`` (batches of ``batch``). It leaves the global RNG alone (a
    ``DataLoader`` iterator would draw a seed from it and shift the training run's noise and batches)."""
    if isinstance(data, torch.utils.data.TensorDataset):
        n = len(data)
        batches: Iterable[Sequence[torch.Tensor]] = (
            [t[i : i + batch] for t in data.tensors] for i in range(0, n, batch)
        )
        return classification_metrics(model, batches, input_names=input_names)
    with torch.random.fork_rng(devices=[]):
        loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
        return classification_metrics(model, loader, input_names=input_names)


def step_record(diag: Any, per_param: bool = True) -> dict[str, Any]:
    """JSON-ready numbers of one logical step: sigma, global/per-parameter cosines, gated matrices."""
    out: dict[str, Any] = {"sigma": float(diag.sigma)}
    if diag.oracle is not None:
        out["cos_global"] = [float(x) for x in diag.oracle["global"]]
        if per_param:
            out["cos"] = {k: [float(v[0]), float(v[1])] for k, v in diag.oracle["per_param"].items()}
    rmt = diag.denoisers.get("rmt")
    if rmt is not None:
        out["matrices"] = int(rmt["matrices"])
        pm = rmt.get("per_matrix")
        if pm is not None:
            out["gated_names"] = sorted(n for n, d in pm.items() if bool(d["gated"]))
            out["gated"] = len(out["gated_names"])
        else:
            out["gated"] = int(rmt["gated"])
        out["rmt_seconds"] = float(rmt.get("seconds", 0.0))
    return out


def _optimizer(params: list[nn.Parameter], name: str, lr: float, momentum: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {name!r}")


def run_dp(
    model: nn.Module,
    train: torch.utils.data.Dataset,
    test: torch.utils.data.Dataset,
    *,
    input_names: Sequence[str] | None,
    post_hooks: Sequence[Any],
    noise_multiplier: float,
    batch_size: int,
    steps: int,
    seed: int,
    lr: float,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    max_grad_norm: float = 1.0,
    physical_batch: int = 256,
    eval_at: Iterable[int] = (),
    eval_batch: int = 512,
    initial_accuracy: float | None = None,
    oracle: bool = True,
    per_param: bool = True,
    accountant: str = "prv",
    delta: float = 1e-5,
    grad_sample_mode: str = "hooks",
    allow_non_private: bool = False,
    desc: str = "",
    on_step: Callable[[int, dict[str, Any], Any], None] | None = None,
    eval_sets: Mapping[str, torch.utils.data.Dataset] | None = None,
    gradient: Callable[[nn.Module], Any] | None = None,
    sort_by: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` logical DP-SGD steps with ``post_hooks``; per-step records + accuracy curve.

    ``eval_at``: numbers of completed steps (0 = before training; ``initial_accuracy`` is used there when given)
    at which test accuracy is measured (and the accuracy on each of ``eval_sets``, e.g. a validation split:
    ``result["curves"][name]``). ``on_step(step, record, dp_optimizer)`` runs after each logical step
    (before the step's evaluation), e.g. to snapshot the clean gradient. ``gradient(wrapped_model)`` builds an
    object whose ``backward(loss_fn)`` replaces ``loss.backward()`` (e.g. DiSK's two-point gradient).
    ``sort_by`` (a length per training example) sorts every Poisson batch before it is split into physical
    batches of ``physical_batch`` (:class:`LengthSortedBatches`). Returns
    ``{"per_step", "curve", "epsilon", "train_seconds", "noise_multiplier"}``.
    """
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from tqdm.auto import tqdm

    from opacus_spectral import PrivacyEngine, ReproducibleNoiseWarning

    quiet_warnings()
    eval_at = set(eval_at)
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, optimizer, lr, momentum)
    torch.manual_seed(seed + 1)  # the rest of the run's randomness (dropout) is shared by every method of a seed
    with warnings.catch_warnings():  # paired noise is this experiment's design; the warning is the reminder
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant=accountant, noise_seed=seed + 1)  # same batches and noise per seed
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,
        post_hooks=list(post_hooks),
        oracle=oracle,
        grad_sample_mode=grad_sample_mode,
        allow_non_private=allow_non_private,
    )
    module, dp_opt, dp_loader = out[0], out[1], out[-1]
    if sort_by is not None:  # BatchMemoryManager wraps this loader's batch sampler; it is never iterated itself
        dp_loader = torch.utils.data.DataLoader(
            dp_loader.dataset,
            collate_fn=dp_loader.collate_fn,
            batch_sampler=LengthSortedBatches(dp_loader.batch_sampler, sort_by),
            generator=dp_loader.generator,
        )
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    handle = engine.post_hooks
    backward = gradient(module).backward if gradient is not None else None

    def acc() -> float:
        return evaluate(module, test, input_names, eval_batch)["accuracy"]

    extra = dict(eval_sets or {})
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in extra}

    def checkpoint(step: int) -> None:
        for name, data in extra.items():
            curves[name].append((step, evaluate(module, data, input_names, eval_batch)["accuracy"]))

    curve: list[tuple[int, float]] = []
    if 0 in eval_at:
        curve.append((0, acc() if initial_accuracy is None else initial_accuracy))
        checkpoint(0)
    log: list[dict[str, Any]] = []
    step, t_train = 0, 0.0
    bar = tqdm(total=steps, desc=desc, unit="step", leave=False, mininterval=2.0)
    t0 = time.perf_counter()
    while step < steps:
        with BatchMemoryManager(
            data_loader=dp_loader, max_physical_batch_size=physical_batch, optimizer=dp_opt
        ) as mem_loader:
            for *inputs, y in mem_loader:
                dp_opt.zero_grad(set_to_none=True)

                def loss_fn(inputs: list[torch.Tensor] = inputs, y: torch.Tensor = y) -> torch.Tensor:
                    logits = module(**dict(zip(input_names, inputs, strict=True))) if input_names else module(*inputs)
                    return criterion(getattr(logits, "logits", logits), y)

                if backward is None:
                    loss = loss_fn()
                    loss.backward()
                else:
                    loss = backward(loss_fn)
                dp_opt.step()
                if handle.logical_steps == step:  # a virtual (accumulation) step of BatchMemoryManager
                    continue
                dt = time.perf_counter() - t0
                t_train += dt
                entry = step_record(handle.diagnostics.last, per_param=per_param)
                entry.update(step=step, seconds=dt, loss=float(loss.detach()))
                log.append(entry)
                if on_step is not None:
                    on_step(step, entry, dp_opt)
                step += 1
                bar.update(1)
                if step in eval_at:
                    curve.append((step, acc()))
                    checkpoint(step)
                    bar.set_postfix(acc=f"{curve[-1][1]:.3f}")
                t0 = time.perf_counter()
                if step >= steps:
                    break
    bar.close()
    eps = engine.get_epsilon(delta) if noise_multiplier > 0 else float("inf")  # no noise: no guarantee
    handle.remove()
    return {
        "per_step": log,
        "curve": curve,
        "curves": curves,
        "epsilon": eps,
        "train_seconds": t_train,
        "noise_multiplier": noise_multiplier,
    }
