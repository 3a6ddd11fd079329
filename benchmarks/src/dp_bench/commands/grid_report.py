"""Tables, paired statistics and the plot of a paired-seed grid (``dp-bench grid``), from its JSON only."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis import crossing_step, eps_at_accuracy, fmt_p, holm, holm_family, mean_std, paired_ci

BASELINE = "none"
REFERENCES = ("nonprivate", "clip-only")
#: the non-spectral denoisers a spectral variant is compared with (issue target: beat the best of them)
PEERS = ("ema", "doppler", "disk")


def is_spectral(method: str) -> bool:
    """Whether a grid method applies a spectral denoiser (``rmt``, ``rmt-tw``, ``ema+rmt-js``, ...)."""
    return any(part.startswith("rmt") for part in method.split("+"))


def evaluations(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The evaluation runs at their arm's chosen learning rate (``lr_choice``; an untuned reference: the
    ``none`` arm's). A choice that moved — ``--lr-extensions`` grown on ``--resume`` — leaves the runs at the old
    rate stored, superseded; a grid without tuning (``--no-tune``) keeps every run."""
    choice = result.get("lr_choice", {})

    def current(r: dict[str, Any]) -> bool:
        cell = f"{r['optimizer']}|B{r['batch']}"
        own = choice.get(f"{r['method']}|{cell}")
        if own is None and r["method"] in REFERENCES:
            own = choice.get(f"{BASELINE}|{cell}")
        return own is None or own["lr"] == r["lr"]

    return [r for k, r in result["runs"].items() if k.startswith("eval|") and current(r)]


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """Per (optimizer, B, ε, method): final test accuracy (mean ± sample s.d.), the paired difference to the
    no-denoiser baseline with its 95 % t-interval, steps to reach the baseline's final mean accuracy; per
    (optimizer, B, method): the absolute ε needed to reach the baseline's final mean accuracy at the target ε,
    and the paired ε saved."""
    cfg = result["config"]
    by: dict[tuple[str, int, float, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in evaluations(result):
        eps = r["target_epsilon"]
        by[(r["optimizer"], r["batch"], float("inf") if eps in (None, math.inf) else eps, r["method"])][r["seed"]] = r
    cells: dict[str, Any] = {}
    for (o, b, e, m), seeds in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] != BASELINE)):
        base = by.get((o, b, e, BASELINE), {})
        finals = [r["final_test"] for r in seeds.values()]
        entry: dict[str, Any] = {
            "optimizer": o,
            "batch": b,
            "epsilon": e,
            "method": m,
            "seeds": sorted(seeds),
            "final_test": mean_std(finals),
            "lr": next(iter(seeds.values()))["lr"],
        }
        if m != BASELINE and base:
            common = sorted(set(seeds) & set(base))
            entry["diff_vs_none"] = paired_ci([seeds[s]["final_test"] - base[s]["final_test"] for s in common])
            target = float(np.mean([base[s]["final_test"] for s in common]))
            steps, never = [], 0
            for s in common:
                t = crossing_step(seeds[s]["test"], target)
                if t is None:
                    never += 1
                    t = float(seeds[s]["steps"])
                steps.append(t)
            base_steps = [crossing_step(base[s]["test"], target) or float(base[s]["steps"]) for s in common]
            diffs = [a - c for a, c in zip(steps, base_steps, strict=True)]
            fewer = [(c - a) / c for a, c in zip(steps, base_steps, strict=True)]  # paper A's unit, per seed
            entry["steps_to_baseline"] = {
                "mean": float(np.mean(steps)),
                "never_reached": never,
                "baseline_mean": float(np.mean(base_steps)),
                "budget": seeds[common[0]]["steps"],
                "diff_vs_none": paired_ci(diffs),
                "fewer_steps_fraction": paired_ci(fewer),
            }
        cos = [np.mean([c[1] for c in r["cos"][len(r["cos"]) // 2 :]]) for r in seeds.values() if r.get("cos")]
        cos_ema = [np.mean([c[2] for c in r["cos"][len(r["cos"]) // 2 :]]) for r in seeds.values() if r.get("cos")]
        ratio = [
            np.mean([c[1] for c in r["norm_ratio"][len(r["norm_ratio"]) // 2 :]])
            for r in seeds.values()
            if r.get("norm_ratio")
        ]
        if ratio:
            entry["norm_ratio_released_clean_2nd_half"] = mean_std(ratio)
        if cos:
            entry["cos_released_clean_2nd_half"] = mean_std(cos)
            entry["cos_released_clean_ema_2nd_half"] = mean_std(cos_ema)
        gated = [r["gated_per_step"] for r in seeds.values() if r.get("gated_per_step") is not None]
        if gated:
            entry["gated_per_step"] = float(np.mean(gated))
        eps_rdp = [r["epsilon_rdp"] for r in seeds.values() if r.get("epsilon_rdp")]
        if eps_rdp:
            entry["epsilon_prv"] = float(np.mean([r["epsilon_prv"] for r in seeds.values()]))
            entry["epsilon_rdp"] = float(np.mean(eps_rdp))
        cells[f"{o}|B{b}|eps{e:g}|{m}"] = entry
    out = {"cells": cells, "epsilon_to_target": _eps_to_target(by, cfg), "vs_best_peer": _vs_best_peer(by)}
    vs_adamw = _vs_adamw(by)
    if vs_adamw:  # only in grids with DP-AdamBC (the other grids' JSON stays as it was)
        out["vs_adamw"] = vs_adamw
    for family in families(out).values():
        holm_family(list(family.values()))
    return out


def families(an: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The grid's multiple-comparison families (name -> cell key -> paired interval), one per table column of
    paired intervals: accuracy − none, fewer steps than none, ε saved vs none, spectral − best peer, each over every
    optimizer, B and ε of the grid."""
    cells = an["cells"].items()
    return {
        "accuracy_vs_none": {k: c["diff_vs_none"] for k, c in cells if "diff_vs_none" in c},
        "fewer_steps": {
            k: c["steps_to_baseline"]["fewer_steps_fraction"] for k, c in cells if "steps_to_baseline" in c
        },
        "epsilon_saved": {
            k: v["epsilon_saved"] for k, v in an["epsilon_to_target"].items() if k.split("|")[-1] != BASELINE
        },
        "vs_best_peer": {k: v["diff"] for k, v in an["vs_best_peer"].items()},
        **({"vs_adamw": an["vs_adamw"]} if an.get("vs_adamw") else {}),
    }


def _vs_adamw(by: dict[tuple[str, int, float, str], dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per (``adambc:<γ′>``, B, ε, method): its final test accuracy minus AdamW's (same method, B, ε), paired by
    seed, with the 95 % t-interval."""
    out: dict[str, Any] = {}
    for (o, b, e, m), seeds in sorted(by.items()):
        base = by.get(("adamw", b, e, m))
        if not o.startswith("adambc:") or not base:
            continue
        common = sorted(set(seeds) & set(base))
        out[f"{o}|B{b}|eps{e:g}|{m}"] = paired_ci([seeds[s]["final_test"] - base[s]["final_test"] for s in common])
    return out


def pooled_holm(paths: Sequence[str | Path], family: str = "accuracy_vs_none") -> str:
    """One family over several grids (e.g. every accuracy − none comparison of a docs section): a Markdown table
    of each comparison with its raw paired t-test p, its Holm p within its grid and its Holm p over the pool."""
    rows = []
    for path in paths:
        fam = families(analyze(json.loads(Path(path).read_text())))[family]
        rows += [(Path(path).stem, key, ci) for key, ci in fam.items()]
    pooled = holm([ci["p"] for _, _, ci in rows])
    lines = [
        f"{family}: {sum(math.isfinite(p) for p in pooled)} comparisons pooled over {len(paths)} grids",
        "",
        "| grid | cell | difference [95 % CI] | p | Holm p, grid | Holm p, pooled |",
        "|---|---|---|---|---|---|",
    ]
    for (grid, key, ci), adj in sorted(zip(rows, pooled, strict=True), key=lambda r: r[0][2]["p"]):
        lines.append(f"| {grid} | {key} | {_fmt_ci(ci)} | {fmt_p(ci, 'p')} | {fmt_p(ci)} | {fmt_p({'p': adj}, 'p')} |")
    return "\n".join(lines) + "\n"


def _vs_best_peer(by: dict[tuple[str, int, float, str], dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per (optimizer, B, ε): every spectral method minus the best non-spectral peer (:data:`PEERS`, the one
    with the highest mean final test accuracy in that cell), paired by seed, with the 95 % t-interval."""
    out: dict[str, Any] = {}
    for o, b, e in sorted({k[:3] for k in by}):
        peers = {m: by[(o, b, e, m)] for m in PEERS if (o, b, e, m) in by}
        if not peers:
            continue
        best = max(peers, key=lambda m: float(np.mean([r["final_test"] for r in peers[m].values()])))
        for (o2, b2, e2, m), seeds in by.items():
            if (o2, b2, e2) != (o, b, e) or not is_spectral(m):
                continue
            common = sorted(set(seeds) & set(peers[best]))
            diffs = [seeds[s]["final_test"] - peers[best][s]["final_test"] for s in common]
            out[f"{o}|B{b}|eps{e:g}|{m}"] = {"peer": best, "diff": paired_ci(diffs)}
    return out


def _eps_to_target(
    by: dict[tuple[str, int, float, str], dict[int, dict[str, Any]]], cfg: dict[str, Any]
) -> dict[str, Any]:
    """ε each method needs (per seed, log-ε interpolation of its final accuracy over the ε grid) to reach the
    baseline's mean final accuracy at the target ε; ε saved = the baseline's ε − the method's (paired)."""
    out: dict[str, Any] = {}
    eps_grid = sorted(cfg["epsilons"])
    target_eps = cfg["target_epsilon"]
    for o, b, e, m in list(by):
        if e != target_eps:
            continue
        base = by.get((o, b, target_eps, BASELINE), {})
        if not base:
            continue
        target = float(np.mean([r["final_test"] for r in base.values()]))

        def needed(method: str, seed: int, o: str = o, b: int = b, target: float = target) -> float | None:
            pts = [
                (eg, by[(o, b, eg, method)][seed]["final_test"])
                for eg in eps_grid
                if seed in by.get((o, b, eg, method), {})
            ]
            value, _ = eps_at_accuracy(pts, target)
            return value

        seeds = sorted(set(by[(o, b, target_eps, m)]) & set(base))
        mine = [needed(m, s) for s in seeds]
        theirs = [needed(BASELINE, s) for s in seeds]
        saved = [t - x for x, t in zip(mine, theirs, strict=True) if x is not None and t is not None]
        out[f"{o}|B{b}|{m}"] = {
            "target_accuracy": target,
            "epsilon_needed": mine,
            "epsilon_saved": paired_ci(saved),
            "out_of_range": sum(x is None for x in mine),
        }
    return out


def _fmt_ci(ci: dict[str, Any], scale: float = 100.0, unit: str = "") -> str:
    if not ci or ci.get("n", 0) == 0 or not math.isfinite(ci["mean"]):
        return "–"
    if not math.isfinite(ci["lo"]):
        return f"{scale * ci['mean']:+.2f}{unit} (n={ci['n']})"
    return f"{scale * ci['mean']:+.2f} [{scale * ci['lo']:+.2f}, {scale * ci['hi']:+.2f}]{unit}"


def tables(result: dict[str, Any]) -> str:
    """Markdown tables; every paired interval has its Holm-adjusted p-value within its family (:func:`families`)
    beside it. Verdicts stay CI-based."""
    an = result.get("analysis") or analyze(result)
    lines = [
        "| opt | B | ε | method | lr | final test acc (mean ± s.d.) | − none, points [95 % CI] | Holm p | steps "
        "to none's final acc (never) | fewer steps than none, % [95 % CI] | Holm p | cos(released, clean) 2nd "
        "half | ‖released‖/‖clean‖ | gated/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in an["cells"].values():
        fin = c["final_test"]
        st = c.get("steps_to_baseline")
        steps = f"{st['mean']:.0f}/{st['budget']} ({st['never_reached']})" if st else "–"
        fewer = _fmt_ci(st.get("fewer_steps_fraction", {})) if st else "–"
        fewer_p = fmt_p(st.get("fewer_steps_fraction")) if st else "–"
        cos = c.get("cos_released_clean_2nd_half")
        cos_txt = "–" if not cos else f"{cos[0]:.3f}"
        ratio = c.get("norm_ratio_released_clean_2nd_half")
        ratio_txt = "–" if not ratio else f"{ratio[0]:.2f}"
        gated = c.get("gated_per_step")
        gated_txt = "–" if gated is None else f"{gated:.2f}"
        lines.append(
            f"| {c['optimizer']} | {c['batch']} | {c['epsilon']:g} | {c['method']} | {c['lr']:g} | "
            f"{100 * fin[0]:.2f} ± {100 * fin[1]:.2f} | {_fmt_ci(c.get('diff_vs_none', {}))} | "
            f"{fmt_p(c.get('diff_vs_none'))} | {steps} | {fewer} | {fewer_p} | {cos_txt} | {ratio_txt} | {gated_txt} |"
        )
    lines += [
        "",
        "| opt | B | method | target acc | ε needed (per seed) | ε saved vs none [95 % CI] | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in an["epsilon_to_target"].items():
        o, b, m = k.split("|")
        need = ", ".join("–" if x is None else f"{x:.2f}" for x in v["epsilon_needed"])
        lines.append(
            f"| {o} | {b[1:]} | {m} | {100 * v['target_accuracy']:.2f} | {need} | "
            f"{_fmt_ci(v['epsilon_saved'], scale=1.0)} | {fmt_p(v['epsilon_saved'])} |"
        )
    peer = an.get("vs_best_peer") or {}
    if peer:
        lines += [
            "",
            "| opt | B | ε | spectral method | best non-spectral peer | − peer, points [95 % CI] | Holm p |",
            "|---|---|---|---|---|---|---|",
        ]
        for k, v in peer.items():
            o, b, e, m = k.split("|")
            lines.append(f"| {o} | {b[1:]} | {e[3:]} | {m} | {v['peer']} | {_fmt_ci(v['diff'])} | {fmt_p(v['diff'])} |")
    lines += _vs_adamw_table(result, an)
    lines += _chosen_bands_table(result, an)
    return "\n".join(lines) + "\n"


def best_validation(result: dict[str, Any], method: str, optimizer: str, batch: str) -> float | None:
    """The best validation score of ``method``'s learning-rate runs in the cell (``batch``: ``"B<n>"``; None: the
    arm was not tuned there) — what choosing among arms on validation compares."""
    tried = result.get("lr_choice", {}).get(f"{method}|{optimizer}|{batch}", {}).get("val", {})
    return max(tried.values()) if tried else None


def _chosen_bands_table(result: dict[str, Any], an: dict[str, Any]) -> list[str]:
    """Per (optimizer, B, ε): the ``bandmf:<b>`` whose learning-rate runs reached the best validation accuracy (the
    b chosen on validation, ``docs/results.md`` §12) and its paired difference to DP-SGD (``none``)."""
    best: dict[tuple[str, int, float], tuple[float, str, dict[str, Any]]] = {}
    for c in an["cells"].values():
        val = best_validation(result, c["method"], c["optimizer"], f"B{c['batch']}")
        if not c["method"].startswith("bandmf:") or val is None or "diff_vs_none" not in c:
            continue
        key = (c["optimizer"], c["batch"], c["epsilon"])
        if key not in best or val > best[key][0]:
            best[key] = (val, c["method"], c)
    if not best:
        return []
    lines = [
        "",
        "| opt | B | ε | b chosen on validation | best validation acc | − none (DP-SGD), points [95 % CI] | p (raw) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (o, b, e), (val, method, c) in sorted(best.items()):
        ci = c["diff_vs_none"]
        lines.append(f"| {o} | {b} | {e:g} | {method} | {100 * val:.2f} | {_fmt_ci(ci)} | {fmt_p(ci, 'p')} |")
    return lines


def _vs_adamw_table(result: dict[str, Any], an: dict[str, Any]) -> list[str]:
    """DP-AdamBC − AdamW, with each optimizer's best validation accuracy of its learning-rate runs (the γ′ chosen
    on validation is the one with the highest)."""
    if not an.get("vs_adamw"):
        return []
    lines = [
        "",
        "| opt | B | ε | method | best validation acc (lr runs) | − adamw, points [95 % CI] | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, ci in an["vs_adamw"].items():
        o, b, e, m = k.split("|")
        val = best_validation(result, m, o, b)
        best = "–" if val is None else f"{100 * val:.2f}"
        lines.append(f"| {o} | {b[1:]} | {e[3:]} | {m} | {best} | {_fmt_ci(ci)} | {fmt_p(ci)} |")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Test accuracy vs step (mean ± sample s.d. over seeds) at each (optimizer, B) for the target ε, and final
    accuracy vs ε per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    evals = evaluations(result)
    combos = sorted({(r["optimizer"], r["batch"]) for r in evals})
    if not combos:
        return
    methods = list(dict.fromkeys(r["method"] for r in evals))
    colors = {m: plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10] for i, m in enumerate(methods)}
    fig, axes = plt.subplots(2, len(combos), figsize=(5.5 * len(combos), 8), squeeze=False)
    for j, (o, b) in enumerate(combos):
        ax = axes[0][j]
        for m in methods:
            rs = [
                r
                for r in evals
                if (r["optimizer"], r["batch"], r["method"]) == (o, b, m)
                and r["target_epsilon"] in (cfg["target_epsilon"], None, math.inf)
            ]
            if not rs:
                continue
            xs = [s for s, _ in rs[0]["test"]]
            ys = np.array([[a for _, a in r["test"]] for r in rs if len(r["test"]) == len(xs)])
            mu = ys.mean(0)
            sd = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros_like(mu)
            ax.plot(xs, mu, color=colors[m], label=f"{m} (n={len(ys)})")
            ax.fill_between(xs, mu - sd, mu + sd, color=colors[m], alpha=0.15)
        ax.set_title(f"{cfg['model']}, {o}, B = {b}, ε = {cfg['target_epsilon']:g}", fontsize=10)
        ax.set_xlabel("logical DP step")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax = axes[1][j]
        for m in methods:
            pts = defaultdict(list)
            for r in evals:
                same = (r["optimizer"], r["batch"], r["method"]) == (o, b, m)
                if same and r["target_epsilon"] not in (None, math.inf):
                    pts[r["target_epsilon"]].append(r["final_test"])
            if pts:
                es = sorted(pts)
                mu = [np.mean(pts[e]) for e in es]
                sd = [np.std(pts[e], ddof=1) if len(pts[e]) > 1 else 0.0 for e in es]
                ax.errorbar(es, mu, yerr=sd, marker="o", color=colors[m], label=m, capsize=3)
        ax.set_xscale("log")
        ax.set_xlabel("ε (δ = 1e-5, PRV)")
        ax.set_ylabel("final test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    minilm = cfg["model"] == "minilm"
    bed = f"Rotten Tomatoes, MiniLM {cfg.get('trainable')}" if minilm else "Fashion-MNIST, " + cfg["model"]
    budget = f"{cfg['steps']} steps" if cfg.get("steps") else f"{cfg['epochs']:g} epochs"
    sep = ",\n" if len(combos) == 1 else ", "  # one panel: two title lines, so the title fits the figure
    fig.suptitle(
        f"{bed}, {budget}, C = {cfg['max_grad_norm']}{sep}seeds {cfg['seeds']} (bands: sample s.d.)", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
