"""Regime map of ``rmt`` on a pretrained decoder: where can per-step spectral denoising act on SmolLM2's LoRA?

    nice dp-bench regime-map-llm                       # SmolLM2-135M + Shakespeare (docs/results.md §10.1)
    dp-bench regime-map-llm --model tiny --batches 4 8 --warm-steps 2 --out /tmp/rm   # plumbing
    dp-bench regime-map-llm --replot                   # tables + PNG from docs/results/regime_map_llm.json

Protocol (docs/results.md §10.1, written before the run):

* Bed: §10's — SmolLM2-135M-Instruct, DP-LoRA r = 32, α = 64 on ``q_proj`` / ``v_proj`` of all 30 layers (120
  matrices), 32-token Shakespeare training blocks, :func:`opacus_spectral.causal_lm_loss`, Opacus DP-SGD with
  Poisson sampling (:func:`dp_bench.train.run_dp`, physical batches of ``--physical-batch``).
* Two points of training: ``init`` (the fresh adapter: B = 0, so the clean gradient of every ``lora_A`` is exactly
  0) and ``warm`` (after ``--warm-steps`` DP steps at B = ``--warm-batch``, C = 1, AdamW ``--warm-lr``, the §10
  noise multiplier; the same seed's batches and noise).
* At each point, for every B of ``--batches`` and C of ``--clips``: ``--sweep-steps`` DP steps at learning rate 0
  (independent draws of batch and noise at the same weights) with the noise multiplier that spends ε =
  ``--epsilon`` (δ = 1e-5, PRV) over ``--budget-steps`` steps at that B — per-entry noise std s = nm·C/B. No
  denoiser runs inside the step: on each step's released (noisy) gradient and its clean clipped counterpart (the
  engine's ``summed_grad``), both paper A's setting (``rmt_paper``) and the library default (``rmt``) are applied
  offline to every matrix (:func:`opacus_spectral.denoisers.rmt.rmt_denoise`), so both see the same noisy gradient.
* Per matrix: gated or not (each setting); σ₁(noisy) / bulk edge s(√m + √n) (what the gate sees; the noise alone
  sits at ≈ 1); σ₁(clean) / s(mn)^¼ (the BBP phase transition: above 1 a spike is detectable at all); cos(released,
  clean) with no denoiser and with each setting. Reported per cell: the share of matrices gated, the global
  cosines, and the ratios by module type (q/v × A/B) and by depth (layers in thirds).
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import runner
from ..config import opt, parse_config, start
from ..lm_task import LMTask, lora_model, run_options, smollm2_shakespeare_task, tiny_lm_task
from ..meta import RESULTS
from ..store import atomic_write_json
from ..train import run_dp

#: the settings applied offline (paper A's and the library default), and the arms of the cosines
SETTINGS = ("rmt_paper", "rmt")
ARMS = ("none", *SETTINGS)
_LAYER = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|v_proj)\.(lora_A|lora_B)")


@dataclass
class Config:
    model: str = opt("smollm2", "smollm2 (packaged SmolLM2-135M) or tiny (random Llama)", choices=("smollm2", "tiny"))
    batches: list[int] = opt([64, 256, 1024, 2000], "expected Poisson batch sizes of the sweep")
    clips: list[float] = opt([1.0, 10.0], "clipping bounds C of the sweep", type=float)
    epsilon: float = opt(5.4, "ε (δ = 1e-5) each B's noise multiplier spends over --budget-steps steps")
    budget_steps: int = opt(50, "steps of the budget the noise multiplier is calibrated for")
    sweep_steps: int = opt(1, "DP steps at lr 0 per (point, B, C)")
    warm_steps: int = opt(50, "DP steps from the fresh adapter to the warm point")
    warm_batch: int = opt(64, "expected batch of the warm-up steps")
    warm_lr: float = opt(1e-3, "AdamW lr of the warm-up steps")
    physical_batch: int = opt(16, "physical batch (BatchMemoryManager)")
    block_size: int = opt(32, "tokens per block")
    seed: int = opt(0, "seed (adapter init, batches, noise)")
    threads: int = opt(0, "torch threads (0: torch's choice)")
    out: Path = opt(RESULTS / "regime_map_llm.json", "result JSON (the PNG beside it)")
    replot: bool = opt(False, "only the tables and the PNG from --out")

    def validate(self) -> None:
        if min(self.batches) < 1 or min(self.clips) <= 0 or self.sweep_steps < 1 or self.warm_steps < 1:
            raise ValueError("batches, clips and step counts must be positive")


def matrix_key(name: str) -> tuple[int, str] | None:
    """(layer, "q_proj.lora_A" ...) of a LoRA factor's parameter name; None for anything else."""
    m = _LAYER.search(name)
    return (int(m.group(1)), f"{m.group(2)}.{m.group(3)}") if m else None


class SpectrumProbe:
    """``run_dp``'s ``on_step``: per logical step, per LoRA matrix, the gate of each setting, the spike-to-edge
    and BBP ratios and the cosines of the released gradient (no denoiser / each setting) to the clean one."""

    def __init__(self, names: dict[int, str]) -> None:
        from opacus_spectral.denoisers.rmt import PAPER_SETTINGS, RMTSettings

        self.names = names
        self.settings = {"rmt_paper": PAPER_SETTINGS, "rmt": RMTSettings()}
        self.steps: list[dict[str, Any]] = []

    def __call__(self, step: int, entry: dict[str, Any], dp_opt: Any) -> None:
        from opacus_spectral.denoisers.rmt import rmt_denoise
        from opacus_spectral.denoisers.rmt.spectral import bbp_threshold, bulk_edge
        from opacus_spectral.step.noise_std import noise_std
        from opacus_spectral.step.oracle import clean_gradients, cosine

        s = noise_std(dp_opt)
        params = [p for p in dp_opt.params if id(p) in self.names and p.grad is not None and p.dim() == 2]
        mats, flat = [], defaultdict(list)
        for p, clean in zip(params, clean_gradients(dp_opt, params, dtype=torch.float64), strict=True):
            noisy = p.grad.detach().double()
            m, n = noisy.shape
            rec = {"name": self.names[id(p)], "shape": [m, n], "cos": {"none": cosine([noisy], [clean])}, "gated": {}}
            rec["edge_ratio"] = float(torch.linalg.matrix_norm(noisy, ord=2)) / bulk_edge(s, m, n)
            rec["bbp_ratio"] = float(torch.linalg.matrix_norm(clean, ord=2)) / bbp_threshold(s, m, n)
            flat["none"].append(noisy.reshape(-1))
            for arm, settings in self.settings.items():
                res = rmt_denoise(noisy, s, settings)
                rec["gated"][arm] = bool(res.gated.item())
                rec["cos"][arm] = cosine([res.tensor], [clean])
                flat[arm].append(res.tensor.reshape(-1))
            flat["clean"].append(clean.reshape(-1))
            mats.append(rec)
        self.steps.append(
            {
                "step": step,
                "noise_std": s,
                "matrices": mats,
                "cos_global": {arm: cosine(flat[arm], flat["clean"]) for arm in ARMS},
            }
        )


def load_task(cfg: Config) -> LMTask:
    if cfg.model == "tiny":
        return tiny_lm_task(n_train=256, block_size=cfg.block_size)
    return smollm2_shakespeare_task(cfg.block_size, val_blocks=8, test_blocks=64)


def lora_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad and matrix_key(n) is not None}


def calibrated(cfg: Config, batch: int, n_train: int) -> float:
    """The noise multiplier spending ``--epsilon`` over ``--budget-steps`` steps at q = B / N (PRV)."""
    return _calibrated(cfg.epsilon, batch / n_train, cfg.budget_steps)


@functools.cache
def _calibrated(epsilon: float, q: float, steps: int) -> float:
    from opacus_spectral import noise_multiplier_for

    return noise_multiplier_for(target_epsilon=epsilon, target_delta=1e-5, sample_rate=q, steps=steps, accountant="prv")


def _dp(task: LMTask, model: torch.nn.Module, cfg: Config, **kw: Any) -> dict[str, Any]:
    """``run_dp`` without a denoiser on the causal LM (:func:`dp_bench.lm_task.run_options`)."""
    return run_dp(
        model,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=[],
        physical_batch=cfg.physical_batch,
        oracle=False,
        per_param=False,
        **run_options(task),
        **kw,
    )


def sweep_cell(task: LMTask, cfg: Config, state: dict[str, torch.Tensor], batch: int, clip: float) -> dict[str, Any]:
    """``--sweep-steps`` steps at lr 0 from ``state`` (the adapter's weights) at (B, C), probed."""
    model = lora_model(task, cfg.seed)
    load_adapter(model, state)
    probe = SpectrumProbe(lora_names(model))
    nm = calibrated(cfg, batch, len(task.train))
    t0 = time.perf_counter()
    _dp(
        task,
        model,
        cfg,
        noise_multiplier=nm,
        batch_size=batch,
        steps=cfg.sweep_steps,
        seed=cfg.seed + 1000 + batch,
        lr=0.0,
        max_grad_norm=clip,
        on_step=probe,
        desc=f"B={batch} C={clip:g}",
    )
    return {
        "batch": batch,
        "clip": clip,
        "noise_multiplier": nm,
        "steps": probe.steps,
        "seconds": time.perf_counter() - t0,
    }


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (:func:`adapter_state`) into ``model``'s trainable parameters; every entry must land."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if params.keys() != state.keys():
        raise ValueError(f"adapter mismatch: {sorted(params.keys() ^ state.keys())[:4]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])


def warm_state(task: LMTask, cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter after ``--warm-steps`` DP steps (B = ``--warm-batch``, C = 1), and that run's record."""
    model = lora_model(task, cfg.seed)
    nm = calibrated(cfg, cfg.warm_batch, len(task.train))
    r = _dp(
        task,
        model,
        cfg,
        noise_multiplier=nm,
        batch_size=cfg.warm_batch,
        steps=cfg.warm_steps,
        seed=cfg.seed,
        lr=cfg.warm_lr,
        max_grad_norm=1.0,
        eval_at=[0, cfg.warm_steps],
        desc="warm-up",
    )
    info = {"noise_multiplier": nm, "epsilon": r["epsilon"], "lr": cfg.warm_lr}
    return adapter_state(model), info | {"test_perplexity": [(s, math.exp(-v)) for s, v in r["curve"]]}


def run(cfg: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    header = start("regime-map-llm", cfg, argv)
    t_start = time.perf_counter()
    task = load_task(cfg)
    result: dict[str, Any] = {**header, "data": task.info, "points": {}}
    png = cfg.out.with_suffix(".png")
    init = adapter_state(lora_model(task, cfg.seed))
    warm, result["warm_up"] = warm_state(task, cfg)
    for point, state in (("init", init), ("warm", warm)):
        result["points"][point] = [sweep_cell(task, cfg, state, b, c) for b in cfg.batches for c in cfg.clips]
        atomic_write_json(cfg.out, result)  # partial results survive an interrupted run
        plot(result, png)
    result["wall_seconds"] = time.perf_counter() - t_start
    return runner.write(result, REPORT, cfg.out, png)


def summary(cell: dict[str, Any]) -> dict[str, Any]:
    """A cell's shares gated, mean global cosines and median ratios by module type and by depth third."""
    mats = [m for step in cell["steps"] for m in step["matrices"]]
    layers = max((matrix_key(m["name"])[0] for m in mats), default=0) + 1
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in mats:
        layer, kind = matrix_key(m["name"])
        groups[kind].append(m)
        groups[f"depth {min(3 * layer // layers, 2) + 1}/3"].append(m)
    return {
        "gated_share": {a: float(np.mean([m["gated"][a] for m in mats])) for a in SETTINGS},
        "cos_global": {a: float(np.mean([st["cos_global"][a] for st in cell["steps"]])) for a in ARMS},
        "groups": {
            g: {
                "edge_ratio": float(np.median([m["edge_ratio"] for m in ms])),
                "bbp_ratio": float(np.median([m["bbp_ratio"] for m in ms])),
                "gated_share": {a: float(np.mean([m["gated"][a] for m in ms])) for a in SETTINGS},
            }
            for g, ms in sorted(groups.items())
        },
    }


def tables(result: dict[str, Any]) -> str:
    lines = [
        "| point | B | C | nm | s = nm·C/B | gated: rmt_paper / rmt | cos(released, clean): none / rmt_paper / rmt | "
        "σ₁/edge (median: qA, qB, vA, vB) | σ₁(clean)/BBP (median: qA, qB, vA, vB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = ("q_proj.lora_A", "q_proj.lora_B", "v_proj.lora_A", "v_proj.lora_B")
    for point, cells in result["points"].items():
        for cell in cells:
            sm = summary(cell)
            g, c = sm["gated_share"], sm["cos_global"]
            edge = ", ".join(f"{sm['groups'][k]['edge_ratio']:.2f}" for k in kinds if k in sm["groups"])
            bbp = ", ".join(f"{sm['groups'][k]['bbp_ratio']:.2f}" for k in kinds if k in sm["groups"])
            s = cell["steps"][0]["noise_std"]
            lines.append(
                f"| {point} | {cell['batch']} | {cell['clip']:g} | {cell['noise_multiplier']:.3f} | {s:.2e} | "
                f"{100 * g['rmt_paper']:.0f} % / {100 * g['rmt']:.0f} % | {c['none']:.3f} / {c['rmt_paper']:.3f} / "
                f"{c['rmt']:.3f} | {edge} | {bbp} |"
            )
    lines += [
        "",
        "| point | B | C | module or depth | σ₁/edge (median) | σ₁(clean)/BBP (median) | gated: rmt_paper / rmt |",
        "|---|---|---|---|---|---|---|",
    ]
    for point, cells in result["points"].items():
        for cell in cells:
            for grp, v in summary(cell)["groups"].items():
                gated = v["gated_share"]
                lines.append(
                    f"| {point} | {cell['batch']} | {cell['clip']:g} | {grp} | {v['edge_ratio']:.2f} | "
                    f"{v['bbp_ratio']:.2f} | {100 * gated['rmt_paper']:.0f} % / {100 * gated['rmt']:.0f} % |"
                )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], png: Path) -> None:
    """Share gated and global cosine vs B, per point and C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for point, ls in (("init", "-"), ("warm", "--")):
        for clip in sorted({c["clip"] for c in result["points"].get(point, [])}):
            cells = sorted((c for c in result["points"][point] if c["clip"] == clip), key=lambda c: c["batch"])
            bs = [c["batch"] for c in cells]
            sms = [summary(c) for c in cells]
            tag = f"{point}, C={clip:g}"
            for arm, marker in (("rmt_paper", "o"), ("rmt", "s")):
                gated = [100 * s["gated_share"][arm] for s in sms]
                axes[0].plot(bs, gated, ls, marker=marker, label=f"{arm}, {tag}")
            for arm in ARMS:
                axes[1].plot(bs, [s["cos_global"][arm] for s in sms], ls, marker="o", label=f"{arm}, {tag}")
            bbp = [np.median([g["bbp_ratio"] for k, g in s["groups"].items() if "lora" in k]) for s in sms]
            axes[2].plot(bs, bbp, ls, marker="o", label=tag)
    ylabels = ("LoRA matrices gated (%)", "cos(released, clean clipped)", "median σ₁(clean) / BBP threshold")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("expected batch B (ε fixed: nm calibrated per B)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[2].axhline(1.0, color="k", lw=0.6)
    cfg = result["config"]
    bed, eps, steps = result["data"].get("bed"), cfg["epsilon"], cfg["budget_steps"]
    fig.suptitle(f"rmt regime map: {bed}, ε = {eps:g} over {steps} steps", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


#: the runner's report protocol for this command
REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench regime-map-llm", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, cfg.out.with_suffix(".png"))
    return run(cfg, argv)
