"""Regime map for the ``rmt`` denoiser: where does it gate, and does the gated output move toward the clean gradient?

    dp-bench regime-map                      # all-MiniLM-L6-v2 / Rotten Tomatoes (~15 min, 2 cores)
    dp-bench regime-map --model tiny --traj-steps 2 --sweep-steps 1 --batches 16 32 --out /tmp/rm
    dp-bench regime-map --replot             # PNG + table from docs/results/regime_map.json

Protocol:

* Model/data: :func:`dp_bench.task.frozen_text_task` (all-MiniLM-L6-v2, packaged Rotten Tomatoes, max_length
  48). Only the top ``--top-layers`` encoder layer(s) are trained (LoRA or full weights); the frozen bottom
  layers are cached (exact, :mod:`dp_bench.frozen`). DP-SGD: Opacus, Poisson sampling, C = ``--max-grad-norm``,
  fixed noise multiplier ``--noise-multiplier`` (so the per-entry noise std is s = nm·C/B), ``post_hooks=["rmt"]``
  (κ = 1.02, norm correction), ``oracle=True``.
* For each trainable configuration (``--trainables``: LoRA targets/rank, or ``full`` weights):
  1. *trajectory*: ``--traj-steps`` DP steps at batch ``--traj-batch`` with ``rmt`` on, recording per step
     the matrices gated and cos(noisy, clean) / cos(denoised, clean) (global and per matrix);
  2. *batch sweep* at two points of training — ``init`` (the fresh adapter) and ``warm`` (the trajectory's
     final weights): for each logical batch size in ``--batches`` (physical batches of at most
     ``--physical-batch`` through BatchMemoryManager), ``--sweep-steps`` DP steps with learning rate 0, i.e.
     independent draws of (batch, noise) at the same weights.
* Reported per cell: gating rate (gated / considered matrices, also for encoder matrices only, i.e. without
  the 2 × hidden classifier weight), global oracle cosine gain, and the share of gated matrix-steps where
  cos(denoised, clean) > cos(noisy, clean).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import runner
from ..adapters import Trainable, build_top
from ..analysis import gated_gain_stats, global_cos_stats
from ..config import opt, parse_config, start
from ..meta import RESULTS, machine
from ..store import atomic_write_json
from ..task import frozen_text_task
from ..train import run_dp

#: the denoiser under study, with per-matrix diagnostics (which matrices were gated)
RMT = [("rmt_paper", {"per_matrix_stats": True})]  # paper A's setting (κ = 1.02 gate)


@dataclass
class Config:
    model: str = opt("minilm", "minilm or tiny", choices=("minilm", "tiny"))
    max_length: int = opt(48, "tokens per example")
    top_layers: int = opt(1, "trained top encoder layers (the rest is cached)")
    trainables: list[str] = opt(
        ["lora:qv:8", "lora:qkvoid:16", "lora:qkvoid:64", "full"],
        "'lora:<targets>:<rank>' (targets from q,k,v,o,i,d) or 'full'",
    )
    batches: list[int] = opt([64, 256, 1024, 2048], "logical batch sizes of the sweep")
    traj_batch: int = opt(256, "batch size of the trajectory")
    traj_steps: int = opt(30, "steps of the trajectory")
    sweep_steps: int = opt(3, "steps per sweep cell")
    physical_batch: int = opt(256, "physical batch size")
    noise_multiplier: float = opt(1.0, "noise multiplier")
    max_grad_norm: float = opt(1.0, "clipping bound C")
    lr: float = opt(5e-3, "AdamW lr of the LoRA trajectories")
    lr_full: float = opt(5e-4, "AdamW lr of the full-weight trajectory")
    seed: int = opt(0, "seed")
    tiny_train: int = opt(256, "--model tiny: synthetic train size")
    tiny_test: int = opt(64, "--model tiny: synthetic test size")
    threads: int = opt(0, "torch threads (0: torch's choice)")
    out: Path = opt(RESULTS, "output folder")
    merge: bool = opt(False, "keep the other trainables already in <out>/regime_map.json")
    replot: bool = opt(False, "only regenerate PNG/tables from <out>/regime_map.json")

    def validate(self) -> None:
        if min(self.batches) < 1 or self.traj_steps < 1 or self.sweep_steps < 1:
            raise ValueError("batches and step counts must be >= 1")
        for spec in self.trainables:
            Trainable.parse(spec)


def is_encoder(name: str) -> bool:
    """A matrix of the encoder layers (LoRA factor or weight), not the classifier head."""
    return "classifier" not in name


def cell_summary(per_step: Sequence[dict[str, Any]], matrices: Sequence[str]) -> dict[str, Any]:
    """Gating rate (all / encoder matrices), global cosine gain and the gated-gain share over a cell's steps."""
    gated = sum(e.get("gated", 0) for e in per_step)
    mats = sum(e.get("matrices", 0) for e in per_step)
    enc_gated = sum(sum(1 for n in e.get("gated_names", []) if is_encoder(n)) for e in per_step)
    enc_mats = len(per_step) * sum(1 for n in matrices if is_encoder(n))
    enc_only = [dict(e, gated_names=[n for n in e.get("gated_names", []) if is_encoder(n)]) for e in per_step]
    return {
        "steps": len(per_step),
        "gated": gated,
        "matrices": mats,
        "gating_rate": gated / mats if mats else float("nan"),
        "encoder_gated": enc_gated,
        "encoder_matrices": enc_mats,
        "encoder_gating_rate": enc_gated / enc_mats if enc_mats else float("nan"),
        "global": global_cos_stats(per_step),
        "gated_gain": gated_gain_stats(per_step),
        "encoder_gated_gain": gated_gain_stats(enc_only),
    }


def _run_config(
    command: Any, traj_steps: int, traj_batch: int, sweep_steps: int, batches: Any, seed: int
) -> dict[str, Any]:
    """The settings a trainable's results were produced with (kept per trainable, for merged files)."""
    return {
        "command": command,
        "traj_steps": traj_steps,
        "traj_batch": traj_batch,
        "sweep_steps": sweep_steps,
        "batches": batches,
        "seed": seed,
    }


def _merge_previous(result: dict[str, Any], args: Config, path: Path) -> None:
    """``--merge``: keep the other trainables of an earlier ``regime_map.json`` (with their run settings)."""
    old = json.loads(path.read_text())
    result["trainables"] = {k: v for k, v in old["trainables"].items() if k not in args.trainables}
    oc = old["config"]
    for v in result["trainables"].values():
        v.setdefault(
            "run_config",
            _run_config(
                old["command"], oc["traj_steps"], oc["traj_batch"], oc["sweep_steps"], oc["batches"], oc["seed"]
            ),
        )
    result["earlier_commands"] = old.get("earlier_commands", []) + [old["command"]]


def _trajectory(task: Any, tr: Trainable, top: torch.nn.Module, args: Config, lr: float) -> dict[str, Any]:
    """The ``--traj-steps`` DP steps at batch ``--traj-batch`` with ``rmt`` on (trains ``top`` in place)."""
    return run_dp(
        top,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=RMT,
        noise_multiplier=args.noise_multiplier,
        batch_size=args.traj_batch,
        steps=args.traj_steps,
        seed=args.seed,
        lr=lr,
        max_grad_norm=args.max_grad_norm,
        physical_batch=args.physical_batch,
        eval_at=[0, args.traj_steps],
        desc=f"{tr.label} trajectory",
    )


def _sweep_cell(
    task: Any, tr: Trainable, args: Config, phase: str, b: int, warm_state: dict[str, Any], mats: Sequence[str]
) -> dict[str, Any]:
    """One sweep cell: ``--sweep-steps`` DP steps at lr 0 and logical batch ``b``, from the init or warm weights."""
    cell_top = build_top(task, tr, args.seed)
    if phase == "warm":
        cell_top.load_state_dict(warm_state)
    r = run_dp(
        cell_top,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=RMT,
        noise_multiplier=args.noise_multiplier,
        batch_size=b,
        steps=args.sweep_steps,
        seed=args.seed + 1000 + b,
        lr=0.0,
        max_grad_norm=args.max_grad_norm,
        physical_batch=min(b, args.physical_batch),
        desc=f"{tr.label} {phase} B={b}",
    )
    cell = {"per_step": r["per_step"], "summary": cell_summary(r["per_step"], mats), "seconds": r["train_seconds"]}
    s = cell["summary"]
    print(
        f"{tr.label:<22} {phase:<5} B={b:<5} gated {s['encoder_gated']}/{s['encoder_matrices']} enc "
        f"({s['gated']}/{s['matrices']} all)  cos {s['global']['cos_noisy']:.3f} -> "
        f"{s['global']['cos_denoised']:.3f}  gain>0 {s['gated_gain']['positive']}/"
        f"{s['gated_gain']['gated_layer_steps']}",
        flush=True,
    )
    return cell


def _run_trainable(task: Any, spec: str, args: Config, command: Any) -> dict[str, Any]:
    """Trajectory, then the init/warm batch sweep, of one trainable configuration."""
    tr = Trainable.parse(spec)
    lr = args.lr_full if tr.kind == "full" else args.lr
    top = build_top(task, tr, args.seed)
    mats = matrix_names(top)
    traj = _trajectory(task, tr, top, args, lr)
    warm_state = {k: v.detach().clone() for k, v in top.state_dict().items()}
    sweep: dict[str, dict[str, Any]] = {}
    for phase in ("init", "warm"):
        sweep[phase] = {}
        for b in args.batches:
            sweep[phase][str(b)] = _sweep_cell(task, tr, args, phase, b, warm_state, mats)
    return {
        "label": tr.label,
        "lr": lr,
        "run_config": _run_config(command, args.traj_steps, args.traj_batch, args.sweep_steps, args.batches, args.seed),
        "matrix_names": mats,
        "trajectory": {
            "per_step": traj["per_step"],
            "curve": traj["curve"],
            "epsilon": traj["epsilon"],
            "summary": cell_summary(traj["per_step"], mats),
            "seconds": traj["train_seconds"],
        },
        "sweep": sweep,
    }


def run(args: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    header = start("regime-map", args, argv)
    t_start = time.perf_counter()
    task = frozen_text_task(
        args.model, args.max_length, args.top_layers, tiny_train=args.tiny_train, tiny_test=args.tiny_test
    )
    result: dict[str, Any] = {
        **header,
        "data": dict(task.info, train=len(task.train), test=len(task.test)),
        "trainables": {},
    }
    path, png = args.out / "regime_map.json", args.out / "regime_map.png"
    if args.merge and path.is_file():
        _merge_previous(result, args, path)
    for spec in args.trainables:
        result["trainables"][spec] = _run_trainable(task, spec, args, result["command"])
        atomic_write_json(path, result)  # partial results survive an interrupted run
        plot(result, png)
    result["wall_seconds"] = time.perf_counter() - t_start
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    return runner.write(result, REPORT, path, png)


def matrix_names(top: torch.nn.Module) -> list[str]:
    """Qualified names of the trainable ≥2-D parameters (the matrices ``rmt`` considers)."""
    return [n for n, p in top.named_parameters() if p.requires_grad and p.dim() >= 2]


# ----------------------------------------------------------------------------------------------- outputs


def table(result: dict[str, Any]) -> str:
    """Markdown table: one row per (trainable, phase, batch)."""
    lines = [
        "| trainable | phase | B | s = nm·C/B | encoder matrices gated | global cos noisy → denoised "
        "| gated matrix-steps with gain > 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    nm, c = result["config"]["noise_multiplier"], result["config"]["max_grad_norm"]
    for _spec, t in result["trainables"].items():
        for phase, cells in t["sweep"].items():
            for b, cell in cells.items():
                s = cell["summary"]
                g = s["encoder_gated_gain"]
                share = f"{g['positive']}/{g['gated_layer_steps']}" if g["gated_layer_steps"] else "–"
                lines.append(
                    f"| {t['label']} | {phase} | {b} | {nm * c / int(b):.2e} | "
                    f"{s['encoder_gated']}/{s['encoder_matrices']}"
                    f" ({100 * _nz(s['encoder_gating_rate']):.0f} %) | {s['global']['cos_noisy']:.3f} → "
                    f"{s['global']['cos_denoised']:.3f} ({100 * _nz(s['global']['rel_gain']):+.1f} %) | {share} |"
                )
    return "\n".join(lines)


def trajectory_table(result: dict[str, Any]) -> str:
    lines = [
        "| trainable | steps | acc start → end | encoder gated (first half / second half) "
        "| global cos noisy → denoised (2nd half) | gated gain > 0 |",
        "|---|---|---|---|---|---|",
    ]
    for _spec, t in result["trainables"].items():
        ps = t["trajectory"]["per_step"]
        h = len(ps) // 2
        mats = t["matrix_names"]
        a, b = cell_summary(ps[:h], mats) if h else None, cell_summary(ps[h:], mats)
        g = cell_summary(ps, mats)["encoder_gated_gain"]
        curve = t["trajectory"]["curve"]
        first = f"{a['encoder_gated']}/{a['encoder_matrices']}" if a else "–"
        lines.append(
            f"| {t['label']} | {len(ps)} | {curve[0][1]:.3f} → {curve[-1][1]:.3f} | {first} / "
            f"{b['encoder_gated']}/{b['encoder_matrices']} | "
            f"{b['global']['cos_noisy']:.3f} → {b['global']['cos_denoised']:.3f} | "
            f"{g['positive']}/{g['gated_layer_steps']} |"
        )
    return "\n".join(lines)


def _nz(x: float) -> float:
    return 0.0 if not np.isfinite(x) else x


def tables(result: dict[str, Any]) -> str:
    return "#### Batch sweep\n\n" + table(result) + "\n\n#### Trajectory\n\n" + trajectory_table(result) + "\n"


def plot(result: dict[str, Any], png: Path) -> None:
    """``regime_map.png``: gating rate and cosine gain vs batch, and along the trajectory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (_spec, t) in enumerate(result["trainables"].items()):
        col = colors[i % len(colors)]
        for phase, ls in (("init", "-"), ("warm", "--")):
            cells = t["sweep"].get(phase, {})
            bs = [int(b) for b in cells]
            if not bs:
                continue
            rate = [_nz(cells[str(b)]["summary"]["encoder_gating_rate"]) * 100 for b in bs]
            gain = [_nz(cells[str(b)]["summary"]["global"]["rel_gain"]) * 100 for b in bs]
            axes[0, 0].plot(bs, rate, ls, marker="o", color=col, label=f"{t['label']} ({phase})")
            axes[0, 1].plot(bs, gain, ls, marker="o", color=col, label=f"{t['label']} ({phase})")
        ps = t["trajectory"]["per_step"]
        steps = [e["step"] for e in ps]
        enc = [sum(1 for n in e.get("gated_names", []) if is_encoder(n)) for e in ps]
        n_enc = max(1, sum(1 for n in t["matrix_names"] if is_encoder(n)))
        axes[1, 0].plot(steps, [100 * g / n_enc for g in enc], color=col, label=t["label"])
        cg = np.array([e["cos_global"] for e in ps])
        if cg.size:
            axes[1, 1].plot(steps, cg[:, 0], ":", color=col)
            axes[1, 1].plot(steps, cg[:, 1], "-", color=col, label=f"{t['label']}")
    cfg = result["config"]
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("logical batch size B")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("encoder matrices gated (%)")
    axes[0, 0].set_title("gating rate (solid: init, dashed: after trajectory)", fontsize=9)
    axes[0, 1].set_ylabel("global cos gain, relative (%)")
    axes[0, 1].set_title("cos(denoised, clean) vs cos(noisy, clean)", fontsize=9)
    axes[0, 1].axhline(0, color="k", lw=0.5)
    axes[1, 0].set_xlabel(f"DP step (B = {cfg['traj_batch']})")
    axes[1, 0].set_ylabel("encoder matrices gated (%)")
    axes[1, 0].set_title("trajectory: gating over training", fontsize=9)
    axes[1, 1].set_xlabel(f"DP step (B = {cfg['traj_batch']})")
    axes[1, 1].set_ylabel("global cosine to clean gradient")
    axes[1, 1].set_title("trajectory: dotted = noisy, solid = denoised", fontsize=9)
    for ax in axes[1]:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6)
    axes[1, 1].legend(fontsize=6)
    fig.suptitle(
        f"RMT regime map: {result['data'].get('model')} / top {cfg['top_layers']} layer(s), "
        f"nm = {cfg['noise_multiplier']}, C = {cfg['max_grad_norm']}, max_length {cfg['max_length']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


#: the runner's report protocol for this command
REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | Path:
    args = parse_config(Config, argv, prog="dp-bench regime-map", description=__doc__)
    if args.replot:
        runner.replot(args.out / "regime_map.json", REPORT, args.out / "regime_map.png")
        return args.out / "regime_map.png"
    result = run(args, argv)
    print(f"wall {result['wall_seconds']:.0f}s; wrote {args.out / 'regime_map.json'}, {args.out / 'regime_map.png'}")
    return result
