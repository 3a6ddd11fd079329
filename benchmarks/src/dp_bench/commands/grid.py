"""Paired-seed grid on a bed: DP training where the noise costs accuracy; denoisers compared with paired seeds.

    dp-bench grid --name fmnist_a --epochs 30     # grid A of docs/results.md §7 (JSON after every run)
    dp-bench grid --name fmnist_a --resume        # continue an interrupted grid (start it twice: two workers)
    dp-bench grid --name fmnist_b ... --epsilons 3 1 --resume   # grow it: more ε / seeds / methods (GROWABLE)
    dp-bench grid --name fmnist_a --replot        # tables + docs/results/fmnist_a.png from the JSON
    dp-bench grid --measure-speed                 # ghost clipping vs hooks, per model and batch
    dp-bench grid --model minilm --name rt ...    # Rotten Tomatoes (DP-LoRA on MiniLM), same protocol (§8)
    dp-bench grid --model smollm2 --name smollm2_qv ...  # SmolLM2 + Shakespeare, perplexity (§10's own report)
    dp-bench grid --smoke --out /tmp/f            # a few steps of everything: checks the plumbing

Beds (``--model``): ``mlp`` / ``cnn`` on Fashion-MNIST (:func:`dp_bench.task.fashion_mnist_task`: Debian
``dataset-fashion-mnist``, 55,000 training / 5,000 validation images, a fixed seeded split of the 60,000, and the
10,000 test images; the MLP 784 → 256 → 10 (tanh) and the tanh CNN of Papernot et al. 2021,
:mod:`dp_bench.vision`), and ``minilm``: all-MiniLM-L6-v2 on packaged Rotten Tomatoes with LoRA
(``--trainable``) on the top ``--top-layers`` encoder layers and a fresh head, the bottom layers cached exactly
(:func:`dp_bench.task.frozen_text_task`, a validation split carved from its training split); ``smollm2``:
SmolLM2-135M-Instruct on Shakespeare blocks split by work, DP-LoRA r = 32, α = 64 on every ``q_proj`` / ``v_proj``
(:mod:`dp_bench.lm_task`), loss :func:`opacus_spectral.causal_lm_loss`, score ``-log`` perplexity (larger is better,
so the learning-rate rule is the same), reported by :mod:`dp_bench.commands.lm_report` (docs/results.md §10).

Protocol (docs/results.md §7, written before the runs):

* DP-SGD through Opacus (``opacus_spectral.PrivacyEngine``): Poisson sampling with expected batch B, flat
  clipping C, per-example clipping ``--grad-sample-mode``, the noise multiplier calibrated with the PRV
  accountant so that the step budget (``--epochs`` passes over the training split, or ``--steps``) reaches
  exactly ε at δ = 1e-5 (the RDP accountant's ε for the same run is recorded beside it). Non-private (no
  clipping, no noise) and clipping-only references.
* Every method of a seed shares the initialization, the Poisson batches and the noise draws (common random
  numbers: :func:`dp_bench.train.run_dp` passes the engine an explicit ``noise_seed`` derived from the seed).
* Learning rates: per (method, optimizer, B) the value of ``--lr-grid`` with the best final *validation*
  accuracy at ``--tune-epsilon`` on the tuning seed (not one of the evaluation seeds); never the test set. A
  best value at an end of what was tried extends the grid outward by a factor 2 (at most three times).
* Metrics: final test accuracy at the budget; steps to reach the no-denoiser baseline's final mean test
  accuracy (a seed that never reaches it counts as reaching at the budget; the count is reported); the
  absolute ε a method needs to reach the baseline's mean final accuracy at ``--target-epsilon`` (interpolated
  in log ε over ``--epsilons``), and the ε saved against the baseline; paired differences with 95 % t-intervals
  over seeds. Oracle: per step the cosine of the released update to the clean clipped gradient and to the
  clean gradient's EMA (β = 0.9).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import runner
from ..adapters import Trainable, build_top
from ..config import as_json, opt, parse_config, recorded_config, same_config, start
from ..lm_task import LMTask, lora_model, run_options, smollm2_shakespeare_task
from ..meta import RESULTS, checkout, now_utc
from ..noise_methods import accounting, bands_of, mechanism_of_method, sampler_of
from ..runner import Cell
from ..store import SharedResult
from ..task import FrozenTextTask, ImageTask, fashion_mnist_task, frozen_text_task
from ..timing import timed_steps
from ..train import adambc_gamma, run_dp
from ..vision import build
from . import grid_report, lm_report
from .grid_report import REFERENCES

#: method -> (post_hooks, SGD momentum override: temporal filters hold the momentum themselves); "disk"'s
#: denoiser also offers DiSK's two-point gradient, which :func:`dp_bench.train.run_dp` trains with (per-sample
#: gradients: it picks the hooks mode the estimator declares)
METHODS: dict[str, tuple[list[Any], float | None]] = {
    "none": ([], None),
    "rmt": ([("rmt_paper", {"warn_after": 0})], None),
    "rmt-tw": ([("rmt", {"gate": "tracy_widom", "norm_correction": "clean_estimate", "warn_after": 0})], None),
    "rmt-default": ([("rmt", {"warn_after": 0})], None),  # the library's defaults, whatever they are
    "rmt-js": ([("rmt", {"residual": "james_stein", "norm_correction": "none", "warn_after": 0})], None),
    "ema": ([("ema", {"beta": 0.9})], 0.0),
    "ema+rmt": ([("ema", {"beta": 0.9}), ("rmt_paper", {"warn_after": 0})], 0.0),
    "ema+rmt-js": (
        [("ema", {"beta": 0.9}), ("rmt", {"residual": "james_stein", "norm_correction": "none", "warn_after": 0})],
        0.0,
    ),
    "doppler": ([("doppler", {})], 0.0),
    "rmt+doppler": ([("rmt_paper", {"warn_after": 0}), ("doppler", {})], 0.0),
    "disk": ([("disk", {"kappa": 0.7})], 0.0),
}


#: the settings only the causal-LM bed reads (recorded as None for the others: :func:`dp_bench.config.as_json`)
SMOLLM2 = {"model": ("smollm2",)}
LR_GRIDS = {"sgd": [0.5, 1.0, 2.0, 4.0], "adamw": [5e-4, 1e-3, 2e-3, 4e-3]}


@dataclass
class Config:
    model: str = opt(
        "mlp",
        "mlp or cnn (Fashion-MNIST), minilm (Rotten Tomatoes), smollm2 (Shakespeare)",
        choices=("mlp", "cnn", "minilm", "smollm2"),
    )
    trainable: str = opt(
        "lora:qv:8", "--model minilm: 'lora:<targets>:<rank>' on the top encoder layers", only={"model": ("minilm",)}
    )
    top_layers: int = opt(
        1,
        "--model minilm: encoder layers trained (LoRA on each); the layers below are cached",
        only={"model": ("minilm",)},
    )
    methods: list[str] = opt(
        ["none", "rmt", "doppler", "rmt+doppler"],
        "methods: " + ", ".join(METHODS) + ", bandmf:<b> (BandMF noise), cyclic:<b> (its sampler, uncorrelated noise)",
    )
    optimizers: list[str] = opt(["sgd"], "sgd (momentum 0.9), adamw and/or adambc:<gamma> (DP-AdamBC, floor gamma)")
    batches: list[int] = opt([1024, 4096], "expected Poisson batch sizes")
    epsilons: list[float] = opt([1.0, 3.0, 8.0], "target ε (δ = 1e-5)")
    references: bool = opt(True, "also run the non-private and the clipping-only references")
    epochs: float = opt(20.0, "step budget, in passes over the training split")
    steps: int = opt(0, "step budget in logical steps (overrides --epochs when > 0)")
    seeds: list[int] = opt([0, 1, 2, 3, 4], "evaluation seeds (paired across methods)")
    tune_seeds: list[int] = opt(
        [100], "seeds of the learning-rate runs (not evaluation seeds): a rate scores its mean validation over them"
    )
    tune_epsilon: float = opt(3.0, "ε of the learning-rate runs")
    lr_grid_sgd: list[float] = opt(LR_GRIDS["sgd"], "SGD learning rates tried", type=float)
    lr_grid_adamw: list[float] = opt(LR_GRIDS["adamw"], "AdamW learning rates tried", type=float)
    lr_grid_nonprivate: list[float] = opt(
        [0.05, 0.1, 0.2, 0.5], "SGD learning rates of the unclipped reference", type=float
    )
    momentum: float = opt(0.9, "SGD momentum (methods holding their own momentum use 0)")
    max_grad_norm: float = opt(1.0, "clipping bound C")
    grad_sample_mode: str = opt("ghost", "per-example clipping implementation", choices=("ghost", "hooks"))
    physical_batch: int = opt(
        0,
        "physical batch size (0 = the whole logical batch); with --model minilm every "
        "Poisson batch is sorted by length first and each physical batch computed without "
        "its all-padding columns (the same clipped sum up to rounding, fewer tokens)",
    )
    checkpoints: int = opt(20, "evaluations along the run")
    target_epsilon: float = opt(3.0, "the baseline's final accuracy at this ε is the target of the ε metric")
    lr_extensions: int = opt(3, "outward extensions of the lr grid when the best value is at an end (0: none)")
    tune: bool = opt(True, "choose each arm's lr on validation (else every arm trains at its lr grid's one value)")
    tune_references: bool = opt(True, "tune the references' lr (else they take the 'none' arm's choice)")
    reference_seeds: int = opt(0, "evaluation seeds of the references: the first N of --seeds (0: all)")
    tune_test_curve: bool = opt(True, "score the test split at every checkpoint of a tuning run (else at its end)")
    block_size: int = opt(32, "--model smollm2: tokens per Shakespeare block", only=SMOLLM2)
    val_blocks: int = opt(256, "--model smollm2: validation blocks scored (the first N of the split)", only=SMOLLM2)
    test_blocks: int = opt(512, "--model smollm2: test blocks scored (the first N of the split)", only=SMOLLM2)
    val_size: int = opt(
        5000, "validation examples carved from the training split", only={"model": ("mlp", "cnn", "minilm")}
    )
    threads: int = opt(2, "torch threads")
    out: Path = opt(RESULTS, "output folder (<name>.json, <name>.png)")
    name: str = opt("grid", "file stem of the outputs")
    resume: bool = opt(False, "keep the runs already in the JSON")
    allow_mixed_commits: bool = opt(
        False,
        "--resume: add runs from another code state (commit or uncommitted changes) than the stored runs' (recorded)",
    )
    replot: bool = opt(False, "only the tables and the plot from the JSON")
    measure_speed: bool = opt(False, "only measure ghost clipping vs hooks")
    smoke: bool = opt(False, "tiny budget (plumbing check)")

    def validate(self) -> None:
        for name in self.optimizers:
            if name not in ("sgd", "adamw") and adambc_gamma(name) is None:
                raise ValueError(f"unknown optimizer {name!r}: sgd, adamw or adambc:<gamma> (e.g. adambc:1e-8)")
        unknown = sorted(m for m in set(self.methods) - set(METHODS) if bands_of(m) is None)
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
        if "none" not in self.methods:
            raise ValueError("--methods must include the baseline 'none'")
        if (
            not self.tune_seeds
            or set(self.tune_seeds) & set(self.seeds)
            or len(set(self.tune_seeds)) < len(self.tune_seeds)
        ):
            raise ValueError("--tune-seeds: one or more distinct seeds, none of them an evaluation seed (--seeds)")
        if self.target_epsilon not in self.epsilons:
            raise ValueError("--target-epsilon must be one of --epsilons")
        if self.model in ("minilm", "smollm2") and ("disk" in self.methods or self.measure_speed):
            raise ValueError(f"--model {self.model}: 'disk' and --measure-speed are defined for the image models only")
        if self.top_layers != 1 and self.model != "minilm":
            raise ValueError("--top-layers is a --model minilm setting (the other beds train their whole model or q/v)")
        if self.model == "smollm2" and self.grad_sample_mode != "hooks":
            raise ValueError("--model smollm2 trains with causal_lm_loss in hooks mode: pass --grad-sample-mode hooks")
        if self.smoke and self.model == "smollm2":
            self.steps, self.seeds, self.batches, self.checkpoints, self.physical_batch = 2, [0, 1], [4], 2, 2
            self.lr_grid_adamw, self.val_blocks, self.test_blocks, self.block_size = [1e-3], 4, 4, 16
        elif self.smoke:
            self.epochs, self.seeds, self.batches, self.checkpoints = 0.05, [0, 1], [256], 2
            self.lr_grid_sgd, self.lr_grid_adamw, self.val_size = [1.0, 2.0], [1e-3, 2e-3], 500
            self.lr_grid_nonprivate = [0.1]
        # checked after --smoke has set the grids it trains
        if not self.tune and any(len(self.lr_grid(o, m)) != 1 for o in self.optimizers for m in self.arms()):
            raise ValueError("--no-tune trains every arm at one learning rate: give each --lr-grid one value")

    def arms(self) -> list[str]:
        """The methods and, with ``--references``, the references."""
        return [*self.methods, *(REFERENCES if self.references else ())]

    def lr_grid(self, optimizer: str, method: str) -> list[float]:
        if method == "nonprivate" and optimizer == "sgd":
            return self.lr_grid_nonprivate  # unclipped gradients are larger than clipped ones
        return self.lr_grid_sgd if optimizer == "sgd" else self.lr_grid_adamw  # adambc: AdamW's grid


#: --smoke --model smollm2: a slice of the corpus (the split by work kept: one work per split)
SMOKE_WORKS, SMOKE_LINES = ("tempest", "hamlet", "macbeth"), 40


def load_task(cfg: Config) -> ImageTask | FrozenTextTask | LMTask:
    """The bed's train / validation / test splits (Fashion-MNIST and MiniLM: the validation split is carved from
    the training split; SmolLM2: split by work)."""
    if cfg.model == "smollm2":
        works, lines = (SMOKE_WORKS, SMOKE_LINES) if cfg.smoke else (None, None)
        return smollm2_shakespeare_task(
            cfg.block_size, val_blocks=cfg.val_blocks, test_blocks=cfg.test_blocks, works=works, max_lines=lines
        )
    if cfg.model == "minilm":
        task = frozen_text_task("minilm", 48, cfg.top_layers, val_size=cfg.val_size)
        if cfg.physical_batch > 0:  # evaluation sets sorted by length once: accuracy is order-free, batches trim
            task.val, task.test = by_length(task.val), by_length(task.test)
        return task
    return fashion_mnist_task(cfg.val_size)


def lengths(data: torch.utils.data.TensorDataset) -> list[int]:
    """Valid tokens per example of a frozen-text split (its second tensor is the attention mask)."""
    return data.tensors[1].sum(1).tolist()


def by_length(data: torch.utils.data.TensorDataset) -> torch.utils.data.TensorDataset:
    """The split reordered by length (stable), for evaluation batches that :class:`~dp_bench.frozen.BertTop`
    can trim."""
    order = torch.tensor(lengths(data)).argsort(stable=True)
    return torch.utils.data.TensorDataset(*(t[order] for t in data.tensors))


def new_model(cfg: Config, task: ImageTask | FrozenTextTask | LMTask, seed: int) -> nn.Module:
    """A freshly initialized model from ``seed`` (the same for every method of a seed)."""
    if isinstance(task, LMTask):
        return lora_model(task, seed)
    if isinstance(task, FrozenTextTask):
        return build_top(task, Trainable.parse(cfg.trainable), seed, trim_padding=cfg.physical_batch > 0)
    return build(cfg.model, seed)


def budget(cfg: Config, n_train: int, batch: int) -> int:
    """Logical steps of a run: ``--steps``, else ``--epochs`` passes of expected batch ``batch``."""
    return cfg.steps if cfg.steps > 0 else max(1, round(cfg.epochs * n_train / batch))


def cell_of(phase: str, method: str, optimizer: str, batch: int, eps: float, seed: int) -> Cell:
    """A grid cell: the runner's :class:`~dp_bench.runner.Cell` whose further key parts are the optimizer and B."""
    return Cell(phase, method, eps, seed, (optimizer, f"B{batch}"))


def run_key(phase: str, method: str, optimizer: str, batch: int, eps: float, seed: int, lr: float) -> str:
    """``phase|method|optimizer|B<batch>|eps<ε>|s<seed>|lr<lr>``: the runner's one key format."""
    return cell_of(phase, method, optimizer, batch, eps, seed).key(lr)


@functools.cache
def calibrate(eps: float, q: float, steps: int, delta: float = 1e-5) -> float:
    """The noise multiplier for ``eps`` at ``delta`` (PRV): :func:`opacus_spectral.noise_multiplier_for`."""
    from opacus_spectral import noise_multiplier_for

    return noise_multiplier_for(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps, accountant="prv")


def rdp_epsilon(nm: float, q: float, steps: int, delta: float = 1e-5) -> float:
    from opacus_spectral import epsilon_from_history

    return epsilon_from_history([(nm, q, steps)], delta, "rdp")


class ReleasedOracle:
    """Every ``every`` logical steps: how the released update (``p.grad`` after the denoisers) relates to the clean
    clipped gradient — its cosine to it and to the clean gradient's EMA (β = 0.9), and the norm ratio
    ‖released‖ / ‖clean‖, globally (``cos``) and per weight matrix (``per_matrix``). The oracle of the *update*,
    not only of the gradient: a denoiser that zeroes signal lowers the cosine, one that inflates noise raises the
    ratio."""

    def __init__(self, every: int = 5) -> None:
        self.every = every
        self.ema: list[torch.Tensor] | None = None
        self.cos: list[tuple[int, float, float]] = []
        self.norm_ratio: list[tuple[int, float]] = []
        self.per_matrix: list[tuple[int, int, float, float]] = []  #: (step, matrix index, cos, norm ratio)

    def __call__(self, step: int, entry: dict[str, Any], dp_opt: Any) -> None:
        from opacus_spectral.step.oracle import clean_gradients, cosine, norm_ratio

        params = [p for p in dp_opt.params if p.grad is not None and getattr(p, "summed_grad", None) is not None]
        if not params:
            return
        clean = clean_gradients(dp_opt, params)
        if self.ema is None or len(self.ema) != len(clean):
            self.ema = [c.clone() for c in clean]
        else:
            for e, c in zip(self.ema, clean, strict=True):
                e.mul_(0.9).add_(c, alpha=0.1)
        if step % self.every:
            return
        released = [p.grad.detach() for p in params]
        self.cos.append((step, cosine(released, clean), cosine(released, self.ema)))
        self.norm_ratio.append((step, norm_ratio(released, clean)))
        for i, (p, r_i, c_i) in enumerate(zip(params, released, clean, strict=True)):
            if p.dim() == 2:
                self.per_matrix.append((step, i, cosine([r_i], [c_i]), norm_ratio([r_i], [c_i])))


def method_setup(cfg: Config, method: str, eps: float, q: float, steps: int) -> tuple[list[Any], float, float, float]:
    """``(post_hooks, SGD momentum, noise multiplier, clipping bound)`` of a method at ``eps``: the references
    run without noise (the non-private one without clipping either)."""
    if method == "nonprivate":
        return [], cfg.momentum, 0.0, 1e6
    if method == "clip-only":
        return [], cfg.momentum, 0.0, cfg.max_grad_norm
    hooks, momentum = METHODS.get(method, ([], None))  # bandmf:<b>: no denoiser, calibrated for its accounting
    return (
        hooks,
        cfg.momentum if momentum is None else momentum,
        calibrate(eps, *accounting(method, q, steps)),
        cfg.max_grad_norm,
    )


def checkpoints_at(cfg: Config, steps: int) -> list[int]:
    """The ``--checkpoints`` evaluation steps of a run, with 0 and the last step."""
    every = max(1, steps // cfg.checkpoints)
    return sorted({0, *range(every, steps + 1, every), steps})


def bed_options(cfg: Config, task: ImageTask | FrozenTextTask | LMTask, batch: int, steps: int) -> dict[str, Any]:
    """The bed's options of :func:`run_dp`: physical batch, evaluation batch, length-sorted Poisson batches; for
    the causal LM also its loss, its score (``-log`` perplexity), validation at the last step only (the lr choice
    reads nothing else) and the base model's test score as step 0 (LoRA's B starts at 0)."""
    if isinstance(task, LMTask):
        return {**run_options(task), "physical_batch": cfg.physical_batch or batch, "eval_sets_at": [steps]}
    sort = isinstance(task, FrozenTextTask) and cfg.physical_batch > 0
    # evaluation splits sorted by length (load_task): small batches trim their padding (accuracy is batch-free;
    # MiniLM at 128 rather than 2,000 per batch: evaluation ≈ 2× faster)
    return {
        "physical_batch": cfg.physical_batch or batch,
        "eval_batch": cfg.physical_batch if sort else 2000,
        "sort_by": lengths(task.train) if sort else None,
    }


def outcome(r: dict[str, Any], oracle: ReleasedOracle, nm: float, q: float, steps: int) -> dict[str, Any]:
    """The measured part of a run's record: ε (PRV, RDP beside it), curves, released-update oracle, gates."""
    gated = [e.get("gated") for e in r["per_step"] if "gated" in e]
    return {
        "epsilon_prv": float(r["epsilon"]) if nm else None,
        "epsilon_rdp": rdp_epsilon(nm, q, steps) if nm else None,
        "test": r["curve"],
        "val": r["curves"]["val"],
        "final_test": r["curve"][-1][1],
        "final_val": r["curves"]["val"][-1][1],
        "cos": oracle.cos,
        "norm_ratio": oracle.norm_ratio,
        "per_matrix": oracle.per_matrix,
        "gated_per_step": sum(gated) / len(gated) if gated else None,
        "train_seconds": r["train_seconds"],
    }


def one_run(
    cfg: Config,
    task: ImageTask | FrozenTextTask | LMTask,
    method: str,
    optimizer: str,
    batch: int,
    eps: float,
    lr: float,
    seed: int,
    steps: int,
    phase: str = "eval",
) -> dict[str, Any]:
    """Train one (method, optimizer, B, ε, lr, seed) and return its record (curves, ε, oracle, gates). A tuning
    run without ``--tune-test-curve`` scores the test split only at its end (the lr choice reads validation)."""
    started = now_utc()
    q = batch / len(task.train)
    hooks, momentum, nm, clip = method_setup(cfg, method, eps, q, steps)
    model = new_model(cfg, task, seed)
    oracle = ReleasedOracle()
    t0 = time.perf_counter()
    r = run_dp(
        model,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=hooks,
        noise_multiplier=nm,
        batch_size=batch,
        steps=steps,
        seed=seed,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        max_grad_norm=clip,
        eval_at=checkpoints_at(cfg, steps) if phase == "eval" or cfg.tune_test_curve else [0, steps],
        oracle=False,
        per_param=False,
        grad_sample_mode=cfg.grad_sample_mode,
        allow_non_private=nm == 0.0,
        desc=f"{method} {optimizer} B{batch}",
        on_step=oracle if nm > 0 else None,
        eval_sets={"val": task.val},
        noise_mechanism=mechanism_of_method(method),
        **bed_options(cfg, task, batch, steps),
    )
    return {
        "method": method,
        "optimizer": optimizer,
        "batch": batch,
        "target_epsilon": eps,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "noise_multiplier": nm,
        "sample_rate": q,
        **outcome(r, oracle, nm, *accounting(method, q, steps)),
        "wall_seconds": time.perf_counter() - t0,
        "provenance": provenance(method, started),
    }


def provenance(method: str, started: str) -> dict[str, Any]:
    """Where and when a run was made (docs/results.md §12.G): the code state (:func:`dp_bench.meta.checkout`), its
    start and end (UTC), the sampler and adjacency its ε holds for, and the accountant with its package version."""
    import opacus

    return {
        **checkout(),
        "started": started,
        "ended": now_utc(),
        **sampler_of(method),
        "accountant": "prv",
        "accountant_version": f"opacus {opacus.__version__}",
    }


def code_state(p: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for runs to come from the same code: the commit and the uncommitted changes' digest."""
    return (p.get("commit"), p.get("dirty"), p.get("diff"))


def check_one_code_state(result: dict[str, Any], cfg: Config) -> tuple[Any, ...]:
    """This checkout's code state (:func:`code_state`). Refuses to add runs from a code state other than the stored
    runs' (a run without a record counts as another) unless ``--allow-mixed-commits``, which is recorded in
    ``result["mixed_commits"]``."""
    here = code_state(checkout())
    others = sorted({code_state(r.get("provenance", {})) for r in result["runs"].values()} - {here}, key=str)
    if not others:
        return here
    if not cfg.allow_mixed_commits:
        raise SystemExit(
            f"{cfg.name}: its stored runs come from other code ({', '.join(str(o[0])[:12] for o in others)}) than "
            f"this checkout ({str(here[0])[:12]}{', uncommitted changes' if here[1] else ''}); rerun from that code, "
            "or pass --allow-mixed-commits (recorded in the JSON)"
        )
    result.setdefault("mixed_commits", []).append(
        {"at": now_utc(), "commit": here[0], "dirty": here[1], "diff": here[2]}
    )
    return here


def choose(result: dict[str, Any], cfg: Config, method: str, parts: tuple[str, ...]) -> tuple[list[list[float]], bool]:
    """``(to run per tuning seed, final)`` of an arm's learning-rate choice in the cell ``parts`` (optimizer, B):
    :func:`dp_bench.runner.tune_round` over the ``--tune-seeds`` (first ``--lr-grid``, then the next value outward
    while the best mean validation lies at an end of what was tried, at most ``--lr-extensions`` times). A final
    choice is recorded in ``result["lr_choice"]``: the rate, the mean validation of every rate tried and, with
    several tuning seeds, each seed's."""
    optimizer, batch = parts
    cells = [Cell("tune", method, cfg.tune_epsilon, s, parts) for s in cfg.tune_seeds]
    base = cfg.lr_grid(optimizer, method)
    todo, best, tried = runner.tune_round(result["runs"], cells, base, cfg.lr_extensions, lambda r: r["final_val"])
    if best is None:
        return todo, False
    choice: dict[str, Any] = {"lr": best, "val": dict(sorted(tried.items()))}
    if len(cells) > 1:
        runs = result["runs"]
        choice["val_by_seed"] = {c.seed: {lr: runs[c.key(lr)]["final_val"] for lr in tried} for c in cells}
    result["lr_choice"][f"{method}|{optimizer}|{batch}"] = choice
    return todo, True


def tune_round(result: dict[str, Any], cfg: Config, cell: Cell) -> list[float]:
    """The learning rates of a tuning cell's open round that are not stored yet (``[]`` once its seed has run the
    round; the choice is final once every tuning seed has: :func:`choose`)."""
    todo, _ = choose(result, cfg, cell.method, cell.cell)
    return todo[cfg.tune_seeds.index(cell.seed)]


@dataclass
class GridSchedule:
    """The grid's part of the runner's schedule: a tuning cell runs its open round; an evaluation cell its cell's
    chosen rate once final (a reference's is the 'none' arm's without ``--tune-references``; with ``--no-tune`` its
    lr grid's one value)."""

    cfg: Config

    def lrs(self, cell: Cell, result: dict[str, Any]) -> list[float] | None:
        if cell.phase == "tune":
            return tune_round(result, self.cfg, cell)
        optimizer, batch = cell.cell
        if not self.cfg.tune:
            return self.cfg.lr_grid(optimizer, cell.method)  # its one value (validated)
        method = cell.method if self.cfg.tune_references or cell.method not in REFERENCES else "none"
        if not choose(result, self.cfg, method, cell.cell)[1]:
            return None  # its learning rate is still being chosen
        return [result["lr_choice"][f"{method}|{optimizer}|{batch}"]["lr"]]


def step_seconds(model_name: str, batch: int, mode: str, x: torch.Tensor, y: torch.Tensor) -> float:
    """Median seconds of a DP step of ``model_name`` at ``batch`` in per-sample-gradient ``mode`` (4 batches)."""
    from opacus_spectral import PrivacyEngine

    model = build(model_name, 0)
    data = torch.utils.data.TensorDataset(x[: batch * 4], y[: batch * 4])
    res = PrivacyEngine(accountant="prv").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
        post_hooks=[],
    )
    m, dp_opt, batches = res[0], res[1], list(res[-1])
    crit = res[2] if len(res) == 4 else nn.CrossEntropyLoss()

    def step(i: int, arm: Any) -> None:
        xb, yb = batches[i]
        dp_opt.zero_grad()
        crit(m(xb), yb).backward()
        dp_opt.step()

    return statistics.median(timed_steps(step, len(batches))[None])


def measure_speed(cfg: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """Median step time of ghost clipping vs hooks (per-sample gradients), per model and batch, same data
    (:func:`step_seconds`); written to ``<name>_speed.json``."""
    out = start("grid", cfg, argv)
    x, y = fashion_mnist_task(cfg.val_size).train.tensors
    out.update(threads=torch.get_num_threads(), cases={})
    for model_name in ("mlp", "cnn"):
        for batch in cfg.batches:
            times = {mode: step_seconds(model_name, batch, mode, x, y) for mode in ("hooks", "ghost")}
            case = {f"{k}_s_per_step": v for k, v in times.items()}
            case["speedup_ghost_vs_hooks"] = times["hooks"] / times["ghost"]
            out["cases"][f"{model_name}|B{batch}"] = case
            print(model_name, batch, case, flush=True)
    return runner.write(out, SPEED_REPORT, cfg.out / f"{cfg.name}_speed.json", indent=1)


def speed_tables(result: dict[str, Any]) -> str:
    """The ghost-vs-hooks table of ``--measure-speed``."""
    lines = ["| model | B | hooks s/step | ghost s/step | ghost speed-up |", "|---|---|---|---|---|"]
    for key, c in result["cases"].items():
        model, batch = key.split("|")
        lines.append(
            f"| {model} | {batch.removeprefix('B')} | {c['hooks_s_per_step']:.4f} | {c['ghost_s_per_step']:.4f} | "
            f"{c['speedup_ghost_vs_hooks']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


SPEED_REPORT = runner.Report(tables=speed_tables)


def planned(cfg: Config) -> list[Cell]:
    """The learning-rate cells first (none with ``--no-tune``), then seed-major evaluation cells (the references
    only on the first ``--reference-seeds`` seeds when it is set)."""
    methods = cfg.arms()
    tuned = [m for m in methods if cfg.tune and (cfg.tune_references or m not in REFERENCES)]
    tune = [
        cell_of("tune", m, o, b, cfg.tune_epsilon, s)
        for b in cfg.batches
        for o in cfg.optimizers
        for m in tuned
        for s in cfg.tune_seeds
    ]
    ref_seeds = set(cfg.seeds[: cfg.reference_seeds] if cfg.reference_seeds else cfg.seeds)
    evals = []
    for seed in cfg.seeds:
        for b in cfg.batches:
            for o in cfg.optimizers:
                for m in methods:
                    if m in REFERENCES and seed not in ref_seeds:
                        continue
                    for eps in [math.inf] if m in REFERENCES else cfg.epsilons:
                        evals.append(cell_of("eval", m, o, b, eps, seed))
    return tune + evals


#: the lists a ``--resume`` may extend: the grid grows by the new values (more ε, seeds, methods, batches or
#: optimizers), the stored runs and learning-rate choices are kept, and nothing stored may be dropped
GROWABLE = ("methods", "optimizers", "batches", "epsilons", "seeds")
#: counts that may only grow on ``--resume``: more extensions may move a tuning choice outward (the runs at the
#: old choice stay stored, superseded: :func:`dp_bench.commands.grid_report.evaluations`)
GROWABLE_COUNTS = ("lr_extensions",)


def resumable(stored: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a stored grid's configuration is this one, up to the execution settings (``resume``; ``threads``:
    the thread count changes only the order of float sums; ``out``: the folder of the JSON being resumed, an absolute
    path that differs between checkouts), options added since at their defaults, and the
    :data:`GROWABLE` lists, which may only grow (every stored value is still asked for), as may
    :data:`GROWABLE_COUNTS`. An option's default is the
    default on this bed (a setting another bed reads is recorded as None)."""
    defaults = as_json(Config(model=now["model"]))
    ignore = {"resume", "allow_mixed_commits", "threads", "out", *GROWABLE, *GROWABLE_COUNTS}
    if not same_config(stored, now, defaults=defaults, ignore=ignore):
        return False
    counts = all(stored.get(k, defaults[k]) <= now[k] for k in GROWABLE_COUNTS)
    return counts and all(set(stored.get(k, defaults[k])) <= set(now[k]) for k in GROWABLE)


def run(cfg: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """Train every planned run not yet stored through the one runner (:func:`dp_bench.runner.drive`). Several
    workers may run the same ``--resume`` command at once (one per core): a tuning round chooses once all its runs
    are stored; meanwhile a worker trains the next cell's tuning runs (:class:`GridSchedule`)."""
    from tqdm.auto import tqdm

    header = start("grid", cfg, argv)
    path = cfg.out / f"{cfg.name}.json"
    result: dict[str, Any] = runner.load(path, REPORT) if cfg.resume and path.is_file() else {"runs": {}}
    if cfg.resume and result.get("config") and not resumable(result["config"], header["config"]):
        raise SystemExit(
            f"--resume: {path} was made with another configuration (only {', '.join(GROWABLE + GROWABLE_COUNTS)} may "
            "grow, nothing stored may be dropped); use another --name"
        )
    if not cfg.resume and path.is_file():  # a fresh grid: nothing of an old JSON under this name is merged in
        path.replace(path.with_name(path.name + ".old"))
    task = load_task(cfg)
    n = len(task.train)
    result.setdefault("commands", [result["command"]] if "command" in result else [])
    result["commands"].append(header["command"])  # every invocation that built this JSON, in order
    result.update({**header, "data": task.info, "accountant": "prv (rdp beside it)"})
    here = check_one_code_state(result, cfg)
    store = SharedResult(path, result, upgrade=REPORT.upgrade)
    t_start = time.perf_counter()

    def train(cell: Cell, lr: float) -> dict[str, Any]:
        optimizer, batch = cell.cell
        b = int(batch.removeprefix("B"))
        rec = one_run(cfg, task, cell.method, optimizer, b, cell.eps, lr, cell.seed, budget(cfg, n, b), cell.phase)
        if code_state(rec["provenance"]) != here and not cfg.allow_mixed_commits:
            raise SystemExit(f"{cfg.name}: the code changed while the grid ran; the run {cell.key(lr)} is not stored")
        tqdm.write(f"{cell.key(lr):<44} val {rec['final_val']:.4f} ({rec['wall_seconds']:.0f}s)")  # no test score
        return rec

    runner.drive(store, planned(cfg), GridSchedule(cfg), train, desc=f"{cfg.name} grid")
    result["wall_seconds_this_invocation"] = time.perf_counter() - t_start
    out = runner.finish(result, REPORT, cfg.out / f"{cfg.name}.png", store.save, show=False)
    print(f"{cfg.name}: complete; its report (test scores): dp-bench grid --name {cfg.name} --out {cfg.out} --replot")
    return out


def config_of(stored: dict[str, Any]) -> Config:
    """The :class:`Config` a stored grid ran with (settings its bed does not read, recorded as None, at their
    defaults)."""
    names = {f.name for f in dataclasses.fields(Config)}
    cfg = Config(**{k: v for k, v in stored.items() if k in names and v is not None})
    cfg.out = Path(cfg.out)
    return cfg


def missing_cells(result: dict[str, Any]) -> int:
    """How many planned cells of a stored grid have no final run yet (0: complete): :func:`dp_bench.runner.next_run`
    with the grid's schedule over its stored runs."""
    cfg = config_of(result["config"])
    plan, schedule = planned(cfg), GridSchedule(cfg)
    done = runner.next_run(result["runs"], plan, schedule, {**result, "lr_choice": {}}, lambda k: False)[2]
    return len(plan) - done


def report(path: Path) -> dict[str, Any]:
    """``--replot``: the grid's report — test scores included — only once every planned run is stored (the
    choices on validation are then final: docs/results.md §12.G)."""
    missing = missing_cells(runner.load(path, REPORT))
    if missing:
        raise SystemExit(f"{path}: {missing} planned cells are not run yet; the report is printed once it is complete")
    return runner.replot(path, REPORT, path.with_suffix(".png"))


def report_for(result: dict[str, Any]) -> Any:
    """The report module of a stored grid (analyze, tables, plot): §10's perplexity report for the causal LM,
    the accuracy report otherwise."""
    return lm_report if result["config"].get("model") == "smollm2" else grid_report


class GridReport:
    """The grid's report (:class:`dp_bench.runner.Report`): :func:`report_for`'s, and a stored JSON's ``config``
    as it is recorded now (:func:`dp_bench.config.recorded_config`: settings the bed does not read are None)."""

    def upgrade(self, result: dict[str, Any]) -> dict[str, Any]:
        if "tune_seed" in result["config"]:  # grids before several tuning seeds (§12.G) tuned on one
            result["config"]["tune_seeds"] = [result["config"].pop("tune_seed")]
        result["config"] = recorded_config(result["config"], Config)
        return result

    def analyze(self, result: dict[str, Any]) -> dict[str, Any]:
        return report_for(result).analyze(result)

    def tables(self, result: dict[str, Any]) -> str:
        return report_for(result).tables(result)

    def plot(self, result: dict[str, Any], png: Path) -> None:
        report_for(result).plot(result, png)


REPORT = GridReport()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench grid", description=__doc__)
    if cfg.measure_speed:
        if cfg.replot:
            return runner.replot(cfg.out / f"{cfg.name}_speed.json", SPEED_REPORT, None)
        return measure_speed(cfg, argv)
    if cfg.replot:
        return report(cfg.out / f"{cfg.name}.json")
    return run(cfg, argv)
