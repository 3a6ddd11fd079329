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
White-box rows carry both bounds: Steinke–Nasr–Jagielski's (ε, δ) test and the f-DP test of the μ-GDP claim.
Run (≈ 12 min on 2 busy cores)::

    nice -n 5 dp-bench audit

``--experiment fdp-validity``: the f-DP bound over many seeds (a small MLP on synthetic data, m = 2,000 white-box
canaries) — for every correct engine, does any run's lower bound exceed the accountant's ε, and how often is σ/2
caught — written to ``docs/results/audit_fdp.json`` (≈ 4 min)::

    nice -n 5 dp-bench audit --experiment fdp-validity

``--experiment fdp-bandmf``: the same over BandMF runs (correct b = 1 and 4, and κ = 2 claimed as 1; cyclic canaries
scored on the whitened release: :mod:`.audit_bandmf`), written to ``docs/results/audit_fdp_bandmf.json`` (≈ 30 s).

``--replot`` (with any experiment): the tables and the plot again from its JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus_spectral.audit import GradientCanaries, InputCanaries, audit_scores, gaussian_dp_epsilon
from opacus_spectral.mechanisms.certificate import certificate_of
from opacus_spectral.step.oracle import clean_gradients
from torch import nn

from opacus_spectral import Denoiser, NoisyGradient, available_denoisers

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..task import fashion_mnist_task
from ..train import evaluate, run_dp
from ..vision import build

#: method name -> post_hooks (lowpass needs an axis on plain weights: the MLP has no LoRA factors)
METHODS: dict[str, list[Any]] = {
    "none": [],
    "rmt": ["rmt_paper"],  # paper A's setting, as in the recorded audit
    "lowpass": [("lowpass", {"weight_axis": 1})],
    "ema": ["ema"],
    "ema+rmt": ["ema", "rmt_paper"],
    "doppler": ["doppler"],
}


@dataclass
class Config:
    experiment: str = opt(
        "audit",
        "audit: one seed, every method; fdp-validity: the f-DP bound over many seeds; fdp-bandmf: the same on "
        "BandMF runs (docs/audit.md, BandMF)",
        choices=("audit", "fdp-validity", "fdp-bandmf"),
    )
    methods: list[str] = opt(
        ["none", "rmt", "lowpass", "ema+rmt", "doppler"],
        "denoisers of the correct engine (doppler is skipped if not installed)",
    )
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
    fv_seeds: int = opt(50, "fdp-validity: seeds (runs) per method")
    fv_methods: list[str] = opt(["none", "rmt", "ema", "lowpass"], "fdp-validity: correct engines")
    fv_faults: list[str] = opt(["sigma/2"], "fdp-validity: broken engines (how often each is caught)")
    fv_canaries: int = opt(2000, "fdp-validity: Dirac gradient canaries m")
    fv_train: int = opt(2048, "fdp-validity: synthetic training examples (64 Gaussian features, 10 labels)")
    fv_batch: int = opt(128, "fdp-validity: expected batch size")
    fv_simulated: int = opt(500, "fdp-validity: draws of ideal μ-GDP canaries (scores μ·S + N(0, 1)); 0: none")
    fv_out: Path = opt(RESULTS / "audit_fdp.json", "fdp-validity: result JSON")
    fv_plot: Path = opt(RESULTS / "audit_fdp.png", "fdp-validity: result plot (PNG)")
    bm_arms: list[str] = opt(
        ["bandmf:1", "bandmf:4", "bandmf:4:kappa=2"],
        "fdp-bandmf: arms 'bandmf:<b>' (correct) or 'bandmf:<b>:kappa=<K>' (coefficients × K, claimed κ = 1)",
    )
    bm_groups: str = opt(
        "first",
        "fdp-bandmf: the canaries' groups: first (all in group 0, the steps the accounting charges) or spread "
        "(canary i in group i mod b)",
        choices=("first", "spread"),
    )
    bm_out: Path = opt(RESULTS / "audit_fdp_bandmf.json", "fdp-bandmf: result JSON")
    bm_plot: Path = opt(RESULTS / "audit_fdp_bandmf.png", "fdp-bandmf: result plot (PNG)")
    replot: bool = opt(False, "only the tables and the plot from the experiment's JSON")

    def validate(self) -> None:
        unknown = [m for m in [*self.methods, *self.fv_methods] if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
        for f in [*self.faults, *self.fv_faults, *(m for m in self.bb_methods if m not in METHODS)]:
            parse_fault(f)
        from .audit_bandmf import parse_arm

        for arm in self.bm_arms:
            parse_arm(arm)
        if self.fv_seeds < 1:
            raise ValueError(f"--fv-seeds must be >= 1, got {self.fv_seeds}")


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
    step hook runs after ``add_noise``) keeps reporting σ. The engine's noise certificate would stop such a step
    before its update (``docs/mechanisms.md``); the audit measures a broken engine that has none, so it is switched
    off here, on purpose."""
    original = dp_optimizer.add_noise
    certificate = certificate_of(dp_optimizer)
    if certificate is not None:
        certificate.check = lambda optimizer: None

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
        clean = clean_gradients(self.optimizer, params)
        return [g.tensor + self.weight * c for g, c in zip(grads, clean, strict=True)]


# ------------------------------------------------------------------------------------------------ training
def train(
    model: nn.Module,
    data: torch.utils.data.Dataset,
    *,
    method: str,
    noise_multiplier: float,
    batch: int,
    physical: int,
    steps: int,
    lr: float,
    seed: int,
    white_box: int = 0,
    delta: float = 1e-5,
    noise_mechanism: Any = None,
    make_canaries: Callable[..., GradientCanaries] = GradientCanaries,
) -> dict[str, Any]:
    """``steps`` DP-SGD steps (Adam, PRV accountant) of ``method`` (a denoiser list of :data:`METHODS` or a fault)
    through dp-bench's one DP loop (:func:`~dp_bench.train.run_dp`, paired noise: ``noise_seed = seed + 1``);
    returns the wrapped model, the gradient canaries (if ``white_box``; built by ``make_canaries``), the accountant's
    ε at ``delta`` and the training time. ``noise_mechanism``: ``make_private``'s (default DP-SGD)."""
    fault = None if method in METHODS else parse_fault(method)
    leak = CleanLeak(fault[1]) if fault is not None and fault[0] == "leak" else None
    hooks = list(METHODS[method]) if fault is None else [leak] if leak is not None else []
    attached: dict[str, Any] = {}

    def attach(module: nn.Module, dp_opt: Any) -> None:
        if leak is not None:
            leak.optimizer = dp_opt
        attached["module"] = module
        attached["canaries"] = make_canaries(dp_opt, white_box, module=module, seed=seed) if white_box else None
        if fault is not None and fault[0] == "sigma":
            scale_drawn_noise(dp_opt, 1.0 / fault[1])

    res = run_dp(
        model,
        data,
        data,
        input_names=None,
        post_hooks=hooks,
        noise_multiplier=noise_multiplier,
        batch_size=batch,
        steps=steps,
        seed=seed,
        lr=lr,
        optimizer="adam",
        physical_batch=physical,
        oracle=False,
        per_param=False,
        delta=delta,
        desc=f"audit {method}",
        on_private=attach,
        noise_mechanism=noise_mechanism,
    )
    return {**attached, "epsilon": res["epsilon"], "seconds": res["train_seconds"]}


def _kind(method: str) -> str:
    return "correct" if method in METHODS else "broken"


def white_box(cfg: Config, task: Any, methods: list[str]) -> list[dict[str, Any]]:
    noise_multiplier = cfg.steps**0.5 / cfg.mu
    rows = []
    for method in methods:
        run = train(
            build("mlp", cfg.seed),
            task.train,
            method=method,
            noise_multiplier=noise_multiplier,
            batch=cfg.batch,
            physical=cfg.physical_batch,
            steps=cfg.steps,
            lr=cfg.lr,
            seed=cfg.seed,
            white_box=cfg.canaries,
            delta=cfg.delta,
        )
        can: GradientCanaries = run["canaries"]
        res = can.audit(delta=cfg.delta, confidence=cfg.confidence)
        fdp = can.audit(delta=cfg.delta, confidence=cfg.confidence, bound="fdp")
        claimed = can.claimed_epsilon(cfg.delta)
        rows.append(
            {
                "method": method,
                "kind": _kind(method),
                "epsilon_lower": res.epsilon_lower,
                "epsilon_accountant": claimed,
                "above_accountant": bool(res.epsilon_lower > claimed),
                "epsilon_lower_fdp": fdp.epsilon_lower,
                "mu_lower_fdp": fdp.mu_lower,
                "mu_accountant": can.claimed_mu(),
                "above_accountant_fdp": bool(fdp.epsilon_lower > claimed),
                "fdp_guesses": fdp.num_guesses,
                "fdp_correct": fdp.num_correct,
                "epsilon_accountant_data": float(run["epsilon"]),
                "sigma": noise_multiplier,  # the noise multiplier (key kept: stored results replot)
                "steps": can.steps,
                **{k: v for k, v in res.as_dict().items() if k != "epsilon_lower"},
                "test_accuracy": evaluate(run["module"], task.test, None)["accuracy"],
                "train_seconds": run["seconds"],
            }
        )
        can.remove()
        acc = rows[-1]["test_accuracy"]
        print(
            f"white-box {method:>8}: ε_lower {res.epsilon_lower:.3f} (f-DP {fdp.epsilon_lower:.3f}) vs accountant "
            f"{claimed:.3f} ({res.num_correct}/{res.num_guesses} right), acc {acc:.3f}",
            flush=True,
        )
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
        run = train(
            build("mlp", cfg.seed),
            data,
            method=method,
            noise_multiplier=cfg.bb_sigma,
            batch=cfg.bb_batch,
            physical=cfg.physical_batch,
            steps=cfg.bb_steps,
            lr=cfg.lr,
            seed=cfg.seed,
            delta=cfg.delta,
        )
        res = canaries.audit(run["module"], delta=cfg.delta, confidence=cfg.confidence)
        claimed = float(run["epsilon"])
        rows.append(
            {
                "method": method,
                "kind": _kind(method),
                "epsilon_lower": res.epsilon_lower,
                "epsilon_accountant": claimed,
                "above_accountant": bool(res.epsilon_lower > claimed),
                **{k: v for k, v in res.as_dict().items() if k != "epsilon_lower"},
                "test_accuracy": evaluate(run["module"], task.test, None)["accuracy"],
                "train_seconds": run["seconds"],
            }
        )
        print(
            f"black-box {method:>8}: ε_lower {res.epsilon_lower:.3f} vs accountant {claimed:.3f} "
            f"({res.num_correct}/{res.num_guesses} right)",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------------ f-DP validity
def validity_run(cfg: Config, data: torch.utils.data.Dataset, method: str, seed: int) -> dict[str, Any]:
    """One seed of one method: both bounds against the canaries' claim (a fresh model, canaries and noise)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(data.tensors[0].shape[1], 64), nn.Tanh(), nn.Linear(64, 10))
    run = train(
        model,
        data,
        method=method,
        noise_multiplier=cfg.steps**0.5 / cfg.mu,
        batch=cfg.fv_batch,
        physical=cfg.fv_batch,
        steps=cfg.steps,
        lr=cfg.lr,
        seed=seed,
        white_box=cfg.fv_canaries,
    )
    can: GradientCanaries = run["canaries"]
    snj = can.audit(delta=cfg.delta, confidence=cfg.confidence)
    fdp = can.audit(delta=cfg.delta, confidence=cfg.confidence, bound="fdp")
    claimed = can.claimed_epsilon(cfg.delta)
    can.remove()
    return {
        "method": method,
        "kind": _kind(method),
        "seed": seed,
        "epsilon_accountant": claimed,
        "mu_accountant": can.claimed_mu(),
        **bound_fields(snj, fdp, claimed),
    }


def bound_fields(snj: Any, fdp: Any, claimed: float) -> dict[str, Any]:
    """A validity run's record of its two lower bounds (SNJ, f-DP) and whether each exceeds the claimed ε."""
    return {
        "epsilon_lower_snj": snj.epsilon_lower,
        "epsilon_lower_fdp": fdp.epsilon_lower,
        "mu_lower_fdp": fdp.mu_lower,
        "fdp_guesses": fdp.num_guesses,
        "fdp_correct": fdp.num_correct,
        "above_snj": bool(snj.epsilon_lower > claimed),
        "above_fdp": bool(fdp.epsilon_lower > claimed),
    }


def validity_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: runs, how many lower bounds exceeded the claim (caught, for a broken engine), the largest bound."""
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        out[method] = {"kind": mine[0]["kind"], "runs": len(mine), "epsilon_accountant": mine[0]["epsilon_accountant"]}
        for b in ("fdp", "snj"):
            lower = [r[f"epsilon_lower_{b}"] for r in mine]
            out[method] |= {
                f"above_{b}": sum(r[f"above_{b}"] for r in mine),
                f"max_epsilon_lower_{b}": max(lower),
                f"median_epsilon_lower_{b}": float(np.median(lower)),
            }
    return out


def simulated(cfg: Config) -> dict[str, dict[str, Any]]:
    """Ideal μ-GDP canaries — score μ·S_i + N(0, 1), the sum score without data or denoisers — at the claim's μ
    and at 2μ (σ/2): both bounds over ``fv_simulated`` draws, the same guesses and confidence as the runs."""
    rng, m, claim = np.random.default_rng(cfg.seed), cfg.fv_canaries, gaussian_dp_epsilon(cfg.mu, cfg.delta)
    out = {}
    for name, mu in (("correct", cfg.mu), ("sigma/2", 2 * cfg.mu)):
        lower: dict[str, list[float]] = {"snj": [], "fdp": []}
        for _ in range(cfg.fv_simulated):
            inc = rng.random(m) < 0.5
            scores = mu * inc + rng.standard_normal(m)
            for b in lower:
                lower[b].append(
                    audit_scores(scores, inc, delta=cfg.delta, confidence=cfg.confidence, bound=b).epsilon_lower
                )
        out[name] = {"mu": mu, "runs": cfg.fv_simulated, "epsilon_accountant": claim}
        for b, xs in lower.items():
            out[name] |= {
                f"above_{b}": int(np.sum(np.array(xs) > claim)),
                f"max_epsilon_lower_{b}": max(xs),
                f"median_epsilon_lower_{b}": float(np.median(xs)),
            }
    return out


def validity_data(cfg: Config) -> torch.utils.data.TensorDataset:
    """The validity experiment's synthetic training set: ``fv_train`` Gaussian inputs (64 features), 10 labels."""
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.fv_train, 64, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 10, (cfg.fv_train,), generator=g))


def fdp_validity(cfg: Config) -> dict[str, Any]:
    data = validity_data(cfg)
    rows = []
    for method in [*cfg.fv_methods, *cfg.fv_faults]:
        for seed in range(cfg.seed, cfg.seed + cfg.fv_seeds):
            rows.append(validity_run(cfg, data, method, seed))
        s = validity_summary(rows)[method]
        print(
            f"{method:>8}: ε_lower > {s['epsilon_accountant']:.3f} in {s['above_fdp']}/{s['runs']} runs (f-DP), "
            f"{s['above_snj']}/{s['runs']} (SNJ); largest {s['max_epsilon_lower_fdp']:.3f} / "
            f"{s['max_epsilon_lower_snj']:.3f}",
            flush=True,
        )
    sim = simulated(cfg) if cfg.fv_simulated else {}
    for name, r in sim.items():
        print(
            f"simulated {name}: ε_lower > claim in {r['above_fdp']}/{r['runs']} (f-DP), {r['above_snj']}/"
            f"{r['runs']} (SNJ); medians {r['median_epsilon_lower_fdp']:.3f} / {r['median_epsilon_lower_snj']:.3f}"
        )
    return {"rows": rows, "summary": validity_summary(rows), "simulated": sim}


def plot_validity(
    res: dict[str, Any],
    path: Path,
    *,
    key: str = "fdp_validity",
    what: str = "gradient canaries (red: noise drawn with σ/2)",
) -> None:
    """Every run's two bounds per method, the claim as a line; ``key``: the experiment's part of ``res``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, summary = res[key]["rows"], res[key]["summary"]
    fig, ax = plt.subplots(figsize=(1.6 * len(summary) + 3, 4.4))
    for i, method in enumerate(summary):
        mine = [r for r in rows if r["method"] == method]
        jitter = np.linspace(-0.12, 0.12, len(mine))
        ax.scatter(
            i - 0.17 + jitter,
            [r["epsilon_lower_snj"] for r in mine],
            s=12,
            color="tab:gray",
            label="SNJ (ε, δ) bound" if i == 0 else None,
        )
        ax.scatter(
            i + 0.17 + jitter,
            [r["epsilon_lower_fdp"] for r in mine],
            s=12,
            color="tab:blue" if summary[method]["kind"] == "correct" else "tab:red",
            label="f-DP bound" if i == 0 else None,
        )
    claim = next(iter(summary.values()))["epsilon_accountant"]
    ax.axhline(claim, color="black", lw=1, label=f"accountant's ε = {claim:.3f}")
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(summary)), list(summary))
    ax.set_ylabel(f"ε_lower at δ = {res['config']['delta']:g} (95 %)")
    ax.set_title(
        f"One-run audit over {res['config']['fv_seeds']} seeds, m = {res['config']['fv_canaries']} {what}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(k, v) for k, v in res["audit"].items() if v]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], parts, strict=True):
        xs = np.arange(len(rows))
        colors = ["tab:blue" if r["kind"] == "correct" else "tab:red" for r in rows]
        bars = [("epsilon_lower", "ε_lower, SNJ (ε, δ) bound", 0.45)]  # (key, label, alpha)
        if all("epsilon_lower_fdp" in r for r in rows):  # white-box: the f-DP bound beside it
            bars.append(("epsilon_lower_fdp", "ε_lower, f-DP bound", 1.0))
        width = 0.8 / len(bars)
        for j, (key, label, alpha) in enumerate(bars):
            at = xs + (j - (len(bars) - 1) / 2) * width
            ax.bar(at, [r[key] for r in rows], width, color=colors, alpha=alpha, label=f"{label} (95 %)")
            for x, r in zip(at, rows, strict=True):
                ax.annotate(f"{r[key]:.2f}", (x, r[key]), ha="center", va="bottom", fontsize=7)
        ax.scatter(
            xs,
            [r["epsilon_accountant"] for r in rows],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="accountant's ε (the claim)",
        )
        top = max(r[k] for r in rows for k in ("epsilon_accountant", *(b[0] for b in bars)))
        ax.set_ylim(0, 1.2 * top)
        ax.set_xticks(xs, [r["method"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"ε at δ = {res['config']['delta']:g}")
        ax.set_title({"white_box": "white-box gradient canaries", "black_box": "black-box input canaries"}[name])
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.93), fontsize=9)
    fig.suptitle("One-run audit (blue: correct engine and denoisers, red: deliberately broken engine)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def audit_tables(res: dict[str, Any]) -> str:
    """ε_lower (SNJ, and f-DP for the white-box canaries) beside the accountant's ε, per method and fault."""
    lines = []
    for part in ("white_box", "black_box"):
        rows = res["audit"].get(part) or []
        if not rows:
            continue
        lines += [
            f"#### {part.replace('_', '-')}",
            "",
            "| method | kind | ε_lower (SNJ) | ε_lower (f-DP) | accountant's ε | above it | test accuracy |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            fdp = f"{r['epsilon_lower_fdp']:.3f}" if "epsilon_lower_fdp" in r else "–"
            above = r["above_accountant"] or r.get("above_accountant_fdp", False)
            lines.append(
                f"| {r['method']} | {r['kind']} | {r['epsilon_lower']:.3f} | {fdp} | {r['epsilon_accountant']:.3f} | "
                f"{'yes' if above else 'no'} | {r['test_accuracy']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def validity_tables(res: dict[str, Any], key: str = "fdp_validity") -> str:
    """Per engine (and the simulated ideal canaries): runs whose ε_lower exceeded the claim, largest and median."""
    fv = res[key]
    lines = [
        "| engine | kind | runs | above the claim (f-DP / SNJ) | largest ε_lower (f-DP / SNJ) | median (f-DP / SNJ) |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(m, s["kind"], s) for m, s in fv["summary"].items()]
    rows += [(f"simulated {name}", "ideal", s) for name, s in fv.get("simulated", {}).items()]
    for name, kind, s in rows:
        lines.append(
            f"| {name} | {kind} | {s['runs']} | {s['above_fdp']} / {s['above_snj']} | "
            f"{s['max_epsilon_lower_fdp']:.3f} / {s['max_epsilon_lower_snj']:.3f} | "
            f"{s['median_epsilon_lower_fdp']:.3f} / {s['median_epsilon_lower_snj']:.3f} |"
        )
    return "\n".join(lines) + "\n"


#: the runner's report protocol of each experiment
REPORT = runner.Report(tables=audit_tables, plot=plot)
VALIDITY_REPORT = runner.Report(tables=validity_tables, plot=plot_validity)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench audit", description=__doc__)
    from . import audit_bandmf

    if cfg.replot:
        if cfg.experiment == "fdp-validity":
            return runner.replot(cfg.fv_out, VALIDITY_REPORT, cfg.fv_plot)
        if cfg.experiment == "fdp-bandmf":
            return runner.replot(cfg.bm_out, audit_bandmf.REPORT, cfg.bm_plot)
        return runner.replot(cfg.out, REPORT, cfg.plot)
    header = start("audit", cfg, argv)
    if cfg.experiment == "fdp-validity":
        return validity_main(cfg, header)
    if cfg.experiment == "fdp-bandmf":
        return audit_bandmf.main(cfg, header)
    task = fashion_mnist_task(val_size=cfg.val_size)
    have = available_denoisers()
    methods = [m for m in cfg.methods if all((h if isinstance(h, str) else h[0]) in have for h in METHODS[m])]
    skipped = sorted(set(cfg.methods) - set(methods))
    if skipped:
        print(f"skipped (denoiser not installed): {skipped}")
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        **header,
        "skipped_methods": skipped,
        "audit": {
            "white_box": white_box(cfg, task, [*methods, *cfg.faults]),
            "black_box": black_box(cfg, task) if cfg.black_box else [],
        },
    }
    res["seconds"] = time.perf_counter() - t0
    runner.write(res, REPORT, cfg.out, cfg.plot, indent=2)
    print(f"wrote {cfg.out} and {cfg.plot} ({res['seconds']:.0f} s)")
    return res


def validity_main(cfg: Config, header: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    res: dict[str, Any] = {**header, "fdp_validity": fdp_validity(cfg)}
    res["seconds"] = time.perf_counter() - t0
    runner.write(res, VALIDITY_REPORT, cfg.fv_out, cfg.fv_plot, indent=2)
    print(f"wrote {cfg.fv_out} and {cfg.fv_plot} ({res['seconds']:.0f} s)")
    return res
