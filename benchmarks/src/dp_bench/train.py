"""The one DP training loop of dp-bench (every centralized command trains through :func:`run_dp`).

Opacus DP-SGD through ``opacus_spectral.PrivacyEngine``: Poisson sampling, flat clipping, logical batches of
expected size ``batch_size`` split into physical batches by Opacus' ``BatchMemoryManager``, the given
``post_hooks``. The noise generator and the Poisson sampler are derived from ``noise_seed=seed + 1`` (the
engine's explicit reproducible mode, docs/engine.md "Noise, seeds and reproducibility": an experiment, not a
release), so runs of different methods with the same ``seed`` share their batches and noise draws (common random
numbers). A logical step is recognised through the post-hook handle's
``logical_steps`` counter (not by comparing diagnostics). Per logical step it records the loss, σ, and —
with ``oracle=True`` — cos(noisy, clean) and cos(denoised, clean) globally and per parameter, and which
matrices ``rmt`` gated; test accuracy at ``eval_at`` steps through :func:`peft_lalora.federated.server.evaluate.
classification_metrics`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from peft_lalora.federated.server.evaluate import classification_metrics
from torch import nn

from .meta import quiet_warnings

__all__ = ["LengthSortedBatches", "estimator_grad_sample_mode", "evaluate", "run_dp", "step_record"]


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
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    gamma = adambc_gamma(name)
    if gamma is not None:  # DP-AdamBC with AdamW's betas and no weight decay, like "adamw"
        from opacus_spectral.optimizers import DPAdamBC

        return DPAdamBC(params, lr=lr, gamma=gamma)
    raise ValueError(f"optimizer must be 'adamw', 'adam', 'sgd' or 'adambc:<gamma>', got {name!r}")


def adambc_gamma(name: str) -> float | None:
    """γ′ of an optimizer named ``adambc:<gamma>`` (DP-AdamBC), else None; a malformed γ′ is a ``ValueError``."""
    if not name.startswith("adambc:"):
        return None
    gamma = float(name.split(":", 1)[1])
    if not gamma > 0:
        raise ValueError(f"adambc:<gamma> needs gamma > 0, got {name!r}")
    return gamma


class _PrivateRun:
    """What ``make_private`` returned for a run: the wrapped module, the DP optimizer, the (possibly
    length-sorted) Poisson loader and the criterion (ghost mode: the one ``make_private`` wrapped; otherwise
    ``criterion``, cross-entropy by default), plus the pipeline's handle and the ``backward`` of the
    gradient estimator that replaces ``loss.backward()`` (``None``: the ordinary backward)."""

    def __init__(
        self,
        engine: Any,
        out: Sequence[Any],
        input_names: Sequence[str] | None,
        sort_by: Sequence[int] | None,
        gradient: Callable[[nn.Module], Any] | None,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.engine, self.handle = engine, engine.post_hooks
        self.module, self.optimizer, self.loader = out[0], out[1], out[-1]
        if sort_by is not None:  # BatchMemoryManager wraps this loader's batch sampler; it is never iterated itself
            self.loader = torch.utils.data.DataLoader(
                self.loader.dataset,
                collate_fn=self.loader.collate_fn,
                batch_sampler=LengthSortedBatches(self.loader.batch_sampler, sort_by),
                generator=self.loader.generator,
            )
        self.ghost = len(out) == 4
        if criterion is not None and self.ghost:
            raise ValueError(
                "run_dp(criterion=...) is for hooks / functorch / ew modes: in ghost mode the loss must be the "
                "criterion make_private wraps (opacus_spectral.ghost_causal_lm_loss for a causal LM)"
            )
        self.criterion = out[2] if self.ghost else criterion or nn.CrossEntropyLoss()
        self.input_names = input_names
        estimator = (
            gradient(self.module) if gradient is not None else self.handle.pipeline.gradient_estimator(self.module)
        )
        self.backward = estimator.backward if estimator is not None else None

    def physical_step(self, inputs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        """One physical batch: fresh gradients, the loss and its backward (or the estimator's), the DP step. An
        empty batch outside ghost mode skips the forward (a causal LM cannot run zero rows) and contributes zero
        per-sample gradients, as Opacus does for empty Poisson batches; its loss is NaN (an empty mean)."""
        self.optimizer.zero_grad(set_to_none=True)
        if len(y) == 0 and not self.ghost and self.backward is None:
            for p in self.optimizer.params:
                p.grad_sample = p.new_zeros((0, *p.shape))
            self.optimizer.step()
            return torch.full((), float("nan"))

        def loss_fn() -> torch.Tensor:
            names = self.input_names
            logits = self.module(**dict(zip(names, inputs, strict=True))) if names else self.module(*inputs)
            return self.criterion(getattr(logits, "logits", logits), y)

        if self.backward is None:
            loss = loss_fn()
            loss.backward()
        else:
            loss = self.backward(loss_fn)
        self.optimizer.step()
        return loss

    def finish(self, noise_multiplier: float, delta: float) -> float:
        """The run's ε at ``delta`` (no noise: no guarantee, ∞); the pipeline is detached."""
        from opacus_spectral import epsilon_from_history

        acc = self.engine.accountant  # the same ε as engine.get_epsilon, evaluated once per distinct history
        eps = epsilon_from_history(acc.history, delta, acc.mechanism()) if noise_multiplier > 0 else float("inf")
        self.handle.remove()
        return eps


Evaluator = Callable[[nn.Module, torch.utils.data.Dataset, int], float]


class _Evaluations:
    """The test score (``curve``) and the score on each of ``eval_sets`` (``curves[name]``; only at the steps of
    ``eval_sets_at`` when given) at checkpoints. The score is ``evaluator(module, data, batch)``, test accuracy
    (:func:`evaluate`) by default."""

    def __init__(
        self,
        module: nn.Module,
        test: torch.utils.data.Dataset,
        eval_sets: Mapping[str, torch.utils.data.Dataset] | None,
        input_names: Sequence[str] | None,
        batch: int,
        evaluator: Evaluator | None = None,
        eval_sets_at: Iterable[int] | None = None,
    ) -> None:
        self.module, self.test, self.input_names, self.batch = module, test, input_names, batch
        self.evaluator = evaluator
        self.extra = dict(eval_sets or {})
        self.extra_at = None if eval_sets_at is None else set(eval_sets_at)
        self.curve: list[tuple[int, float]] = []
        self.curves: dict[str, list[tuple[int, float]]] = {name: [] for name in self.extra}

    def score(self, data: torch.utils.data.Dataset) -> float:
        if self.evaluator is not None:
            return float(self.evaluator(self.module, data, self.batch))
        return evaluate(self.module, data, self.input_names, self.batch)["accuracy"]

    def record(self, step: int, test_score: float | None = None) -> None:
        """Evaluate after ``step`` completed steps (``test_score``: the test score already known)."""
        self.curve.append((step, self.score(self.test) if test_score is None else test_score))
        if self.extra_at is None or step in self.extra_at:
            for name, data in self.extra.items():
                self.curves[name].append((step, self.score(data)))


def estimator_grad_sample_mode(denoisers: Sequence[Any], grad_sample_mode: str) -> str:
    """``grad_sample_mode``, or the first of a denoiser's ``estimator_grad_sample_modes`` when it is not one of
    them: the mode its gradient estimator works with (DiSK's two-point gradient: per-sample gradients, hooks)."""
    for d in denoisers:
        modes = getattr(d, "estimator_grad_sample_modes", None)
        if modes and grad_sample_mode not in modes:
            grad_sample_mode = modes[0]
    return grad_sample_mode


def _private_engine(accountant: str, seed: int) -> Any:
    """The engine in its explicit reproducible mode: the same batches and noise draws for every method of a seed."""
    from opacus_spectral.errors import ReproducibleNoiseWarning

    from opacus_spectral import PrivacyEngine

    with warnings.catch_warnings():  # paired noise is this experiment's design; the warning is the reminder
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        return PrivacyEngine(accountant=accountant, noise_seed=seed + 1)  # same batches and noise per seed


def _make_private(
    engine: Any,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: torch.utils.data.DataLoader,
    post_hooks: Sequence[Any],
    gradient: Callable[[nn.Module], Any] | None,
    grad_sample_mode: str,
    allow_non_private: bool,
    options: dict[str, Any],
) -> tuple[Any, ...]:
    """``engine.make_private`` with Poisson sampling and the denoisers of ``post_hooks``; without ``gradient``, in
    the ``grad_sample_mode`` the pipeline's gradient estimator works with (:func:`estimator_grad_sample_mode`)."""
    from opacus_spectral.plugins.registry import create_denoisers

    denoisers = create_denoisers(list(post_hooks), engine.registry)
    if gradient is None:
        grad_sample_mode = estimator_grad_sample_mode(denoisers, grad_sample_mode)
    return engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        poisson_sampling=True,
        post_hooks=denoisers,
        grad_sample_mode=grad_sample_mode,
        allow_non_private=allow_non_private,
        **options,
    )


def _train(
    run: _PrivateRun,
    evals: _Evaluations,
    *,
    initial_accuracy: float | None,
    steps: int,
    physical_batch: int,
    eval_at: Iterable[int],
    per_param: bool,
    on_step: Callable[[int, dict[str, Any], Any], None] | None,
    desc: str,
) -> tuple[list[dict[str, Any]], float]:
    """``steps`` logical steps through Opacus' ``BatchMemoryManager``: one record per logical step (recognised by
    the handle's ``logical_steps`` counter), then ``on_step`` and the evaluation at ``eval_at`` (0: before
    training, ``initial_accuracy`` as its test accuracy when given). Returns the records and the training
    seconds (evaluations excluded)."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from tqdm.auto import tqdm

    eval_at = set(eval_at)
    if 0 in eval_at:
        evals.record(0, initial_accuracy)
    log: list[dict[str, Any]] = []
    step, t_train = 0, 0.0
    bar = tqdm(total=steps, desc=desc, unit="step", leave=False, mininterval=2.0)
    t0 = time.perf_counter()
    while step < steps:
        with BatchMemoryManager(
            data_loader=run.loader, max_physical_batch_size=physical_batch, optimizer=run.optimizer
        ) as mem_loader:
            for *inputs, y in mem_loader:
                loss = run.physical_step(inputs, y)
                if run.handle.logical_steps == step:  # a virtual (accumulation) step of BatchMemoryManager
                    continue
                dt = time.perf_counter() - t0
                t_train += dt
                entry = step_record(run.handle.diagnostics.last, per_param=per_param)
                entry.update(step=step, seconds=dt, loss=float(loss.detach()))
                log.append(entry)
                if on_step is not None:
                    on_step(step, entry, run.optimizer)
                step += 1
                bar.update(1)
                if step in eval_at:
                    evals.record(step)
                    bar.set_postfix(score=f"{evals.curve[-1][1]:.3f}")
                t0 = time.perf_counter()
                if step >= steps:
                    break
    bar.close()
    return log, t_train


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
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    evaluator: Evaluator | None = None,
    eval_sets_at: Iterable[int] | None = None,
    on_private: Callable[[nn.Module, Any], None] | None = None,
    noise_mechanism: Any = None,
) -> dict[str, Any]:
    """Train ``model`` for ``steps`` logical DP-SGD steps with ``post_hooks``; per-step records + score curves.

    ``eval_at``: completed steps (0 = before training; ``initial_accuracy`` used there when given) at which the test
    score is measured, and the score of each of ``eval_sets`` (``result["curves"][name]``; only at ``eval_sets_at``
    when given). The score is accuracy, or ``evaluator(module, data, eval_batch)`` (e.g.
    :func:`dp_bench.lm_task.lm_score`); ``criterion(logits, y)`` replaces cross-entropy outside ghost mode (e.g.
    :func:`opacus_spectral.causal_lm_loss`). ``on_private(wrapped_model, dp_optimizer)`` runs once after
    ``make_private``, before the first step (the audit attaches its canaries there); ``on_step(step, record,
    dp_optimizer)`` runs after each logical step. ``noise_mechanism`` (``make_private``'s; default DP-SGD) is sized
    for ``steps``.
    ``gradient(wrapped_model)`` builds an object whose ``backward(loss_fn)`` replaces ``loss.backward()``; without
    it, the gradient estimator a denoiser of the pipeline offers does (e.g. DiSK's two-point gradient, in the
    ``grad_sample_mode`` it declares: :func:`estimator_grad_sample_mode`). ``sort_by`` (a length per example) sorts
    every Poisson batch before its split into physical batches (:class:`LengthSortedBatches`). Returns
    ``{"per_step", "curve", "curves", "epsilon", "train_seconds", "noise_multiplier"}``.
    """
    quiet_warnings()
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size)
    opt = _optimizer([p for p in model.parameters() if p.requires_grad], optimizer, lr, momentum)
    torch.manual_seed(seed + 1)  # the rest of the run's randomness (dropout) is shared by every method of a seed
    engine = _private_engine(accountant, seed)
    private = dict(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, oracle=oracle)
    if noise_mechanism is not None:
        private.update(noise_mechanism=noise_mechanism, steps=steps)
    out = _make_private(engine, model, opt, loader, post_hooks, gradient, grad_sample_mode, allow_non_private, private)
    run = _PrivateRun(engine, out, input_names, sort_by, gradient, criterion)
    if on_private is not None:
        on_private(run.module, run.optimizer)
    evals = _Evaluations(run.module, test, eval_sets, input_names, eval_batch, evaluator, eval_sets_at)
    log, t_train = _train(
        run,
        evals,
        initial_accuracy=initial_accuracy,
        steps=steps,
        physical_batch=physical_batch,
        eval_at=eval_at,
        per_param=per_param,
        on_step=on_step,
        desc=desc,
    )
    curves = {"curve": evals.curve, "curves": evals.curves, "epsilon": run.finish(noise_multiplier, delta)}
    return {"per_step": log, **curves, "train_seconds": t_train, "noise_multiplier": noise_multiplier}
