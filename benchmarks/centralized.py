"""Centralized evidence benchmark (paper A; issue 6 item 3, issue 5 item 3): DP-LoRA with and without denoisers.

    python benchmarks/centralized.py                       # all-MiniLM-L6-v2 / Rotten Tomatoes (see docs/results.md)
    python benchmarks/centralized.py --model tiny --steps 2 --seeds 0 --epsilons 3 --baseline-epsilons 6 --out /tmp/c
    python benchmarks/centralized.py --replot              # PNG + tables from docs/results/centralized.json

Protocol:

* Model/data/caching as in ``benchmarks/_common.py`` (all-MiniLM-L6-v2, packaged Rotten Tomatoes, max_length
  48, frozen bottom layers cached exactly, LoRA on the top ``--top-layers`` layer(s) + classifier head).
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

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DEFAULT_OUT = C.RESULTS
BASELINE = "dp-lora"


def method_hooks(method: str) -> list[str]:
    """``dp-lora`` -> [], ``rmt+doppler`` -> ["rmt", "doppler"]."""
    return [] if method == BASELINE else method.split("+")


def calibrate(eps: float, sample_rate: float, steps: int, delta: float = 1e-5) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=sample_rate,
                                      steps=steps, accountant="prv"))


def planned_runs(args: argparse.Namespace) -> list[tuple[str, float, int]]:
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


def seed_major(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    runs = []
    for seed in args.seeds:
        for eps in args.epsilons:
            for m in args.methods:
                if "doppler" in m and args.doppler_epsilons is not None and eps not in args.doppler_epsilons:
                    continue
                runs.append((m, eps, seed))
        for eps in args.baseline_epsilons:
            if eps not in args.epsilons:
                runs.append((BASELINE, eps, seed))
    return runs


def run_key(method: str, eps: float, seed: int) -> str:
    return f"{method}|{eps:g}|{seed}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    C.quiet_warnings()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    task = C.load_cached_task(args.model, args.max_length, args.top_layers, tiny_train=args.tiny_train,
                              tiny_test=args.tiny_test)
    n_train = int(task.train_y.shape[0])
    q = args.batch_size / n_train
    path = args.out / "centralized.json"
    result: dict[str, Any]
    if args.resume and path.is_file():
        result = json.loads(path.read_text())
    else:
        result = {"runs": {}}
    result.update({
        "command": "python benchmarks/centralized.py " + " ".join(args.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "argv"},
        "data": dict(task.info, train=n_train, test=int(task.test_y.shape[0])),
        "sample_rate": q,
        "versions": C.versions(),
        "machine": C.machine(),
    })
    tr = C.Trainable.parse(args.trainable)
    eval_at = sorted({s for s in range(args.eval_every, args.steps + 1, args.eval_every)} | {args.steps})
    acc0: dict[int, float] = {}
    plan = planned_runs(args)
    args.out.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    bar = tqdm(plan, desc="centralized grid", unit="run")
    for method, eps, seed in bar:
        key = run_key(method, eps, seed)
        if key in result["runs"]:
            continue
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            tqdm.write(f"time budget {args.time_budget}s reached: not starting {key} and later runs")
            result["stopped_by_time_budget"] = True
            break
        nm = calibrate(eps, q, args.steps)
        top = C.build_top(task, tr, seed)
        if seed not in acc0:
            acc0[seed] = C.evaluate(top, task)
        r = C.run_dp(top, task, method_hooks(method), noise_multiplier=nm, batch_size=args.batch_size,
                     steps=args.steps, seed=seed, lr=args.lr, max_grad_norm=args.max_grad_norm,
                     physical_batch=args.physical_batch, eval_at=eval_at, desc=f"{method} eps={eps:g} s{seed}")
        result["runs"][key] = {
            "method": method, "hooks": method_hooks(method), "target_epsilon": eps, "epsilon": r["epsilon"],
            "seed": seed, "noise_multiplier": nm, "curve": [(0, acc0[seed])] + r["curve"],
            "train_seconds": r["train_seconds"], "per_step": r["per_step"],
        }
        tqdm.write(f"{key:<24} acc {r['curve'][-1][1]:.4f}  eps {r['epsilon']:.2f}  nm {nm:.3f}  "
                   f"{r['train_seconds']:.0f}s")
        result["wall_seconds"] = time.perf_counter() - t_start
        path.write_text(json.dumps(result, default=float))
    bar.close()
    result["machine"]["loadavg_end"] = C.machine()["loadavg"]
    result["wall_seconds"] = time.perf_counter() - t_start
    result["analysis"] = analyze(result)
    path.write_text(json.dumps(result, default=float))
    replot(path, args.out)
    return result


# ----------------------------------------------------------------------------------------------- analysis


def crossing_step(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """First step at which the accuracy curve reaches ``target`` (linear interpolation between checkpoints)."""
    prev = None
    for s, a in curve:
        if a >= target:
            if prev is None or prev[1] >= target:
                return float(s)
            (s0, a0) = prev
            return float(s0 + (target - a0) / (a - a0) * (s - s0))
        prev = (s, a)
    return None


def eps_at_accuracy(eps_acc: Sequence[tuple[float, float]], acc: float) -> tuple[float | None, str]:
    """ε at which the baseline reaches ``acc``: interpolation in log ε on the (running-max) accuracy curve.

    Returns (ε, "") inside the measured range, or (None, "<min" / ">max") outside it.
    """
    pts = sorted(eps_acc)
    if len(pts) < 2:
        return None, "n/a"
    es = np.log([p[0] for p in pts])
    ac = np.maximum.accumulate([p[1] for p in pts])
    if acc <= ac[0]:
        return (float(pts[0][0]), "") if acc == ac[0] else (None, f"<{pts[0][0]:g}")
    if acc > ac[-1]:
        return None, f">{pts[-1][0]:g}"
    i = int(np.searchsorted(ac, acc))  # ac[i-1] < acc <= ac[i]
    if ac[i] == ac[i - 1]:
        return float(math.exp(es[i])), ""
    t = (acc - ac[i - 1]) / (ac[i] - ac[i - 1])
    return float(math.exp(es[i - 1] + t * (es[i] - es[i - 1]))), ""


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    runs = list(result["runs"].values())
    cfg = result["config"]
    steps = cfg["steps"]
    out: dict[str, Any] = {}
    by = {}
    for r in runs:
        by.setdefault((r["method"], r["target_epsilon"]), {})[r["seed"]] = r
    base_curves: dict[int, list[tuple[float, float]]] = {}
    for (m, e), seeds in by.items():
        if m == BASELINE:
            for s, r in seeds.items():
                base_curves.setdefault(s, []).append((e, r["curve"][-1][1]))
    mean_base = {}
    for (m, e), seeds in by.items():
        if m == BASELINE:
            mean_base[e] = float(np.mean([r["curve"][-1][1] for r in seeds.values()]))
    for (m, e), seeds in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0] != BASELINE, kv[0][0])):
        if e not in cfg["epsilons"]:
            continue
        base = by.get((BASELINE, e), {})
        finals = [r["curve"][-1][1] for r in seeds.values()]
        ckpts = [s for s, _ in next(iter(seeds.values()))["curve"]]
        acc_ck = {str(s): C.mean_std([dict(map(tuple, r["curve"]))[s] for r in seeds.values()]) for s in ckpts}
        speed, reached = [], 0
        eps_saved = []
        for s, r in seeds.items():
            if s in base:
                t = crossing_step(r["curve"], base[s]["curve"][-1][1])
                if t is not None:
                    reached += 1
                    speed.append(1.0 - t / steps)
            if s in base_curves:
                eb, flag = eps_at_accuracy(base_curves[s], r["curve"][-1][1])
                eps_saved.append((1.0 - e / eb) if eb else flag)
        eb_mean, flag_mean = eps_at_accuracy(sorted(mean_base.items()), float(np.mean(finals)))
        speed_mean_curve = None
        common = [s for s in seeds if s in base]
        if common:  # mean curves over the seeds both have
            mean_curve = _mean_curve([seeds[s] for s in common])
            t = crossing_step(mean_curve, float(np.mean([base[s]["curve"][-1][1] for s in common])))
            speed_mean_curve = None if t is None else 1.0 - t / steps
        gated = C.gated_gain_stats([x for r in seeds.values() for x in r["per_step"]])
        enc_gated = C.gated_gain_stats([dict(x, gated_names=[n for n in x.get("gated_names", []) if "classifier" not in n])
                                        for r in seeds.values() for x in r["per_step"]])
        n_gated = [sum(x.get("gated", 0) for x in r["per_step"]) for r in seeds.values()]
        n_mats = [sum(x.get("matrices", 0) for x in r["per_step"]) for r in seeds.values()]
        cos = [C.global_cos_stats(r["per_step"]) for r in seeds.values()]
        out[f"{m}|{e:g}"] = {
            "method": m, "epsilon": e, "seeds": sorted(seeds), "final_acc": C.mean_std(finals),
            "acc_at": acc_ck,
            "speedup": C.mean_std(speed) if speed else (float("nan"), float("nan")),
            "speedup_per_seed": speed, "speedup_mean_curve": speed_mean_curve, "reached_baseline_final": reached, "n_with_baseline": sum(1 for s in seeds if s in base),
            "eps_saved_per_seed": eps_saved,
            "eps_saved": C.mean_std([x for x in eps_saved if isinstance(x, float)]),
            "eps_baseline_equal_acc_mean": eb_mean if eb_mean else flag_mean,
            "eps_saved_mean_curve": (1.0 - e / eb_mean) if eb_mean else flag_mean,
            "cos_noisy": C.mean_std([c["cos_noisy"] for c in cos]),
            "cos_denoised": C.mean_std([c["cos_denoised"] for c in cos]),
            "cos_rel_gain": C.mean_std([c["rel_gain"] for c in cos]),
            "gated_gain": gated, "encoder_gated_gain": enc_gated,
            "gated": int(sum(n_gated)), "matrices": int(sum(n_mats)),
            "seconds_per_step": C.mean_std([r["train_seconds"] / max(1, len(r["per_step"])) for r in seeds.values()]),
            "rmt_seconds_per_step": C.mean_std([float(np.mean([x.get("rmt_seconds", 0.0) for x in r["per_step"]]))
                                                for r in seeds.values()]),
        }
    out["_baseline_eps_curve"] = {f"{e:g}": C.mean_std([r["curve"][-1][1] for r in by[(BASELINE, e)].values()])
                                  for e in sorted(mean_base)}
    return out


def _mean_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """Checkpoint-wise mean accuracy over runs with the same checkpoints."""
    xs = [s for s, _ in runs[0]["curve"]]
    ys = np.mean([[a for _, a in r["curve"]] for r in runs if [s for s, _ in r["curve"]] == xs], axis=0)
    return list(zip(xs, ys.tolist()))


def tables(result: dict[str, Any]) -> str:
    an = result.get("analysis") or analyze(result)
    cfg = result["config"]
    ck = [str(s) for s in sorted({int(s) for k, v in an.items() if not k.startswith("_") for s in v["acc_at"]})]
    show = ck if len(ck) <= 7 else [c for c in ck if int(c) in (0, cfg["steps"]) or int(c) % max(cfg["eval_every"] * 2, 1) == 0]
    head = "| ε | method | seeds | " + " | ".join(f"acc @ {c}" for c in show) + " |"
    lines = ["#### Accuracy at checkpoints (mean ± std over seeds)", "", head,
             "|---|---|---|" + "---|" * len(show)]
    for k, v in an.items():
        if k.startswith("_"):
            continue
        cells = [C.fmt(tuple(v["acc_at"][c])) if c in v["acc_at"] else "–" for c in show]
        lines.append(f"| {v['epsilon']:g} | {v['method']} | {len(v['seeds'])} | " + " | ".join(cells) + " |")
    lines += ["", "#### Speed-up, ε saved, oracle cosines", "",
              "| ε | method | final acc | reached baseline final acc | step speed-up (seeds that reached) | speed-up (mean curves) | ε saved (per seed) | ε saved (mean curve) | global cos noisy → denoised | rmt-gated matrix-steps, gain > 0 (encoder only) | s/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in an.items():
        if k.startswith("_"):
            continue
        g, ge = v["gated_gain"], v["encoder_gated_gain"]
        gg = (f"{g['positive']}/{g['gated_layer_steps']} ({ge['positive']}/{ge['gated_layer_steps']})"
              if "rmt" in v["method"] else "–")
        es = v["eps_saved_per_seed"]
        es_txt = C.fmt(tuple(v["eps_saved"]), 3, pct=True) if any(isinstance(x, float) for x in es) else "–"
        if any(isinstance(x, str) for x in es):
            es_txt += " [" + ", ".join(x for x in es if isinstance(x, str)) + "]"
        em = v["eps_saved_mean_curve"]
        em_txt = f"{100 * em:.1f} %" if isinstance(em, float) else str(em)
        # the baseline row: the baseline against its own final accuracy (a reference: > 0 when its curve peaked earlier)
        sp = C.fmt(tuple(v["speedup"]), 3, pct=True)
        smc = v.get("speedup_mean_curve")
        smc_txt = "not reached" if smc is None else f"{100 * smc:.1f} %"
        lines.append(
            f"| {v['epsilon']:g} | {v['method']} | {C.fmt(tuple(v['final_acc']))} | "
            f"{v['reached_baseline_final']}/{v['n_with_baseline']} | {sp} | {smc_txt} | "
            f"{es_txt if v['method'] != BASELINE else '–'} | {em_txt if v['method'] != BASELINE else '–'} | "
            f"{v['cos_noisy'][0]:.3f} → {v['cos_denoised'][0]:.3f} | {gg} | {v['seconds_per_step'][0]:.2f} |"
        )
    lines += ["", "#### Baseline accuracy vs ε (the curve for ε saved)", "", "| ε | DP-LoRA final acc |", "|---|---|"]
    for e, ms in an["_baseline_eps_curve"].items():
        lines.append(f"| {e} | {C.fmt(tuple(ms))} |")
    return "\n".join(lines) + "\n"


def replot(path: Path, out: Path) -> Path:
    """Regenerate ``centralized.png`` from the JSON (tables: :func:`tables`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(path).read_text())
    result["analysis"] = analyze(result)
    Path(path).write_text(json.dumps(result, default=float))  # keep the stored analysis in step with the code
    cfg = result["config"]
    eps_list = cfg["epsilons"]
    fig, axes = plt.subplots(1, len(eps_list) + 1, figsize=(5 * (len(eps_list) + 1), 4))
    methods = list(dict.fromkeys(r["method"] for r in result["runs"].values()))
    colors = {m: plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10] for i, m in enumerate(methods)}
    for ax, eps in zip(axes, eps_list):
        for m in methods:
            rs = [r for r in result["runs"].values() if r["method"] == m and r["target_epsilon"] == eps]
            if not rs:
                continue
            xs = [s for s, _ in rs[0]["curve"]]
            ys = np.array([[a for _, a in r["curve"]] for r in rs if len(r["curve"]) == len(xs)])
            mu, sd = ys.mean(0), ys.std(0)
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
    ax.errorbar(es, [bc[e][0] for e in bc], yerr=[bc[e][1] for e in bc], marker="o", color=colors.get(BASELINE, "k"),
                label="dp-lora (baseline) vs ε")
    for k, v in result["analysis"].items():
        if k.startswith("_") or v["method"] == BASELINE:
            continue
        ax.errorbar([v["epsilon"]], [v["final_acc"][0]], yerr=[v["final_acc"][1]], marker="s", ls="",
                    color=colors[v["method"]], label=f"{v['method']} ε={v['epsilon']:g}", alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel(f"final test accuracy ({cfg['steps']} steps)")
    ax.set_title("ε at equal accuracy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.suptitle(f"{result['data'].get('model')} / Rotten Tomatoes, {C.Trainable.parse(cfg['trainable']).label}, "
                 f"top {cfg['top_layers']} layer(s), B = {cfg['batch_size']}, {cfg['steps']} steps", fontsize=10)
    fig.tight_layout()
    png = out / "centralized.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--top-layers", type=int, default=1)
    p.add_argument("--trainable", default="lora:qv:8", help="'lora:<targets>:<rank>' or 'full'")
    p.add_argument("--batch-size", type=int, default=256, help="expected logical (Poisson) batch size")
    p.add_argument("--physical-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="fixed logical step budget per run")
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--epsilons", nargs="+", type=float, default=[3.0, 8.0])
    p.add_argument("--baseline-epsilons", nargs="*", type=float, default=[1.5, 5.0, 16.0],
                   help="extra ε for the baseline only (accuracy-vs-ε curve for 'ε saved')")
    p.add_argument("--methods", nargs="+",
                   default=["dp-lora", "rmt", "lowpass", "rmt+lowpass", "doppler", "rmt+doppler"])
    p.add_argument("--doppler-epsilons", nargs="*", type=float, default=None,
                   help="run the doppler methods only at these ε (default: all --epsilons)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--order", choices=("seed", "priority"), default="seed", help="execution order, see planned_runs")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--tiny-train", type=int, default=256)
    p.add_argument("--tiny-test", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no new run starts after it")
    p.add_argument("--resume", action="store_true", help="keep the runs already in <out>/centralized.json")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--replot", action="store_true", help="only regenerate PNG/tables from <out>/centralized.json")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps < 1 or args.eval_every < 1 or args.batch_size < 1:
        p.error("--steps, --eval-every and --batch-size must be >= 1")
    if BASELINE not in args.methods:
        p.error(f"--methods must include the baseline {BASELINE!r}")
    try:
        C.Trainable.parse(args.trainable)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | Path:
    args = parse_args(argv)
    if args.replot:
        png = replot(args.out / "centralized.json", args.out)
        print(tables(json.loads((args.out / "centralized.json").read_text())))
        return png
    result = run(args)
    print("\n" + tables(result))
    print(f"wall {result['wall_seconds']:.0f}s; wrote {args.out / 'centralized.json'}, {args.out / 'centralized.png'}")
    return result


if __name__ == "__main__":
    main()
