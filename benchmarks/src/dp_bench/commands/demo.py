"""Demo: DP-SGD vs BandMF (correlated noise) for DP-LoRA, all-MiniLM-L6-v2 on Rotten Tomatoes, at one epsilon.

    dp-bench demo                                   # the real model and data (the README's main job)
    dp-bench demo --arms bandmf rmt                 # and a DP-SGD + rmt denoiser arm beside them
    dp-bench demo --model tiny --steps 4 --batch-size 16 --tiny-train 128 --epsilon 8 --out /tmp/demo   # smoke run
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
* Arms (``--arms``, beside DP-SGD): ``dp-lora`` is DP-SGD, Opacus' Poisson sampling at q = B/N; ``bandmf``
  (the default) is BandMF (``docs/mechanisms.md``) with the b of {1, 2, 4, 8, 16, 32} (b ≤ T, b·q ≤ 1) whose
  noise-error proxy σ_b‖A M⁻¹‖_F / (σ_1‖A‖_F) is lowest at the demo's (q, T, ε) (:mod:`.mf_proxy`);
  ``bandmf:<b>`` fixes b; any other entry is a DP-SGD arm with that ``post_hooks`` ('+'-joined, e.g. ``rmt``).
* Privacy: flat clipping C, every step private; each arm's σ calibrated (PRV) to exactly ``--epsilon`` at
  ``--delta`` through its own accounting, as the grid does (:func:`.grid.calibrate` of
  :func:`dp_bench.noise_methods.accounting`): DP-SGD (q, T), BandMF (b·q, ⌈T/b⌉) on the cyclic Poisson sampler.
  Denoising is post-processing and does not change epsilon. Each arm's ε is the engine's accountant's (PRV).
* Every arm shares the seed: the same LoRA initialization and noise seed (DP-SGD arms: the same Poisson batches
  and noise draws, so a denoiser is the only difference).
* One seed, not a pre-registered comparison: that is docs/results.md §12 (§12.G under the shipped sampler).
* Oracle diagnostics (benchmark only): per step, cosine of the noisy and of the denoised gradient to the
  clean clipped gradient.

Writes ``<out>/demo.json`` (config, versions, the proxy, per-step curves) and ``<out>/demo_accuracy.png``, and
``<out>/demo_spectrum.png`` when a denoised arm ran.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import meta, runner
from ..adapters import Trainable, build_top
from ..analysis import steps_to_reach
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..noise_methods import accounting, bands_of, mechanism_of_method, sampler_of
from ..task import FrozenTextTask, frozen_text_task
from ..train import evaluate, run_dp
from . import mf_proxy
from .grid import calibrate

#: the bands the ``bandmf`` arm chooses b from (docs/demo.md)
BANDS = (1, 2, 4, 8, 16, 32)
#: ε tolerance of the proxy's σ_b: noise_multiplier_for's default, the one :func:`.grid.calibrate` uses
TOLERANCE = 0.01
#: the line every comparison ends with
CAVEAT = (
    "One seed, not a pre-registered comparison: the pre-registered evidence is docs/results.md §12 "
    "(§12.G: the rerun under the shipped sampler)."
)


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
    arms: list[str] = opt(
        ["bandmf"],
        "arms beside DP-SGD: bandmf (b by the noise-error proxy), bandmf:<b>, or a DP-SGD arm's post_hooks "
        "('+'-joined, e.g. rmt)",
    )
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
        for entry in self.extra_arms():
            try:
                bands_of(entry)
            except ValueError:
                raise ValueError(
                    f"--arms {entry!r}: bandmf:<b> takes an integer b >= 1 (or bandmf: b by the proxy)"
                ) from None

    def extra_arms(self) -> list[str]:
        """The ``--arms`` entries beside DP-SGD (``--hooks``: one denoised arm)."""
        return ["+".join(self.hooks)] if self.hooks else list(self.arms)


class Arm(NamedTuple):
    """One arm: its label, its noise method (``dp-sgd`` or :mod:`dp_bench.noise_methods`' ``bandmf:<b>``) and its
    post_hooks."""

    label: str
    method: str
    hooks: tuple[str, ...] = ()


#: DP-SGD alone, the arm every other is compared with
BASELINE = Arm("dp-lora", "dp-sgd")
#: what the demo's table and plot say beside an arm (docs/denoisers.md advises against rmt_paper)
NOTES = {"rmt_paper": "paper A's setting", "rmt": "default", "dp-lora": "DP-SGD, Poisson sampling"}


def arm_label(hooks: Sequence[Any]) -> str:
    names = [h if isinstance(h, str) else getattr(h, "name", type(h).__name__) for h in hooks]
    return "dp-lora" if not names else "dp-lora+" + "+".join(names)


def arm_of(entry: str, best_b: int | None = None) -> Arm:
    """An ``--arms`` entry as an arm: ``bandmf`` with b = ``best_b`` (the proxy's), ``bandmf:<b>`` as given, else a
    DP-SGD arm with the entry's post_hooks."""
    method = f"bandmf:{best_b}" if entry == "bandmf" else entry
    if bands_of(method) is not None:
        return Arm(method, method)
    hooks = tuple(entry.split("+"))
    return Arm(arm_label(hooks), "dp-sgd", hooks)


def arm_note(arm: Arm, proxy: dict[str, Any] | None) -> str | None:
    """The note beside an arm: the proxy's choice for its BandMF arm (docs/mechanisms.md, "Choosing b")."""
    b = bands_of(arm.method)
    if b is None:
        return NOTES.get(arm.hooks[0] if len(arm.hooks) == 1 else arm.label)
    if proxy is not None and b == proxy["best_b"]:
        return f"BandMF, b = {b}: lowest noise-error proxy, {proxy['best_ratio']:.3f} of DP-SGD's"
    return f"BandMF, b = {b}"


def choose_bands(q: float, steps: int, eps: float, delta: float) -> dict[str, Any]:
    """The noise-error proxy RMSE_b / RMSE_1 (:mod:`.mf_proxy`, docs/results/mechanisms.md) at the demo's
    (q, T, ε) for each b of :data:`BANDS` with b ≤ T and b·q ≤ 1; ``best_b`` is its argmin."""
    bands = [b for b in BANDS if b <= steps and b * q <= 1]
    proxy = mf_proxy.Config(sample_rate=q, delta=delta, accountant="prv", tolerance=TOLERANCE)
    return mf_proxy.proxy_cell(proxy, steps, eps, mf_proxy.factorization_errors(steps, bands))


def plan(cfg: Config, q: float) -> tuple[list[Arm], dict[str, Any] | None]:
    """The arms of a run (DP-SGD first) and the proxy, computed only when an arm is ``bandmf``."""
    entries = cfg.extra_arms()
    proxy = choose_bands(q, cfg.steps, cfg.epsilon, cfg.delta) if "bandmf" in entries else None
    arms = {a.label: a for a in [BASELINE, *(arm_of(e, None if proxy is None else proxy["best_b"]) for e in entries)]}
    return list(arms.values()), proxy


def noise_multiplier(cfg: Config, arm: Arm, q: float) -> float:
    """σ of an arm, calibrated (PRV) to ``--epsilon`` through its own accounting, as the grid's
    :func:`.grid.method_setup` does: DP-SGD (q, T), BandMF (b·q, ⌈T/b⌉)."""
    return calibrate(cfg.epsilon, *accounting(arm.method, q, cfg.steps), cfg.delta)


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


def run_arm(arm: Arm, task: FrozenTextTask, nm: float, cfg: Config, acc0: float) -> dict[str, Any]:
    """Train one arm (its noise mechanism, σ = ``nm`` and post_hooks) for ``cfg.steps`` logical DP steps; curves +
    diagnostics."""
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
        post_hooks=[rec_noisy, *arm.hooks, rec_out],
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
        desc=f"{arm.label:>12}",
        on_step=snapshot_clean,
        noise_mechanism=mechanism_of_method(arm.method),
    )
    rate, charged = accounting(arm.method, cfg.batch_size / len(task.train), cfg.steps)
    return {
        "label": arm.label,
        "method": arm.method,
        "hooks": list(arm.hooks),
        "noise_multiplier": nm,
        "accounting": {"sample_rate": rate, "steps": charged, **sampler_of(arm.method)},
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
        "method": arm["method"],
        "noise_multiplier": arm["noise_multiplier"],
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
        f"{'arm':<{w}}{'test acc':>9}{'eps':>7}{'sigma':>7}{'steps':>7}{'to base':>8}{'train s':>9}{'overhead':>10}"
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
            f"{label:<{w}}{s['accuracy']:>9.4f}{s['epsilon']:>7.2f}{s['noise_multiplier']:>7.3f}{s['steps']:>7d}"
            f"{'-' if reach is None else reach:>8}{s['train_seconds']:>9.1f}{over:>9.2f}%{gated:>10}{pos:>9}{cos:>16}"
        )
    lines.append(
        "sigma: noise multiplier, calibrated through the arm's own accounting (BandMF: b·q, ceil(T/b) steps); "
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


def comparison(result: dict[str, Any]) -> str:
    """Each arm's test-accuracy difference to DP-SGD (``dp-lora``) beside both ε (one accountant), and
    :data:`CAVEAT`."""
    summary, delta = result["summary"], result["config"]["delta"]
    base = summary["dp-lora"]
    lines = [
        f"{label} - dp-lora: {100 * (s['accuracy'] - base['accuracy']):+.2f} test accuracy points; "
        f"eps {s['epsilon']:.3f} vs {base['epsilon']:.3f} (target {result['config']['epsilon']:g}, "
        f"{result['accountant'].upper()} accountant, delta {delta:g})"
        for label, s in summary.items()
        if label != "dp-lora"
    ]
    return "\n".join([*lines, CAVEAT])


def proxy_line(proxy: dict[str, Any] | None, q: float, steps: int) -> str:
    """The proxy's ratios and its choice, one line (empty without a ``bandmf`` arm)."""
    if proxy is None:
        return ""
    ratios = ", ".join(f"b={b} {r['ratio']:.3f}" for b, r in proxy["bands"].items())
    return f"noise-error proxy at q={q:.4f}, T={steps} (BandMF / DP-SGD): {ratios}; b = {proxy['best_b']}"


def machine(load0: tuple[float, float, float]) -> dict[str, Any]:
    """Where the run ran (:func:`dp_bench.meta.machine`) and the load average at its start and end."""
    return {**meta.machine(), "loadavg_start": load0, "loadavg_end": os.getloadavg()}


def train_arms(
    cfg: Config, task: FrozenTextTask, arms: list[Arm], q: float
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every arm trained from the same seed (:func:`run_arm`), and their summaries (:func:`summarize`)."""
    from tqdm.auto import tqdm

    probe = build_top(
        task, Trainable("lora", "qkvoid", cfg.rank, cfg.alpha), cfg.seed, pooling=cfg.pooling, reinit_head=False
    )
    acc0 = evaluate(probe, task.test, task.input_names, cfg.eval_batch)["accuracy"]
    runs: dict[str, dict[str, Any]] = {}
    for arm in arms:
        nm = noise_multiplier(cfg, arm, q)
        rate, charged = accounting(arm.method, q, cfg.steps)
        tqdm.write(f"{arm.label}: noise multiplier {nm:.4f} for eps={cfg.epsilon} ({charged} steps of q={rate:.4f})")
        runs[arm.label] = run_arm(arm, task, nm, cfg, acc0)
    summaries = {label: summarize(a) for label, a in runs.items()}
    for label, a in runs.items():
        summaries[label]["steps_to_baseline_final_accuracy"] = steps_to_reach(a["curve"], runs["dp-lora"]["accuracy"])
    return runs, summaries


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

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
    n_train, n_test, info = len(task.train), len(task.test), task.info
    q = cfg.batch_size / n_train
    tqdm.write(
        f"{info['model']} on {info['dataset']}: train {n_train}, test {n_test}, LoRA r={cfg.rank} on top "
        f"{cfg.lora_layers} layer(s); cache {t_cache:.0f}s (split check {info['split_check']:.1e}); "
        f"{cfg.steps} steps of expected batch {cfg.batch_size} (q={q:.4f}) at eps={cfg.epsilon}"
    )
    t1 = time.perf_counter()
    arms, proxy = plan(cfg, q)
    t_proxy = time.perf_counter() - t1
    if proxy is not None:
        tqdm.write(f"{proxy_line(proxy, q, cfg.steps)} ({t_proxy:.0f}s)")
    runs, summaries = train_arms(cfg, task, arms, q)
    out = output_folder(cfg)
    out.mkdir(parents=True, exist_ok=True)
    plots = {"accuracy": str(out / "demo_accuracy.png"), **plot_spectrum_of(runs, out)}
    wall = time.perf_counter() - t0
    result = {
        **header,
        "out": str(out),
        "data": dict(info, train=n_train, test=n_test),
        "accountant": "prv",
        "noise_multiplier": runs["dp-lora"]["noise_multiplier"],
        "sample_rate": q,
        "proxy": proxy,
        "proxy_bands": list(BANDS),
        "proxy_seconds": t_proxy,
        "cache_seconds": t_cache,
        "split_check_max_abs": info["split_check"],
        "wall_seconds": wall,
        "cpu_seconds": time.process_time() - cpu0,
        "machine": machine(load0),
        "summary": summaries,
        "plots": plots,
        "arms": {
            label: {k: v for k, v in a.items() if k != "recorded"} | {"note": arm_note(arm, proxy)}
            for arm, (label, a) in zip(arms, runs.items(), strict=True)
        },
    }
    print()
    runner.write(result, REPORT, out / "demo.json", out / "demo_accuracy.png", indent=1)
    pngs = ", ".join(v for k, v in plots.items() if k in ("accuracy", "spectrum"))
    print(
        f"\nwall time {wall:.0f}s (CPU {result['cpu_seconds']:.0f}s, load average {load0[0]:.1f} at start); "
        f"wrote {out / 'demo.json'} and {pngs}"
    )
    return result


def tables(result: dict[str, Any]) -> str:
    """The results table of a demo result (:func:`table`), then :func:`comparison`."""
    notes = {label: a.get("note") for label, a in result["arms"].items()}
    config = result["config"]
    proxy = proxy_line(result.get("proxy"), result["sample_rate"], config["steps"])
    parts = [table(result["summary"], result["arms"]["dp-lora"]["train_seconds"], notes), proxy, comparison(result)]
    return "\n".join(p for p in parts if p)


def plot(result: dict[str, Any], png: Path) -> None:
    """The accuracy plot of a demo result (:func:`plot_accuracy`)."""
    c, info = result["config"], result["data"]
    title = (
        f"{info['model']} / {info['dataset'].split(' ')[0]}: eps={c['epsilon']}, B={c['batch_size']}, "
        f"{c['steps']} steps"
    )
    plot_accuracy(result["arms"], {label: a.get("note") for label, a in result["arms"].items()}, png, title)


#: the runner's report protocol for this command
REPORT = runner.Report(tables=tables, plot=plot)


def missing_arms(cfg: Config, stored: Sequence[str]) -> list[str]:
    """The arms of ``cfg`` a stored demo.json lacks; ``bandmf`` (b by the proxy) is there as any ``bandmf:<b>``."""
    wanted = ["dp-lora", *(e if e == "bandmf" else arm_of(e).label for e in cfg.extra_arms())]
    return [
        w for w in wanted if w not in stored and not (w == "bandmf" and any(s.startswith("bandmf:") for s in stored))
    ]


def replot(cfg: Config) -> dict[str, Any]:
    """The table and the accuracy plot of ``<out or docs/results>/demo.json`` (never rewritten), drawn into
    ``--out``, docs/results (``--refresh-evidence``) or a fresh folder. Arms the JSON lacks are named."""
    source = cfg.out if cfg.out is not None else RESULTS
    out = output_folder(cfg)
    stored = runner.replot(source / "demo.json", REPORT, out / "demo_accuracy.png")
    missing = missing_arms(cfg, list(stored["arms"]))
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
