"""One-run privacy audit (``opacus_spectral.audit``): ε_lower vs the accountant's ε, with and without denoisers,
and for deliberately broken engines (``docs/audit.md``).

The MLP (784 → 256 → 10) on Fashion-MNIST, DP-SGD with Poisson sampling through ``opacus_spectral.PrivacyEngine``.

* **White-box** (:class:`~opacus_spectral.audit.GradientCanaries`): m Dirac gradient canaries in the trainable
  weights, each included with probability ½ and, when included, present in *every* step (rate 1); scored by
  the sum over steps of the released (noisy, denoised) gradient at its coordinate. Their claim is the exact
  μ-GDP ε of T Gaussian steps, μ = √T/σ; σ is set from ``--mu`` so that the claim is small enough for a
  one-run audit to be able to refute it.
* **Black-box** (:class:`~opacus_spectral.audit.InputCanaries`): mislabeled validation images added to a
  training subset with probability ½, ordinary examples under Poisson sampling, scored by their loss on the
  final model; their claim is the engine's accountant ε.

Broken engines (no denoiser): ``sigma/K`` draws the noise with σ/K while the optimizer (hence the accountant)
reports σ; ``leak:W`` is a denoiser that adds W × the *clean* clipped gradient of the step to the noisy one.
Run (≈ 12 min on 2 busy cores)::

    nice -n 5 dp-bench audit
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.audit import GradientCanaries, InputCanaries
from opacus_spectral.calibration import clean_scale
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, PrivacyEngine, available_denoisers

from ..config import as_json, command_line, opt, parse_config
from ..meta import RESULTS, machine, quiet_warnings, versions
from ..task import fashion_mnist_task
from ..train import evaluate
from ..vision import build

#: method name -> post_hooks (lowpass needs an axis on plain weights: the MLP has no LoRA factors)
METHODS: dict[str, list[Any]] = {
    "none": [],
    "rmt": ["rmt_paper"],  # paper A's setting, as in the recorded audit
    "lowpass": [("lowpass", {"weight_axis": 1})],
    "ema+rmt": ["ema", "rmt_paper"],
    "doppler": ["doppler"],
}


@dataclass
class Config:
    methods: list[str] = opt(list(METHODS), "denoisers of the correct engine (doppler is skipped if not installed)")
    faults: list[str] = opt(["sigma/2", "sigma/4", "leak:1", "leak:3"], "broken engines: sigma/K or leak:W")
    canaries: int = opt(10000, "white-box: number of Dirac gradient canaries m")
    mu: float = opt(0.5, "white-box: μ = √steps/σ of a canary (sets σ; claimed ε ≈ 2.0 at μ = 0.5, δ = 1e-5)")
    steps: int = opt(25, "white-box: DP steps")
    batch: int = opt(1024, "expected batch size (Poisson)")
    physical_batch: int = opt(512, "largest physical batch (BatchMemoryManager)")
    lr: float = opt(2e-3, "Adam learning rate")
    delta: float = opt(1e-5, "δ of the claims and of the bound")
    confidence: float = opt(0.95, "confidence 1 − β of the bound")
    black_box: bool = opt(True, "also run the black-box audit")
    bb_methods: list[str] = opt(["none", "rmt", "leak:3"], "black-box: methods / faults")
    bb_train: int = opt(10000, "black-box: training examples (a fixed subset of the training split)")
    bb_canaries: int = opt(1000, "black-box: mislabeled canaries m (from the validation split)")
    bb_sigma: float = opt(1.0, "black-box: noise multiplier")
    bb_steps: int = opt(100, "black-box: DP steps")
    bb_batch: int = opt(500, "black-box: expected batch size")
    val_size: int = opt(5000, "Fashion-MNIST training images held out (the black-box canaries come from them)")
    seed: int = opt(0, "seed of the model, canaries, batches and noise")
    threads: int = opt(1, "torch threads")
    out: Path = opt(RESULTS / "audit.json", "result JSON")
    plot: Path = opt(RESULTS / "audit.png", "result plot (PNG)")

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
        for f in [*self.faults, *(m for m in self.bb_methods if m not in METHODS)]:
            parse_fault(f)


def parse_fault(name: str) -> tuple[str, float]:
    """``"sigma/K"`` → ``("sigma", K)``; ``"leak:W"`` → ``("leak", W)``."""
    kind, sep, value = name.replace("/", ":").partition(":")
    if kind not in ("sigma", "leak") or not sep:
        raise ValueError(f"a fault is 'sigma/K' or 'leak:W', got {name!r}")
    x = float(value)
    if not x > 0:
        raise ValueError(f"{name!r}: the factor must be positive")
    return kind, x


# ------------------------------------------------------------------------------------------------ faults
def scale_drawn_noise(dp_optimizer: Any, factor: float) -> None:
    """A broken engine: the noise is drawn with σ·factor, while the optimizer (and so the accountant, whose
    step hook runs after ``add_noise``) keeps reporting σ."""
    original = dp_optimizer.add_noise

    def add_noise() -> None:
        nm = dp_optimizer.noise_multiplier
        dp_optimizer.noise_multiplier = nm * factor
        try:
            original()
        finally:
            dp_optimizer.noise_multiplier = nm

    dp_optimizer.add_noise = add_noise


class CleanLeak(Denoiser):
    """A broken denoiser: it returns the noisy gradient plus ``weight`` × the step's clean clipped gradient,
    which it reaches through the optimizer (as a plugin keeping a view of ``p.grad`` once could)."""

    name = "clean-leak"

    def __init__(self, weight: float, dp_optimizer: Any = None) -> None:
        super().__init__()
        self.weight, self.optimizer = float(weight), dp_optimizer  # the optimizer is set after make_private

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[torch.Tensor]:
        params = [p for p in self.optimizer.params if p.grad is not None]  # the records' order
        scale = clean_scale(self.optimizer) * self.weight
        return [g.tensor + p.summed_grad.view_as(g.tensor) * scale for g, p in zip(grads, params, strict=True)]


# ------------------------------------------------------------------------------------------------ training
def train(
    model: nn.Module,
    data: torch.utils.data.Dataset,
    *,
    method: str,
    sigma: float,
    batch: int,
    physical: int,
    steps: int,
    lr: float,
    seed: int,
    white_box: int = 0,
) -> dict[str, Any]:
    """``steps`` DP-SGD steps of ``method`` (a denoiser list of :data:`METHODS` or a fault); returns the engine,
    the wrapped model, the gradient canaries (if ``white_box``) and the training time."""
    opt_ = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed + 1)  # the same batches and noise draws for every method of a seed
    engine = PrivacyEngine(accountant="prv")
    fault = None if method in METHODS else parse_fault(method)
    leak = CleanLeak(fault[1]) if fault is not None and fault[0] == "leak" else None
    hooks = list(METHODS[method]) if fault is None else [leak] if leak is not None else []
    module, dp_opt, loader = engine.make_private(
        module=model, optimizer=opt_, data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        noise_multiplier=sigma, max_grad_norm=1.0, poisson_sampling=True, post_hooks=hooks,
    )  # fmt: skip
    if leak is not None:
        leak.optimizer = dp_opt
    canaries = GradientCanaries(dp_opt, white_box, module=module, seed=seed) if white_box else None
    if fault is not None and fault[0] == "sigma":
        scale_drawn_noise(dp_opt, 1.0 / fault[1])
    done, t0 = 0, time.perf_counter()
    while done < steps:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=dp_opt) as mem:
            for x, y in mem:
                dp_opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(module(x), y).backward()
                dp_opt.step()
                if engine.post_hooks.logical_steps > done:  # not a virtual step of BatchMemoryManager
                    done += 1
                    if done >= steps:
                        break
    return {"engine": engine, "module": module, "canaries": canaries, "seconds": time.perf_counter() - t0}


def _kind(method: str) -> str:
    return "correct" if method in METHODS else "broken"


def white_box(cfg: Config, task: Any, methods: list[str]) -> list[dict[str, Any]]:
    sigma = cfg.steps**0.5 / cfg.mu
    rows = []
    for method in methods:
        run = train(build("mlp", cfg.seed), task.train, method=method, sigma=sigma, batch=cfg.batch,
                    physical=cfg.physical_batch, steps=cfg.steps, lr=cfg.lr, seed=cfg.seed,
                    white_box=cfg.canaries)  # fmt: skip
        can: GradientCanaries = run["canaries"]
        res = can.audit(delta=cfg.delta, confidence=cfg.confidence)
        claimed = can.claimed_epsilon(cfg.delta)
        rows.append({
            "method": method, "kind": _kind(method), "epsilon_lower": res.epsilon_lower,
            "epsilon_accountant": claimed, "above_accountant": bool(res.epsilon_lower > claimed),
            "epsilon_accountant_data": float(run["engine"].get_epsilon(cfg.delta)), "sigma": sigma,
            "steps": can.steps, **{k: v for k, v in res.as_dict().items() if k != "epsilon_lower"},
            "test_accuracy": evaluate(run["module"], task.test, None)["accuracy"], "train_seconds": run["seconds"],
        })  # fmt: skip
        can.remove()
        acc = rows[-1]["test_accuracy"]
        print(f"white-box {method:>8}: ε_lower {res.epsilon_lower:.3f} vs accountant {claimed:.3f} "
              f"({res.num_correct}/{res.num_guesses} right), acc {acc:.3f}", flush=True)  # fmt: skip
    return rows


def black_box(cfg: Config, task: Any) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(cfg.seed)
    x, y = task.train.tensors
    sub = torch.randperm(x.shape[0], generator=g)[: cfg.bb_train]
    vx, vy = task.val.tensors
    pick = torch.randperm(vx.shape[0], generator=g)[: cfg.bb_canaries]
    canaries = InputCanaries.mislabeled(vx[pick], vy[pick], 10, seed=cfg.seed)
    data = torch.utils.data.ConcatDataset([torch.utils.data.TensorDataset(x[sub], y[sub]), canaries.dataset()])
    rows = []
    for method in cfg.bb_methods:
        run = train(build("mlp", cfg.seed), data, method=method, sigma=cfg.bb_sigma, batch=cfg.bb_batch,
                    physical=cfg.physical_batch, steps=cfg.bb_steps, lr=cfg.lr, seed=cfg.seed)  # fmt: skip
        res = canaries.audit(run["module"], delta=cfg.delta, confidence=cfg.confidence)
        claimed = float(run["engine"].get_epsilon(cfg.delta))
        rows.append({
            "method": method, "kind": _kind(method), "epsilon_lower": res.epsilon_lower,
            "epsilon_accountant": claimed, "above_accountant": bool(res.epsilon_lower > claimed),
            **{k: v for k, v in res.as_dict().items() if k != "epsilon_lower"},
            "test_accuracy": evaluate(run["module"], task.test, None)["accuracy"], "train_seconds": run["seconds"],
        })  # fmt: skip
        print(f"black-box {method:>8}: ε_lower {res.epsilon_lower:.3f} vs accountant {claimed:.3f} "
              f"({res.num_correct}/{res.num_guesses} right)", flush=True)  # fmt: skip
    return rows


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(k, v) for k, v in res["audit"].items() if v]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], parts, strict=True):
        xs = list(range(len(rows)))
        lower = [r["epsilon_lower"] for r in rows]
        colors = ["tab:blue" if r["kind"] == "correct" else "tab:red" for r in rows]
        ax.bar(xs, lower, color=colors, label="ε_lower (one-run audit, 95 %)")
        ax.scatter(xs, [r["epsilon_accountant"] for r in rows], marker="_", s=900, color="black", zorder=3,
                   label="accountant's ε (the claim)")  # fmt: skip
        for x, v in zip(xs, lower, strict=True):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
        top = max([*lower, *(r["epsilon_accountant"] for r in rows)])
        ax.set_ylim(0, 1.2 * top)
        ax.set_xticks(xs, [r["method"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"ε at δ = {res['config']['delta']:g}")
        ax.set_title({"white_box": "white-box gradient canaries", "black_box": "black-box input canaries"}[name])
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, bbox_to_anchor=(0.5, 0.93), fontsize=9)
    fig.suptitle("One-run audit (blue: correct engine and denoisers, red: deliberately broken engine)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench audit", description=__doc__.split("\n")[0])
    quiet_warnings()
    torch.set_num_threads(cfg.threads)
    task = fashion_mnist_task(val_size=cfg.val_size)
    have = available_denoisers()
    methods = [m for m in cfg.methods if all((h if isinstance(h, str) else h[0]) in have for h in METHODS[m])]
    skipped = sorted(set(cfg.methods) - set(methods))
    if skipped:
        print(f"skipped (denoiser not installed): {skipped}")
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "command": command_line("audit", argv),
        "config": as_json(cfg),
        "versions": versions(),
        "machine": machine(),
        "skipped_methods": skipped,
        "audit": {
            "white_box": white_box(cfg, task, [*methods, *cfg.faults]),
            "black_box": black_box(cfg, task) if cfg.black_box else [],
        },
    }
    res["seconds"] = time.perf_counter() - t0
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(res, indent=2))
    plot(res, cfg.plot)
    print(f"wrote {cfg.out} and {cfg.plot} ({res['seconds']:.0f} s)")
    return res
