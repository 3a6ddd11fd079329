"""Demo: DP-LoRA vs DP-LoRA + RMT spectral denoising, all-MiniLM-L6-v2 on Rotten Tomatoes, at a fixed epsilon.

    dp-bench demo                                   # the real model and data (the README's main job)
    dp-bench demo --model tiny --steps 2 --out /tmp/demo   # half-minute smoke run
    dp-bench demo --replot                          # table + accuracy plot of the committed docs/results/demo.json
    dp-bench demo --refresh-evidence                # rerun and rewrite the committed docs/results/demo*

Output folder: ``--out``, else a new ``./dp-bench-demo-<UTC time>/``; the committed evidence in docs/results is
rewritten only with ``--refresh-evidence``.

Protocol (documented in docs/demo.md):

* Data: packaged Rotten Tomatoes review snippets (:mod:`dp_bench.data`: deduped, seeded stratified split,
  train 10,201 / test 2,551), max_length 48.
* Model: all-MiniLM-L6-v2 + a sequence-classification head; LoRA (PEFT) on q, k, v, attention-output,
  intermediate and output dense layers of the TOP ``--lora-layers`` encoder layers only; classifier trained.
* Speed-up (exact): the bottom encoder layers are frozen and receive no LoRA, so their outputs are computed
  once per example (eval mode) and cached (:mod:`dp_bench.frozen`); training and evaluation run only the top
  layers. The split is checked against the full model's logits whenever the cache is built.
* Privacy: Opacus DP-SGD with Poisson sampling, flat clipping C, the noise multiplier calibrated (PRV
  accountant) so that ``--steps`` logical steps of logical batch ``--batch-size`` reach exactly ``--epsilon``
  at ``--delta``; physical batches via BatchMemoryManager. Every training step is private. Denoising is
  post-processing and does not change epsilon.
* Arms: Opacus alone (``dp-lora``), then one arm per ``--arms`` entry (default: the default ``rmt``, and
  ``rmt_paper`` = paper A's setting, which docs/denoisers.md advises against; shown for the mechanism).
* Every arm shares the seed: same LoRA initialization, the same Poisson batches and the same noise draws
  (common random numbers), so the difference between them is the denoiser.
* Oracle diagnostics (benchmark only): per step, cosine of the noisy and of the denoised gradient to the
  clean clipped gradient.

Writes ``<out>/demo.json`` (config, versions, per-step curves) and ``<out>/demo_accuracy.png``,
``<out>/demo_spectrum.png``.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import runner
from ..adapters import Trainable, build_top
from ..analysis import steps_to_reach
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..task import FrozenTextTask, frozen_text_task
from ..train import evaluate, run_dp


@dataclass
class Config:
    model: str = opt("minilm", "minilm (all-MiniLM-L6-v2 / Rotten Tomatoes) or tiny", choices=("minilm", "tiny"))
    epsilon: float = opt(6.7, "target epsilon (paper A's GLUE setting)")
    delta: float = opt(1e-5, "target delta")
    steps: int = opt(60, "logical DP-SGD steps per arm")
    batch_size: int = opt(256, "expected logical (Poisson) batch size")
    physical_batch: int = opt(256, "physical batch size (BatchMemoryManager)")
    max_length: int = opt(48, "tokens per example")
    lora_layers: int = opt(1, "LoRA on the top N encoder layers")
    pooling: str = opt("mean", "classification head input", choices=("mean", "cls"))
    rank: int = opt(16, "LoRA rank")
    alpha: float = opt(16.0, "LoRA alpha")
    lr: float = opt(5e-3, "AdamW learning rate")
    max_grad_norm: float = opt(1.0, "clipping bound C")
    eval_every: int = opt(10, "evaluate every N steps")
    eval_batch: int = opt(512, "evaluation batch size")
    seed: int = opt(0, "seed")
    arms: list[str] = opt(["rmt", "rmt_paper"], "one arm per entry beside Opacus alone: its post_hooks, '+'-joined")
    hooks: list[str] = opt([], "post_hooks of one denoised arm (replaces --arms; kept for older command lines)")
    tiny_train: int = opt(512, "--model tiny: synthetic train size")
    tiny_test: int = opt(256, "--model tiny: synthetic test size")
    out: Path | None = opt(None, "output folder (default: a new ./dp-bench-demo-<UTC time>/)", type=Path)
    refresh_evidence: bool = opt(False, "write to docs/results: rewrite the committed demo evidence")
    replot: bool = opt(False, "only print the table and redraw the accuracy plot of <out or docs/results>/demo.json")
    threads: int = opt(0, "torch threads (0: torch's choice)")

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.physical_batch < 1:
            raise ValueError("--steps, --batch-size and --physical-batch must be >= 1")
        here = None if self.out is None else self.out.resolve()
        if self.refresh_evidence and here not in (None, RESULTS.resolve()):
            raise ValueError("--refresh-evidence writes the committed evidence in docs/results: drop --out")
        if here == RESULTS.resolve() and not self.refresh_evidence:
            raise ValueError("--out docs/results would overwrite the committed evidence: pass --refresh-evidence")

    def denoised_arms(self) -> list[list[str]]:
        """The post_hooks of each denoised arm."""
        return [list(self.hooks)] if self.hooks else [a.split("+") for a in self.arms]


#: what the demo's table and plot say beside an arm (docs/denoisers.md advises against rmt_paper)
NOTES = {"rmt_paper": "paper A's setting", "rmt": "default"}
LEGACY_NOTE = "rmt before its defaults changed = rmt_paper, paper A's setting"


def arm_label(hooks: Sequence[Any]) -> str:
    names = [h if isinstance(h, str) else getattr(h, "name", type(h).__name__) for h in hooks]
    return "dp-lora" if not names else "dp-lora+" + "+".join(names)


def arm_note(hooks: Sequence[str]) -> str | None:
    return NOTES.get(hooks[0]) if len(hooks) == 1 else None


def fresh_folder(parent: Path | None = None) -> Path:
    """A new ``dp-bench-demo-<UTC time>`` folder under ``parent`` (default: the working directory)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for i in range(1000):
        path = (parent or Path.cwd()) / (f"dp-bench-demo-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free dp-bench-demo-{stamp}-<n> folder under {parent or Path.cwd()}")


def output_folder(cfg: Config) -> Path:
    """docs/results with ``--refresh-evidence``, else ``--out``, else a fresh folder (:func:`fresh_folder`)."""
    if cfg.refresh_evidence:
        return RESULTS
    return cfg.out if cfg.out is not None else fresh_folder()


class Recorder:
    """A pass-through denoiser that snapshots the gradients it sees at chosen logical steps (for the plot)."""

    def __init__(self, name: str, steps: Sequence[int]) -> None:
        self.name = name
        self.steps = set(steps)
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, grads: Sequence[Any]) -> None:
        step = grads[0].step if grads else -1
        if step in self.steps:
            self.seen[step] = {g.name: g.tensor.detach().clone() for g in grads if g.tensor.dim() == 2}
        return None

    def output_noise(self, grads: Sequence[Any]) -> float:
        return 1.0  # a pass-through: the noise is unchanged


def run_arm(label: str, hooks: list[Any], task: FrozenTextTask, nm: float, cfg: Config, acc0: float) -> dict[str, Any]:
    """Train one arm (``hooks`` = its post_hooks) for ``cfg.steps`` logical DP steps; curves + diagnostics."""
    from opacus_spectral.step.oracle import clean_gradients

    trainable = Trainable("lora", "qkvoid", cfg.rank, cfg.alpha)
    top = build_top(task, trainable, cfg.seed, pooling=cfg.pooling, reinit_head=False)
    record_steps = sorted({max(0, cfg.steps // 2), cfg.steps - 1})
    rec_noisy, rec_out = Recorder("record_noisy", record_steps), Recorder("record_denoised", record_steps)
    names = {id(p): n for n, p in top.named_parameters()}
    clean: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot_clean(step: int, entry: dict[str, Any], dp_opt: Any) -> None:
        if step in record_steps:
            params = [p for p in dp_opt.params if getattr(p, "summed_grad", None) is not None and p.dim() == 2]
            clean[step] = {names[id(p)]: c for p, c in zip(params, clean_gradients(dp_opt, params), strict=True)}

    eval_at = sorted({*range(cfg.eval_every, cfg.steps + 1, cfg.eval_every), cfg.steps, 0})
    r = run_dp(
        top,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=[rec_noisy, *hooks, rec_out],
        noise_multiplier=nm,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        seed=cfg.seed,
        lr=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,
        physical_batch=cfg.physical_batch,
        eval_at=eval_at,
        eval_batch=cfg.eval_batch,
        initial_accuracy=acc0,
        delta=cfg.delta,
        desc=f"{label:>12}",
        on_step=snapshot_clean,
    )
    names = [h if isinstance(h, str) else getattr(h, "name", type(h).__name__) for h in hooks]
    return {
        "label": label,
        "hooks": names,
        "note": arm_note(names),
        "accuracy": r["curve"][-1][1],
        "curve": r["curve"],
        "epsilon": r["epsilon"],
        "steps": len(r["per_step"]),
        "train_seconds": r["train_seconds"],
        "denoiser_seconds": sum(e.get("rmt_seconds", 0.0) for e in r["per_step"]),
        "per_step": r["per_step"],
        "recorded": {
            s: {"noisy": rec_noisy.seen.get(s, {}), "denoised": rec_out.seen.get(s, {}), "clean": clean.get(s, {})}
            for s in record_steps
        },
    }


def summarize(arm: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers of one arm; "changed" matrix-steps are those whose oracle cosine the denoiser moved."""
    cos = [e["cos_global"] for e in arm["per_step"] if "cos_global" in e]
    gated = [e for e in arm["per_step"] if "gated" in e]
    gains = [
        d - n
        for e in arm["per_step"]
        for n, d in e.get("cos", {}).values()
        if math.isfinite(n) and math.isfinite(d) and abs(d - n) > 1e-9
    ]
    return {
        "accuracy": arm["accuracy"],
        "epsilon": arm["epsilon"],
        "steps": arm["steps"],
        "train_seconds": arm["train_seconds"],
        "denoiser_seconds": arm["denoiser_seconds"],
        "gated_layer_steps": sum(e["gated"] for e in gated) if gated else None,
        "considered_layer_steps": sum(e["matrices"] for e in gated) if gated else None,
        "steps_with_any_gate": sum(1 for e in gated if e["gated"] > 0) if gated else None,
        "changed_matrix_steps": len(gains),
        "changed_with_positive_cos_gain": sum(1 for g in gains if g > 0),
        "cos_noisy_mean": float(np.nanmean([c[0] for c in cos])) if cos else None,
        "cos_denoised_mean": float(np.nanmean([c[1] for c in cos])) if cos else None,
    }


def table(rows: dict[str, dict[str, Any]], baseline_seconds: float, notes: dict[str, str | None] | None = None) -> str:
    """The results table; ``notes``: what to say beside an arm (a footnote line each)."""
    w = max(14, 2 + max(map(len, rows), default=0))
    head = (
        f"{'arm':<{w}}{'test acc':>9}{'eps':>7}{'steps':>7}{'to base':>8}{'train s':>9}{'overhead':>10}"
        f"{'gated':>10}{'cos+':>9}{'cos noisy->den':>16}"
    )
    lines = [head, "-" * len(head)]
    for label, s in rows.items():
        over = 100.0 * s["denoiser_seconds"] / baseline_seconds if baseline_seconds > 0 else float("nan")
        gated = "-" if s["gated_layer_steps"] is None else f"{s['gated_layer_steps']}/{s['considered_layer_steps']}"
        cos = "-" if s["cos_noisy_mean"] is None else f"{s['cos_noisy_mean']:.3f}->{s['cos_denoised_mean']:.3f}"
        reach = s.get("steps_to_baseline_final_accuracy")
        pos = f"{s['changed_with_positive_cos_gain']}/{s['changed_matrix_steps']}" if s["changed_matrix_steps"] else "-"
        lines.append(
            f"{label:<{w}}{s['accuracy']:>9.4f}{s['epsilon']:>7.2f}{s['steps']:>7d}{'-' if reach is None else reach:>8}"
            f"{s['train_seconds']:>9.1f}{over:>9.2f}%{gated:>10}{pos:>9}{cos:>16}"
        )
    lines.append(
        "to base: first evaluated step reaching dp-lora's final accuracy; overhead: denoiser time / dp-lora training "
        "time; gated: matrix-steps the gate opened / considered; cos+: matrix-steps (finite cosines) the denoiser "
        "changed with a higher oracle cosine to the clean gradient; cos: mean over steps of the global cosine "
        "(noisy -> denoised)."
    )
    lines += [f"{label}: {note}" for label, note in (notes or {}).items() if note]
    return "\n".join(lines)


def pick_spectrum_param(arm: dict[str, Any], step: int) -> tuple[str | None, float | None]:
    """The recorded matrix the denoiser improved most at ``step`` (largest oracle cosine gain), and the gain.

    Falls back to the matrix it changed most (relative Frobenius change) when no oracle gain is positive.
    """
    rec = arm["recorded"].get(step, {})
    entry = next((e for e in arm["per_step"] if e["step"] == step), {})
    per = entry.get("cos", {})
    usable = [n for n in rec.get("noisy", {}) if n in rec.get("denoised", {}) and n in rec.get("clean", {})]
    gains = {n: per[n][1] - per[n][0] for n in usable if n in per and all(map(math.isfinite, per[n]))}
    if gains and max(gains.values()) > 0:
        best = max(gains, key=gains.__getitem__)
        return best, gains[best]
    change = {
        n: float((rec["denoised"][n] - rec["noisy"][n]).norm() / rec["noisy"][n].norm().clamp_min(1e-30))
        for n in usable
    }
    if not change:
        return None, None
    best = max(change, key=change.__getitem__)
    return best, gains.get(best)


def plot_accuracy(arms: dict[str, dict[str, Any]], notes: dict[str, str | None], png: Path, title: str) -> None:
    """``png`` (``demo_accuracy.png``): every arm's test accuracy curve, labelled with its note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, arm in arms.items():
        xs, ys = zip(*arm["curve"], strict=True)
        ax.plot(xs, ys, marker="o", label=label + (f" ({notes[label]})" if notes.get(label) else ""))
    ax.set_xlabel("logical DP-SGD step")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_spectrum_of(arms: dict[str, dict[str, Any]], out: Path) -> dict[str, str]:
    """``demo_spectrum.png`` (and its tensors) of the matrix the most active denoiser improved most; the paths."""
    paths: dict[str, str] = {}
    denoised = [lbl for lbl, a in arms.items() if a["hooks"]]
    if not denoised:
        return paths
    changed = {lbl: summarize(arms[lbl])["changed_matrix_steps"] for lbl in denoised}
    arm = arms[max(denoised, key=changed.__getitem__)]  # the arm whose denoiser changed the most matrices
    step = max(arm["recorded"])
    name, gain = pick_spectrum_param(arm, step)
    if name is None:
        return paths
    rec = arm["recorded"][step]
    mats = {"clean": rec["clean"][name], "noisy": rec["noisy"][name], "denoised": rec["denoised"][name]}
    sigma = next(e["sigma"] for e in arm["per_step"] if e["step"] == step)
    from opacus_spectral.denoisers.spectrum_report import plot_spectrum

    p = out / "demo_spectrum.png"
    plot_spectrum(
        mats["clean"],
        mats["noisy"],
        mats["denoised"],
        sigma=sigma,
        path=p,
        title=f"{name}\nstep {step}, {'x'.join(map(str, mats['noisy'].shape))}, s = {sigma:.3g}",
    )
    paths.update(
        spectrum=str(p),
        spectrum_param=name,
        spectrum_step=str(step),
        spectrum_cos_gain="nan" if gain is None else f"{gain:.4f}",
    )
    torch.save(
        {k: v.clone() for k, v in mats.items()} | {"sigma": sigma, "name": name, "step": step}, out / "demo_spectrum.pt"
    )
    paths["spectrum_tensors"] = str(out / "demo_spectrum.pt")
    return paths


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from opacus_spectral import noise_multiplier_for

    header = start("demo", cfg, argv)
    t0, cpu0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()
    task = frozen_text_task(
        cfg.model,
        cfg.max_length,
        cfg.lora_layers,
        seed=cfg.seed,
        tiny_train=cfg.tiny_train,
        tiny_test=cfg.tiny_test,
        eval_batch=cfg.eval_batch,
        use_disk=False,
    )
    t_cache = time.perf_counter() - t0
    n_train, n_test = len(task.train), len(task.test)
    sample_rate = cfg.batch_size / n_train
    nm = noise_multiplier_for(
        target_epsilon=cfg.epsilon, target_delta=cfg.delta, sample_rate=sample_rate, steps=cfg.steps, accountant="prv"
    )
    info = task.info
    tqdm.write(
        f"{info['model']} on {info['dataset']}: train {n_train}, test {n_test}, LoRA r={cfg.rank} on top "
        f"{cfg.lora_layers} layer(s); cache {t_cache:.0f}s (split check {info['split_check']:.1e}); noise "
        f"multiplier {nm:.3f} for eps={cfg.epsilon} in {cfg.steps} steps of q={sample_rate:.4f}"
    )
    probe = build_top(
        task, Trainable("lora", "qkvoid", cfg.rank, cfg.alpha), cfg.seed, pooling=cfg.pooling, reinit_head=False
    )
    acc0 = evaluate(probe, task.test, task.input_names, cfg.eval_batch)["accuracy"]
    arms: dict[str, dict[str, Any]] = {}
    for hooks in ([], *cfg.denoised_arms()):
        arms[arm_label(hooks)] = run_arm(arm_label(hooks), hooks, task, nm, cfg, acc0)
    summaries = {label: summarize(a) for label, a in arms.items()}
    target = arms["dp-lora"]["accuracy"]
    for label, a in arms.items():
        summaries[label]["steps_to_baseline_final_accuracy"] = steps_to_reach(a["curve"], target)
    out = output_folder(cfg)
    out.mkdir(parents=True, exist_ok=True)
    plots = {"accuracy": str(out / "demo_accuracy.png"), **plot_spectrum_of(arms, out)}
    wall = time.perf_counter() - t0
    result = {
        **header,
        "out": str(out),
        "data": dict(info, train=n_train, test=n_test),
        "noise_multiplier": nm,
        "sample_rate": sample_rate,
        "cache_seconds": t_cache,
        "split_check_max_abs": info["split_check"],
        "wall_seconds": wall,
        "cpu_seconds": time.process_time() - cpu0,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
        },
        "summary": summaries,
        "plots": plots,
        "arms": {label: {k: v for k, v in a.items() if k != "recorded"} for label, a in arms.items()},
    }
    print()
    runner.write(result, REPORT, out / "demo.json", out / "demo_accuracy.png", indent=1)
    pngs = ", ".join(v for k, v in plots.items() if k in ("accuracy", "spectrum"))
    print(
        f"\nwall time {wall:.0f}s (CPU {result['cpu_seconds']:.0f}s, load average {load0[0]:.1f} at start); "
        f"wrote {out / 'demo.json'} and {pngs}"
    )
    return result


def stored_notes(stored: dict[str, Any]) -> dict[str, str | None]:
    """The note of each arm of a stored demo.json; one written before arms had notes ran paper A's setting as
    ``"rmt"`` (docs/demo.md)."""
    legacy = all("note" not in a for a in stored["arms"].values())
    return {
        label: LEGACY_NOTE if legacy and a["hooks"] == ["rmt"] else a.get("note") for label, a in stored["arms"].items()
    }


def upgrade(result: dict[str, Any]) -> dict[str, Any]:
    """A stored demo.json with every arm's note (:func:`stored_notes`: a JSON from before arms had notes)."""
    for label, note in stored_notes(result).items():
        result["arms"][label]["note"] = note
    return result


def tables(result: dict[str, Any]) -> str:
    """The results table of a demo result (:func:`table`)."""
    notes = {label: a.get("note") for label, a in result["arms"].items()}
    return table(result["summary"], result["arms"]["dp-lora"]["train_seconds"], notes)


def plot(result: dict[str, Any], png: Path) -> None:
    """The accuracy plot of a demo result (:func:`plot_accuracy`)."""
    c, info = result["config"], result["data"]
    title = (
        f"{info['model']} / {info['dataset'].split(' ')[0]}: eps={c['epsilon']}, B={c['batch_size']}, "
        f"{c['steps']} steps"
    )
    plot_accuracy(result["arms"], {label: a.get("note") for label, a in result["arms"].items()}, png, title)


#: the runner's report protocol for this command
REPORT = runner.Report(tables=tables, plot=plot, upgrade=upgrade)


def replot(cfg: Config) -> dict[str, Any]:
    """The table and the accuracy plot of ``<out or docs/results>/demo.json`` (never rewritten), drawn into
    ``--out``, docs/results (``--refresh-evidence``) or a fresh folder. Arms the JSON lacks are named."""
    source = cfg.out if cfg.out is not None else RESULTS
    out = output_folder(cfg)
    stored = runner.replot(source / "demo.json", REPORT, out / "demo_accuracy.png")
    missing = [arm_label(h) for h in ([], *cfg.denoised_arms()) if arm_label(h) not in stored["arms"]]
    if missing:
        print(f"not in {source / 'demo.json'} (rerun to add them): {', '.join(missing)}")
    print(f"wrote {out / 'demo_accuracy.png'}")
    return {
        "source": str(source / "demo.json"),
        "out": str(out),
        "summary": stored["summary"],
        "notes": {label: a["note"] for label, a in stored["arms"].items()},
        "missing": missing,
        "plots": {"accuracy": str(out / "demo_accuracy.png")},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench demo", description=__doc__)
    return replot(cfg) if cfg.replot else run(cfg, argv)
