"""Centralized benchmark (paper A, arXiv 2510.01137): DP-LoRA with and without denoisers on Rotten Tomatoes.

    dp-bench centralized                       # all-MiniLM-L6-v2 / Rotten Tomatoes (see docs/results.md)
    dp-bench centralized --model tiny --steps 2 --seeds 0 --epsilons 3 --baseline-epsilons 6 --out /tmp/c
    dp-bench centralized --replot              # PNG + tables from docs/results/centralized.json

Protocol:

* Model/data/caching: :func:`dp_bench.task.frozen_text_task` (all-MiniLM-L6-v2, packaged Rotten Tomatoes,
  max_length 48, frozen bottom layers cached exactly), LoRA on the top ``--top-layers`` layer(s) + classifier head.
* DP-SGD (Opacus, Poisson sampling, flat clipping C, AdamW), a fixed budget of ``--steps`` logical steps of
  expected batch ``--batch-size``; the noise multiplier is calibrated (PRV accountant, δ = 1e-5) so those
  steps reach exactly the target ε. Denoising is post-processing: it does not change ε.
* Methods (``--methods``): ``dp-lora`` (no denoiser) and ``+``-joined ``post_hooks``: ``rmt``, ``lowpass``,
  ``rmt+lowpass``, ``doppler`` (third-party plugin), ``rmt+doppler``. Every method of a seed shares the
  adapter/head initialization, the Poisson batches and the noise draws (common random numbers).
* Privacy levels ``--epsilons``; the baseline is also run at ``--baseline-epsilons`` to map accuracy vs ε,
  from which "ε saved at equal accuracy" is read (paper A's protocol: the ε at which the baseline reaches a
  method's final accuracy, by linear interpolation in log ε; saving = 1 − ε_method / ε_baseline).
* Step speed-up: the first step (linear interpolation between checkpoints) at which a method reaches the
  same-seed baseline's final accuracy; speed-up = 1 − that step / ``--steps``.
* Oracle (``oracle=True``): cos(noisy, clean) and cos(denoised, clean) per step, globally and per matrix;
  the share of ``rmt``-gated matrix-steps with cos(denoised, clean) > cos(noisy, clean).
* Runs are executed seed-major (every method and ε for seed 0, then seed 1, ...) and appended to the JSON
  as they finish; ``--resume`` skips runs already in it, ``--time-budget`` stops starting new runs after that
  many seconds (the report states which runs exist).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import runner
from ..adapters import Trainable, build_top
from ..analysis import crossing_step, eps_at_accuracy, fmt, gated_gain_stats, global_cos_stats, mean_std
from ..config import opt, parse_config, start
from ..meta import RESULTS, machine
from ..store import SharedResult
from ..task import frozen_text_task
from ..train import evaluate, run_dp

__all__ = [
    "Config",
    "analyze",
    "crossing_step",
    "eps_at_accuracy",
    "main",
    "method_hooks",
    "planned_runs",
    "plot",
    "replot",
    "run",
    "tables",
    "upgrade",
]

METHODS = ["dp-lora", "rmt", "lowpass", "rmt+lowpass", "doppler", "rmt+doppler"]


@dataclass
class Config:
    model: str = opt("minilm", "minilm or tiny", choices=("minilm", "tiny"))
    max_length: int = opt(48, "tokens per example")
    top_layers: int = opt(1, "trained top encoder layers (the rest is cached)")
    trainable: str = opt("lora:qv:8", "'lora:<targets>:<rank>' or 'full'")
    batch_size: int = opt(256, "expected logical (Poisson) batch size")
    physical_batch: int = opt(256, "physical batch size")
    steps: int = opt(40, "fixed logical step budget per run")
    eval_every: int = opt(8, "evaluate every N steps")
    epsilons: list[float] = opt([3.0, 8.0], "privacy levels")
    baseline_epsilons: list[float] = opt(
        [1.5, 5.0, 16.0], "extra ε for the baseline only (accuracy-vs-ε curve for 'ε saved')"
    )
    methods: list[str] = opt(METHODS, "dp-lora and '+'-joined post_hooks")
    doppler_epsilons: list[float] = opt(
        [], "run the doppler methods only at these ε (empty: all --epsilons)", type=float
    )
    seeds: list[int] = opt([0, 1, 2], "training seeds")
    order: str = opt("seed", "execution order, see planned_runs", choices=("seed", "priority"))
    lr: float = opt(5e-3, "AdamW learning rate")
    max_grad_norm: float = opt(1.0, "clipping bound C")
    tiny_train: int = opt(256, "--model tiny: synthetic train size")
    tiny_test: int = opt(64, "--model tiny: synthetic test size")
    threads: int = opt(0, "torch threads (0: torch's choice)")
    time_budget: float = opt(0.0, "seconds; no new run starts after it (0: none)")
    resume: bool = opt(False, "keep the runs already in <out>/centralized.json")
    out: Path = opt(RESULTS, "output folder")
    replot: bool = opt(False, "only regenerate PNG/tables from <out>/centralized.json")

    def validate(self) -> None:
        if self.steps < 1 or self.eval_every < 1 or self.batch_size < 1:
            raise ValueError("--steps, --eval-every and --batch-size must be >= 1")
        if BASELINE not in self.methods:
            raise ValueError(f"--methods must include the baseline {BASELINE!r}")
        Trainable.parse(self.trainable)


BASELINE = "dp-lora"


def method_hooks(method: str) -> list[str]:
    """``dp-lora`` -> [], ``rmt+doppler`` -> ["rmt", "doppler"]."""
    return [] if method == BASELINE else method.split("+")


def calibrate(eps: float, sample_rate: float, steps: int, delta: float = 1e-5) -> float:
    """The noise multiplier for ``eps`` at ``delta`` (PRV): :func:`opacus_spectral.noise_multiplier_for`."""
    from opacus_spectral import noise_multiplier_for

    return noise_multiplier_for(
        target_epsilon=eps, target_delta=delta, sample_rate=sample_rate, steps=steps, accountant="prv"
    )


def hook_specs(names: Sequence[str]) -> list[Any]:
    """post_hooks for a method: ``rmt`` with per-matrix stats (which matrices were gated)."""
    return [("rmt_paper", {"per_matrix_stats": True}) if n == "rmt" else n for n in names]  # paper A's setting


def planned_runs(args: Config) -> list[tuple[str, float, int]]:
    """(method, ε, seed) in execution order.

    ``--order seed``: seed-major (every method and ε of seed 0, then seed 1, ...; the extra baseline ε last
    within a seed). ``--order priority``: first the baseline and ``rmt`` at the main ε for every seed (the
    paper's claim), then the extra baseline ε for every seed (the ε-saved curve), then the other methods
    seed-major — so a time budget cuts the secondary comparisons first.
    """
    runs = seed_major(args)
    if args.order == "seed":
        return runs
    core = [r for r in runs if r[0] in (BASELINE, "rmt") and r[1] in args.epsilons]
    extra = [r for r in runs if r[0] == BASELINE and r[1] not in args.epsilons]
    return core + extra + [r for r in runs if r not in core and r not in extra]


def seed_major(args: Config) -> list[tuple[str, float, int]]:
    runs = []
    for seed in args.seeds:
        for eps in args.epsilons:
            for m in args.methods:
                if "doppler" in m and args.doppler_epsilons and eps not in args.doppler_epsilons:
                    continue
                runs.append((m, eps, seed))
        for eps in args.baseline_epsilons:
            if eps not in args.epsilons:
                runs.append((BASELINE, eps, seed))
    return runs


def run_key(method: str, eps: float, seed: int, lr: float) -> str:
    """The runner's one key format (``eval|method|eps<ε>|s<seed>|lr<lr>``): every run is an evaluation run."""
    return runner.run_key("eval", method, eps=eps, seed=seed, lr=lr)


def record_key(record: dict[str, Any], lr: float) -> str:
    """A stored run's key; ``lr``: the configured rate, for records from before runs stored theirs."""
    return run_key(record["method"], record["target_epsilon"], record["seed"], record.get("lr", lr))


def upgrade(result: dict[str, Any]) -> dict[str, Any]:
    """A stored result with its runs under the runner's one key format (:func:`run_key`): a JSON from before it
    keyed them ``method|ε|seed`` and its records hold no learning rate (the configured ``--lr`` then)."""
    lr = result["config"]["lr"]
    result["runs"] = {record_key(r, lr): r for r in result["runs"].values()}
    return result


@dataclass
class CentralizedSchedule:
    """No tuning here: every cell runs the configured ``--lr``."""

    lr: float

    def lrs(self, cell: runner.Cell, result: dict[str, Any]) -> list[float]:
        return [self.lr]


def new_result(header: dict[str, Any], args: Config, task: Any, path: Path) -> dict[str, Any]:
    """The stored runs (``--resume``, :func:`upgrade`: rekeyed) or none, with this invocation's ``header`` (command,
    configuration, versions, machine: :func:`dp_bench.config.start`) and data."""
    n_train = len(task.train)
    result: dict[str, Any]
    if args.resume and path.is_file():
        result = runner.load(path, REPORT)
    else:
        if path.is_file():  # a fresh grid: nothing of an old JSON under this name is merged in
            path.replace(path.with_name(path.name + ".old"))
        result = {"runs": {}}
    result.update(
        {
            **header,
            "data": dict(task.info, train=n_train, test=len(task.test)),
            "sample_rate": args.batch_size / n_train,
        }
    )
    return result


def train_run(
    args: Config,
    task: Any,
    tr: Trainable,
    method: str,
    eps: float,
    seed: int,
    eval_at: Sequence[int],
    acc0: dict[int, float],
) -> dict[str, Any]:
    """Train one (method, ε, seed) and return its record; ``acc0``: the step-0 test accuracy per seed (the
    seed's fresh model is evaluated once, every method of the seed starts from it)."""
    from tqdm.auto import tqdm

    nm = calibrate(eps, args.batch_size / len(task.train), args.steps)
    top = build_top(task, tr, seed)
    if seed not in acc0:
        acc0[seed] = evaluate(top, task.test, task.input_names)["accuracy"]
    r = run_dp(
        top,
        task.train,
        task.test,
        input_names=task.input_names,
        post_hooks=hook_specs(method_hooks(method)),
        noise_multiplier=nm,
        batch_size=args.batch_size,
        steps=args.steps,
        seed=seed,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        physical_batch=args.physical_batch,
        eval_at=eval_at,
        desc=f"{method} eps={eps:g} s{seed}",
    )
    key = run_key(method, eps, seed, args.lr)
    tqdm.write(f"{key:<32} acc {r['curve'][-1][1]:.4f}  eps {r['epsilon']:.2f}  nm {nm:.3f}  {r['train_seconds']:.0f}s")
    return {
        "method": method,
        "hooks": method_hooks(method),
        "target_epsilon": eps,
        "epsilon": r["epsilon"],
        "seed": seed,
        "lr": args.lr,
        "noise_multiplier": nm,
        "curve": [(0, acc0[seed])] + r["curve"],
        "train_seconds": r["train_seconds"],
        "per_step": r["per_step"],
    }


def run(args: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train the planned runs (:func:`planned_runs`) not yet in ``<out>/centralized.json``, saving it after each;
    then the analysis, the JSON and the plot."""
    header = start("centralized", args, argv)
    t_start = time.perf_counter()
    task = frozen_text_task(
        args.model, args.max_length, args.top_layers, tiny_train=args.tiny_train, tiny_test=args.tiny_test
    )
    path = args.out / "centralized.json"
    result = new_result(header, args, task, path)
    tr = Trainable.parse(args.trainable)
    eval_at = sorted({s for s in range(args.eval_every, args.steps + 1, args.eval_every)} | {args.steps})
    acc0: dict[int, float] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    store = SharedResult(path, result, wall=None, upgrade=upgrade)

    def over_budget() -> bool:
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            print(f"time budget {args.time_budget}s reached: no further run starts", flush=True)
            result["stopped_by_time_budget"] = True
            return True
        return False

    def train(cell: runner.Cell, lr: float) -> dict[str, Any]:
        rec = train_run(args, task, tr, cell.method, cell.eps, cell.seed, eval_at, acc0)
        result["wall_seconds"] = time.perf_counter() - t_start
        return rec

    plan = [runner.Cell("eval", m, eps, seed) for m, eps, seed in planned_runs(args)]
    runner.drive(store, plan, CentralizedSchedule(args.lr), train, desc="centralized grid", stop=over_budget)
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    result["wall_seconds"] = time.perf_counter() - t_start
    return runner.finish(result, REPORT, args.out / "centralized.png", store.save)


# ----------------------------------------------------------------------------------------------- analysis


def _by_cell(runs: Iterable[dict[str, Any]]) -> dict[tuple[str, float], dict[int, dict[str, Any]]]:
    """The runs by (method, ε), then by seed."""
    by: dict[tuple[str, float], dict[int, dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["method"], r["target_epsilon"]), {})[r["seed"]] = r
    return by


def _baseline_curves(
    by: dict[tuple[str, float], dict[int, dict[str, Any]]],
) -> tuple[dict[int, list[tuple[float, float]]], dict[float, float]]:
    """The baseline's (ε, final accuracy) per seed, and its mean final accuracy per ε."""
    base_curves: dict[int, list[tuple[float, float]]] = {}
    for (m, e), seeds in by.items():
        if m == BASELINE:
            for s, r in seeds.items():
                base_curves.setdefault(s, []).append((e, r["curve"][-1][1]))
    mean_base = {}
    for (m, e), seeds in by.items():
        if m == BASELINE:
            mean_base[e] = float(np.mean([r["curve"][-1][1] for r in seeds.values()]))
    return base_curves, mean_base


def _paired(
    seeds: dict[int, dict[str, Any]],
    base: dict[int, dict[str, Any]],
    base_curves: dict[int, list[tuple[float, float]]],
    e: float,
    steps: int,
) -> tuple[list[float], int, list[float | str]]:
    """Per seed against the same-seed baseline: the step speed-up (seeds that reached its final accuracy), how
    many reached it, and the ε saved (or why not: the flag of :func:`eps_at_accuracy`)."""
    speed, reached = [], 0
    eps_saved: list[float | str] = []
    for s, r in seeds.items():
        if s in base:
            t = crossing_step(r["curve"], base[s]["curve"][-1][1])
            if t is not None:
                reached += 1
                speed.append(1.0 - t / steps)
        if s in base_curves:
            eb, flag = eps_at_accuracy(base_curves[s], r["curve"][-1][1])
            eps_saved.append((1.0 - e / eb) if eb else flag)
    return speed, reached, eps_saved


def _speedup_mean_curve(seeds: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], steps: int) -> float | None:
    """The step speed-up of the mean curve over the seeds both have (``None``: none, or never reached)."""
    common = [s for s in seeds if s in base]
    if not common:
        return None
    mean_curve = _mean_curve([seeds[s] for s in common])
    t = crossing_step(mean_curve, float(np.mean([base[s]["curve"][-1][1] for s in common])))
    return None if t is None else 1.0 - t / steps


def _gate_stats(seeds: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The ``rmt`` gates: gated matrix-steps with a cosine gain (all, encoder only), gated and matrix counts."""
    records = [x for r in seeds.values() for x in r["per_step"]]
    encoder = [dict(x, gated_names=[n for n in x.get("gated_names", []) if "classifier" not in n]) for x in records]
    return {
        "gated_gain": gated_gain_stats(records),
        "encoder_gated_gain": gated_gain_stats(encoder),
        "gated": int(sum(sum(x.get("gated", 0) for x in r["per_step"]) for r in seeds.values())),
        "matrices": int(sum(sum(x.get("matrices", 0) for x in r["per_step"]) for r in seeds.values())),
    }


def _cell(
    m: str,
    e: float,
    seeds: dict[int, dict[str, Any]],
    base: dict[int, dict[str, Any]],
    base_curves: dict[int, list[tuple[float, float]]],
    mean_base: dict[float, float],
    steps: int,
) -> dict[str, Any]:
    """The analysis of one (method ``m``, ε ``e``) over its ``seeds``, against the baseline's runs ``base``."""
    finals = [r["curve"][-1][1] for r in seeds.values()]
    ckpts = [s for s, _ in next(iter(seeds.values()))["curve"]]
    acc_ck = {str(s): mean_std([dict(map(tuple, r["curve"]))[s] for r in seeds.values()]) for s in ckpts}
    speed, reached, eps_saved = _paired(seeds, base, base_curves, e, steps)
    eb_mean, flag_mean = eps_at_accuracy(sorted(mean_base.items()), float(np.mean(finals)))
    cos = [global_cos_stats(r["per_step"]) for r in seeds.values()]
    return {
        "method": m,
        "epsilon": e,
        "seeds": sorted(seeds),
        "final_acc": mean_std(finals),
        "acc_at": acc_ck,
        "speedup": mean_std(speed) if speed else (float("nan"), float("nan")),
        "speedup_per_seed": speed,
        "speedup_mean_curve": _speedup_mean_curve(seeds, base, steps),
        "reached_baseline_final": reached,
        "n_with_baseline": sum(1 for s in seeds if s in base),
        "eps_saved_per_seed": eps_saved,
        "eps_saved": mean_std([x for x in eps_saved if isinstance(x, float)]),
        "eps_baseline_equal_acc_mean": eb_mean if eb_mean else flag_mean,
        "eps_saved_mean_curve": (1.0 - e / eb_mean) if eb_mean else flag_mean,
        "cos_noisy": mean_std([c["cos_noisy"] for c in cos]),
        "cos_denoised": mean_std([c["cos_denoised"] for c in cos]),
        "cos_rel_gain": mean_std([c["rel_gain"] for c in cos]),
        **_gate_stats(seeds),
        "seconds_per_step": mean_std([r["train_seconds"] / max(1, len(r["per_step"])) for r in seeds.values()]),
        "rmt_seconds_per_step": mean_std(
            [float(np.mean([x.get("rmt_seconds", 0.0) for x in r["per_step"]])) for r in seeds.values()]
        ),
    }


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Per (method, ε) of ``--epsilons`` (:func:`_cell`; the baseline first within an ε), and the baseline's mean
    final accuracy per ε (``_baseline_eps_curve``, the curve of "ε saved")."""
    cfg = result["config"]
    by = _by_cell(result["runs"].values())
    base_curves, mean_base = _baseline_curves(by)
    out: dict[str, Any] = {}
    for (m, e), seeds in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0] != BASELINE, kv[0][0])):
        if e not in cfg["epsilons"]:
            continue
        out[f"{m}|{e:g}"] = _cell(m, e, seeds, by.get((BASELINE, e), {}), base_curves, mean_base, cfg["steps"])
    out["_baseline_eps_curve"] = {
        f"{e:g}": mean_std([r["curve"][-1][1] for r in by[(BASELINE, e)].values()]) for e in sorted(mean_base)
    }
    return out


def _mean_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """Checkpoint-wise mean accuracy over runs with the same checkpoints."""
    xs = [s for s, _ in runs[0]["curve"]]
    ys = np.mean([[a for _, a in r["curve"]] for r in runs if [s for s, _ in r["curve"]] == xs], axis=0)
    return list(zip(xs, ys.tolist(), strict=True))


def tables(result: dict[str, Any]) -> str:
    an = result.get("analysis") or analyze(result)
    cfg = result["config"]
    ck = [str(s) for s in sorted({int(s) for k, v in an.items() if not k.startswith("_") for s in v["acc_at"]})]
    show = (
        ck
        if len(ck) <= 7
        else [c for c in ck if int(c) in (0, cfg["steps"]) or int(c) % max(cfg["eval_every"] * 2, 1) == 0]
    )
    head = "| ε | method | seeds | " + " | ".join(f"acc @ {c}" for c in show) + " |"
    lines = ["#### Accuracy at checkpoints (mean ± std over seeds)", "", head, "|---|---|---|" + "---|" * len(show)]
    for k, v in an.items():
        if k.startswith("_"):
            continue
        cells = [fmt(tuple(v["acc_at"][c])) if c in v["acc_at"] else "–" for c in show]
        lines.append(f"| {v['epsilon']:g} | {v['method']} | {len(v['seeds'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "#### Speed-up, ε saved, oracle cosines",
        "",
        "| ε | method | final acc | reached baseline final acc | step speed-up (seeds that reached) "
        "| speed-up (mean curves) | ε saved (per seed) | ε saved (mean curve) | global cos noisy → denoised "
        "| rmt-gated matrix-steps, gain > 0 (encoder only) | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, v in an.items():
        if k.startswith("_"):
            continue
        g, ge = v["gated_gain"], v["encoder_gated_gain"]
        gg = (
            f"{g['positive']}/{g['gated_layer_steps']} ({ge['positive']}/{ge['gated_layer_steps']})"
            if "rmt" in v["method"]
            else "–"
        )
        es = v["eps_saved_per_seed"]
        es_txt = fmt(tuple(v["eps_saved"]), 3, pct=True) if any(isinstance(x, float) for x in es) else "–"
        if any(isinstance(x, str) for x in es):
            es_txt += " [" + ", ".join(x for x in es if isinstance(x, str)) + "]"
        em = v["eps_saved_mean_curve"]
        em_txt = f"{100 * em:.1f} %" if isinstance(em, float) else str(em)
        # the baseline row: the baseline against its own final accuracy (a reference: > 0 when its curve peaked earlier)
        sp = fmt(tuple(v["speedup"]), 3, pct=True)
        smc = v.get("speedup_mean_curve")
        smc_txt = "not reached" if smc is None else f"{100 * smc:.1f} %"
        lines.append(
            f"| {v['epsilon']:g} | {v['method']} | {fmt(tuple(v['final_acc']))} | "
            f"{v['reached_baseline_final']}/{v['n_with_baseline']} | {sp} | {smc_txt} | "
            f"{es_txt if v['method'] != BASELINE else '–'} | {em_txt if v['method'] != BASELINE else '–'} | "
            f"{v['cos_noisy'][0]:.3f} → {v['cos_denoised'][0]:.3f} | {gg} | {v['seconds_per_step'][0]:.2f} |"
        )
    lines += ["", "#### Baseline accuracy vs ε (the curve for ε saved)", "", "| ε | DP-LoRA final acc |", "|---|---|"]
    for e, ms in an["_baseline_eps_curve"].items():
        lines.append(f"| {e} | {fmt(tuple(ms))} |")
    return "\n".join(lines) + "\n"


def replot(path: Path, out: Path) -> Path:
    """Regenerate the analysis in the JSON and ``centralized.png`` from the stored runs (tables printed)."""
    runner.replot(path, REPORT, out / "centralized.png")
    return out / "centralized.png"


def plot(result: dict[str, Any], png: Path) -> None:
    """Accuracy curves per ε, and the baseline's accuracy vs ε with each method's point beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    eps_list = cfg["epsilons"]
    fig, axes = plt.subplots(1, len(eps_list) + 1, figsize=(5 * (len(eps_list) + 1), 4))
    methods = list(dict.fromkeys(r["method"] for r in result["runs"].values()))
    colors = {m: plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10] for i, m in enumerate(methods)}
    for ax, eps in zip(axes, eps_list, strict=False):  # axes has one more panel (the ε curve) than eps_list
        for m in methods:
            rs = [r for r in result["runs"].values() if r["method"] == m and r["target_epsilon"] == eps]
            if not rs:
                continue
            xs = [s for s, _ in rs[0]["curve"]]
            ys = np.array([[a for _, a in r["curve"]] for r in rs if len(r["curve"]) == len(xs)])
            mu = ys.mean(0)
            sd = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros_like(mu)  # sample s.d., as in the tables
            ax.plot(xs, mu, marker="o", ms=3, color=colors[m], label=f"{m} (n={len(ys)})")
            ax.fill_between(xs, mu - sd, mu + sd, color=colors[m], alpha=0.12)
        ax.set_title(f"ε = {eps:g}", fontsize=10)
        ax.set_xlabel("logical DP step")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    bc = result["analysis"]["_baseline_eps_curve"]
    es = [float(e) for e in bc]
    ax.errorbar(
        es,
        [bc[e][0] for e in bc],
        yerr=[bc[e][1] for e in bc],
        marker="o",
        color=colors.get(BASELINE, "k"),
        label="dp-lora (baseline) vs ε",
    )
    for k, v in result["analysis"].items():
        if k.startswith("_") or v["method"] == BASELINE:
            continue
        ax.errorbar(
            [v["epsilon"]],
            [v["final_acc"][0]],
            yerr=[v["final_acc"][1]],
            marker="s",
            ls="",
            color=colors[v["method"]],
            label=f"{v['method']} ε={v['epsilon']:g}",
            alpha=0.8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel(f"final test accuracy ({cfg['steps']} steps)")
    ax.set_title("ε at equal accuracy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.suptitle(
        f"{result['data'].get('model')} / Rotten Tomatoes, {Trainable.parse(cfg['trainable']).label}, "
        f"top {cfg['top_layers']} layer(s), B = {cfg['batch_size']}, {cfg['steps']} steps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


#: the runner's report protocol for this command (stored JSONs rekeyed on load: :func:`upgrade`)
REPORT = runner.Report(tables=tables, plot=plot, analyze=analyze, upgrade=upgrade)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | Path:
    args = parse_config(Config, argv, prog="dp-bench centralized", description=__doc__)
    if args.replot:
        return replot(args.out / "centralized.json", args.out)
    result = run(args, argv)
    print(f"wall {result['wall_seconds']:.0f}s; wrote {args.out / 'centralized.json'}, {args.out / 'centralized.png'}")
    return result
