"""Tables, paired statistics, verdicts and the plot of a federated grid (``dp-bench federated``), from its JSON only.

Per ε, every comparison is paired over the evaluation seeds (within a seed all methods share the partition, the
initializations and the noise seeds): the mean difference with a 95 % t-interval
(:func:`dp_bench.analysis.paired_ci`), on the final accuracy and on the mean of the last three rounds. At the
paper's ε (1) each claim gets a verdict (:func:`dp_bench.analysis.verdict`): "reproduced" when every interval it
rests on lies inside the claimed range, "contradicted" when one lies outside it, "inconclusive" otherwise. Beside
each interval: its paired t-test p-value Holm-adjusted within its family (one family per metric: every comparison
at every ε of the grid, :func:`dp_bench.analysis.holm`); the verdicts stay CI-based.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis import fmt_p, holm_family, mean_std, paired_ci, verdict
from ..probe import GROUPS

LABELS = {
    "dp-lora": "DP-LoRA",
    "ffa-lora": "FFA-LoRA",
    "rolora": "RoLoRA",
    "la-lora-nofilter": "LA-LoRA w/o filter",
    "la-lora": "LA-LoRA (binomial5 filter)",
}
#: comparison -> (method, baseline): differences method − baseline, paired by seed
COMPARISONS = {
    "la_minus_dp_lora": ("la-lora", "dp-lora"),
    "la_minus_ffa_lora": ("la-lora", "ffa-lora"),
    "la_minus_rolora": ("la-lora", "rolora"),
    "filter_gain": ("la-lora", "la-lora-nofilter"),
}
#: comparison -> the paper's lower bound on it (accuracy fraction; 0: no number is claimed)
TARGETS = {"la_minus_dp_lora": 0.10, "la_minus_ffa_lora": 0.03, "la_minus_rolora": 0.03, "filter_gain": 0.0}
ROW_LABELS = {
    "la_minus_dp_lora": "− DP-LoRA",
    "la_minus_ffa_lora": "− FFA-LoRA",
    "la_minus_rolora": "− RoLoRA",
    "filter_gain": "− LA-LoRA w/o filter\n(filter gain)",
}
#: the ε of the paper's claims
CLAIM_EPSILON = 1.0
#: claim -> (comparisons that must all lie in [bound, ∞), bound as an accuracy fraction)
CLAIMS = {
    "LA-LoRA ≥ DP-LoRA + 10 points": (("la_minus_dp_lora",), 0.10),
    "LA-LoRA ≥ best of FFA-LoRA/RoLoRA + 3 points": (("la_minus_ffa_lora", "la_minus_rolora"), 0.03),
    "binomial5 filter gain ≥ 0 (direction only)": (("filter_gain",), 0.0),
}
METRICS = ("final", "last3")


def last_k_mean(acc: Sequence[float], k: int) -> float:
    """Mean accuracy over the last ``k`` rounds (index 0 is the evaluation before training)."""
    tail = [a for a in acc[1:][-k:] if math.isfinite(a)]
    return sum(tail) / len(tail) if tail else float("nan")


def metric(run: dict[str, Any], name: str) -> float:
    """``"final"``: accuracy after the last round; ``"last3"``: mean of the last three rounds."""
    return float(run["accuracy"][-1]) if name == "final" else last_k_mean(run["accuracy"], 3)


def eval_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The evaluation runs (test split); records without a phase come from before tuning existed."""
    return [r for r in result["runs"].values() if r.get("phase", "eval") == "eval"]


def combine(verdicts: Sequence[str]) -> str:
    """A claim resting on several intervals: reproduced if all are, contradicted if any is, else inconclusive."""
    if verdicts and all(v == "reproduced" for v in verdicts):
        return "reproduced"
    return "contradicted" if "contradicted" in verdicts else "inconclusive"


def _share_means(runs: Sequence[dict[str, Any]], when: str, kind: str) -> dict[str, float] | None:
    shares = [r["grad_share"][when][kind] for r in runs if r.get("grad_share", {}).get(when)]
    return {g: float(np.mean([s[g] for s in shares])) for g in GROUPS} if shares else None


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Per ε: per-method summaries, paired comparisons (95 % t-intervals) and, at the paper's ε, verdicts."""
    runs = eval_runs(result)
    out: dict[str, Any] = {}
    for eps in sorted({float(r["epsilon"]) for r in runs}):
        by = {
            m: {r["seed"]: r for r in runs if r["method"] == m and float(r["epsilon"]) == eps}
            for m in dict.fromkeys(r["method"] for r in runs)
        }
        methods = {}
        for m, seeds in by.items():
            if not seeds:
                continue
            rs = list(seeds.values())
            methods[m] = {
                "seeds": sorted(seeds),
                "lr": rs[0].get("lr", result["config"].get("lr")),
                **{k: mean_std([metric(r, k) for r in rs]) for k in METRICS},
                "max_epsilon": max(r["max_epsilon"] for r in rs),
                "max_epsilon_other": max(
                    (r["epsilon_other"]["max_epsilon"] for r in rs if "epsilon_other" in r), default=float("nan")
                ),
                "other_accountant": rs[0].get("epsilon_other", {}).get("accountant"),
                "grad_share": {w: _share_means(rs, w, "per_example_share") for w in ("init", "final")},
                "grad_share_clipped_sum": {w: _share_means(rs, w, "clipped_sum_share") for w in ("init", "final")},
            }
        comparisons: dict[str, Any] = {}
        for key, (a, b) in COMPARISONS.items():
            if by.get(a) and by.get(b):
                common = sorted(set(by[a]) & set(by[b]))
                comparisons[key] = {
                    "seeds": common,
                    **{k: paired_ci([metric(by[a][s], k) - metric(by[b][s], k) for s in common]) for k in METRICS},
                }
        block: dict[str, Any] = {"methods": methods, "comparisons": comparisons}
        if eps == CLAIM_EPSILON:
            block["verdicts"] = {
                claim: {k: combine([verdict(comparisons[c][k], bound) for c in keys]) for k in METRICS}
                for claim, (keys, bound) in CLAIMS.items()
                if all(c in comparisons for c in keys)
            }
        out[f"{eps:g}"] = block
    for k in METRICS:
        holm_family([c[k] for block in out.values() for c in block["comparisons"].values()])
    return out


def _ci(ci: dict[str, Any]) -> str:
    if not ci or ci.get("n", 0) == 0:
        return "–"
    if not math.isfinite(ci["lo"]):
        return f"{100 * ci['mean']:+.1f} (n={ci['n']})"
    return f"{100 * ci['mean']:+.1f} [{100 * ci['lo']:+.1f}, {100 * ci['hi']:+.1f}]"


def _eps(s: dict[str, Any]) -> str:
    other = s.get("other_accountant")
    return f"{s['max_epsilon']:.3f}" + (f" ({other} {s['max_epsilon_other']:.3f})" if other else "")


def _share(s: dict[str, float] | None) -> str:
    return "–" if not s else " / ".join(f"{100 * s[g]:.1f}" for g in GROUPS)


def tables(result: dict[str, Any]) -> str:
    """Markdown: the learning-rate choice, per-ε method table, paired comparisons and verdicts."""
    an = result.get("analysis") or analyze(result)
    cfg = result["config"]
    lines = []
    if result.get("lr_choice"):
        lines += [
            f"Learning rate per method: validation split, seed {cfg.get('tune_seed')}, ε = "
            f"{cfg.get('tune_epsilon')}, score = mean accuracy of the last 3 rounds",
            "",
            "| method | validation accuracy per lr tried | chosen lr |",
            "|---|---|---|",
        ]
        for m, c in result["lr_choice"].items():
            tried = ", ".join(
                f"{float(lr):g}: {v:.3f}" for lr, v in sorted(c["val_last3"].items(), key=lambda kv: float(kv[0]))
            )
            lines.append(f"| {LABELS.get(m, m)} | {tried or 'fixed (no tuning)'} | {c['lr']:g} |")
        lines.append("")
    for eps, block in an.items():
        lines += [
            f"ε = {eps} per client (mean ± sample s.d. over seeds; gradient share head / lora_A / lora_B in %, "
            "per-example, at initialization → after the last round)",
            "",
            "| method | lr | final accuracy | last-3-rounds accuracy | max ε (other accountant) | seeds | "
            "grad share init | grad share final |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m, s in block["methods"].items():
            fin, l3 = s["final"], s["last3"]
            lines.append(
                f"| {LABELS.get(m, m)} | {s['lr']:g} | {fin[0]:.3f} ± {fin[1]:.3f} | {l3[0]:.3f} ± "
                f"{l3[1]:.3f} | {_eps(s)} | {s['seeds']} | {_share(s['grad_share']['init'])} | "
                f"{_share(s['grad_share']['final'])} |"
            )
        lines += [
            "",
            "| paired difference (points, 95 % t-interval) | final accuracy | Holm p | "
            "last-3-rounds accuracy | Holm p |",
            "|---|---|---|---|---|",
        ]
        for key, c in block["comparisons"].items():
            a, b = COMPARISONS[key]
            fin, l3 = c["final"], c["last3"]
            lines.append(
                f"| {LABELS[a]} − {LABELS[b]} (n={fin['n']}) | {_ci(fin)} | {fmt_p(fin)} | {_ci(l3)} | {fmt_p(l3)} |"
            )
        if block.get("verdicts"):
            lines += [
                "",
                "| claim (ε = 1) | verdict, final accuracy | verdict, last-3-rounds accuracy |",
                "|---|---|---|",
            ]
            lines += [f"| {claim} | {v['final']} | {v['last3']} |" for claim, v in block["verdicts"].items()]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Row 1: accuracy vs round per ε (mean ± sample s.d. over seeds). Row 2: the paired differences with their
    95 % intervals, and the paper's targets as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an = result.get("analysis") or analyze(result)
    runs, cfg = eval_runs(result), result["config"]
    epsilons = list(an)
    if not epsilons:
        return
    fig, axes = plt.subplots(2, len(epsilons), figsize=(6.5 * len(epsilons), 9), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, eps in enumerate(epsilons):
        ax = axes[0][j]
        for i, m in enumerate(an[eps]["methods"]):
            a = np.asarray(
                [r["accuracy"] for r in runs if r["method"] == m and f"{float(r['epsilon']):g}" == eps], dtype=float
            )
            mu = a.mean(0)
            sd = a.std(0, ddof=1) if len(a) > 1 else np.zeros_like(mu)
            x = np.arange(a.shape[1])
            ax.plot(x, mu, color=colors[i % 10], label=f"{LABELS.get(m, m)} (n={len(a)})")
            ax.fill_between(x, mu - sd, mu + sd, color=colors[i % 10], alpha=0.15)
        ax.set_title(f"ε = {eps} per client, δ = {cfg['delta']:g}", fontsize=11)
        ax.set_xlabel("federated round")
        ax.set_ylabel("test accuracy of the global model")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower right", framealpha=0.9)
        ax = axes[1][j]
        comps = list(an[eps]["comparisons"].items())
        ax.axvline(0, color="grey", lw=0.8)
        for k, (key, c) in enumerate(comps):
            for off, name, mk in ((-0.12, "final", "o"), (0.12, "last3", "s")):
                ci = c[name]
                lo, hi = (ci["lo"], ci["hi"]) if math.isfinite(ci["lo"]) else (ci["mean"], ci["mean"])
                ax.errorbar(
                    [100 * ci["mean"]],
                    [k + off],
                    xerr=[[100 * (ci["mean"] - lo)], [100 * (hi - ci["mean"])]],
                    fmt=mk,
                    color="C0" if name == "final" else "C1",
                    capsize=4,
                    label=("final accuracy" if name == "final" else "last-3-rounds mean") if k == 0 else None,
                )
            if TARGETS[key]:
                ax.vlines(
                    100 * TARGETS[key],
                    k - 0.35,
                    k + 0.35,
                    colors="C3",
                    linestyles="--",
                    label="paper's claim (lower bound)" if key == "la_minus_dp_lora" else None,
                )
        ax.set_yticks(range(len(comps)), [ROW_LABELS[key] for key, _ in comps], fontsize=9)
        ax.set_ylim(-0.6, len(comps) - 0.4)
        ax.invert_yaxis()
        ax.set_xlabel("LA-LoRA (with filter) minus ..., accuracy points\n(paired mean, 95 % t-interval over seeds)")
        ax.grid(alpha=0.3, axis="x")
        if comps:
            ax.legend(fontsize=8, loc="best")
    head = "fixed head" if cfg.get("head") == "fixed" else "trainable head"
    clients = cfg.get("num_clients", cfg.get("clients"))  # "clients" in results written before dp-bench
    fig.suptitle(
        f"{cfg['model']}: {clients} clients, {cfg['partition']}"
        f"{' α=' + format(cfg['alpha'], 'g') if cfg['partition'] == 'dirichlet' else ''}, fraction "
        f"{cfg.get('fraction', 1)}, {cfg['rounds']} rounds × {cfg['local_steps']} local steps, B = "
        f"{cfg['batch_size']}, {cfg['optimizer']}, C = {cfg['max_grad_norm']:g}\nLoRA r={cfg['rank']} on "
        f"{cfg.get('target_modules')} above {cfg['frozen_layers']} frozen layers, {head}; seeds "
        f"{sorted({r['seed'] for r in runs})} (bands: sample s.d.)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
