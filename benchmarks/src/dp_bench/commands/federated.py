"""Federated benchmark (LA-LoRA paper): DP-LoRA, FFA-LoRA, RoLoRA, LA-LoRA without and with its low-pass filter.

Every method runs the same federation through :func:`peft_lalora.federated.simulation.run_simulation` — same clients,
non-IID partition, rounds, local steps, Poisson batch size, optimizer, learning rate and per-client (ε, δ)
(σ calibrated by Opacus's accountant for rounds × local_steps steps) — at each ε and seed. The four LoRA
schemes are four values of ``LALoraConfig.alternation``; "la-lora+binomial5" adds the paper's
``[1,4,6,4,1]/16`` post-noise filter (post-processing, no privacy cost).

Task (``--model minilm-rt``, :func:`dp_bench.task.minilm_rt`): all-MiniLM-L6-v2 on packaged Rotten Tomatoes
(offline), the bottom ``--frozen-layers`` encoder layers frozen and computed once per seed (exact:
:mod:`dp_bench.frozen`), LoRA on query/value of the layers above plus the classifier head.
The data split, partition and adapter initialisation follow the seed; ``--reproducible-noise`` (default on
here) seeds the DP noise from (seed, client, round) so that every number can be regenerated exactly — an
experiment setting, not a deployment one (see docs/federated.md).

Writes ``docs/results/federated.json`` (config, versions, machine, raw per-round curves of every run, the
summary) after every run — a rerun with ``--resume`` skips the runs already there — and
``docs/results/federated.png`` (accuracy vs round, mean ± std over seeds, one panel per ε).

    dp-bench federated                      # the full grid (see docs/results.md for its wall time)
    dp-bench federated --replot             # redraw the PNG and print the tables from the JSON
    dp-bench federated --smoke --out /tmp/f.json   # tiny model, 2 rounds: checks the plumbing
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft_lalora.federated.federation import FederationConfig
from peft_lalora.federated.task import build_task

from ..analysis import fmt, mean_std
from ..config import as_json, opt, parse_config
from ..meta import RESULTS, machine, quiet_warnings, versions

#: --model -> the task factory (dp_bench.task)
TASKS = {"minilm-rt": "dp_bench.task:minilm_rt", "tiny": "dp_bench.task:tiny"}
#: grid fields passed to FederationConfig under the same name (``model`` here names the task, not a model folder)
FEDERATION_FIELDS = {f.name for f in dataclasses.fields(FederationConfig)} - {"model"}


#: method name -> (algo, filter)
METHODS: dict[str, tuple[str, str]] = {
    "dp-lora": ("dp-lora", "none"),
    "ffa-lora": ("ffa-lora", "none"),
    "rolora": ("rolora", "none"),
    "la-lora-nofilter": ("la-lora", "none"),
    "la-lora": ("la-lora", "binomial5"),
}
LABELS = {
    "dp-lora": "DP-LoRA",
    "ffa-lora": "FFA-LoRA",
    "rolora": "RoLoRA",
    "la-lora-nofilter": "LA-LoRA w/o filter",
    "la-lora": "LA-LoRA (binomial5 filter)",
}


@dataclass
class Config:
    model: str = opt("minilm-rt", "task", choices=tuple(TASKS))
    methods: list[str] = opt(list(METHODS), "methods: " + ", ".join(METHODS))
    epsilons: list[float] = opt([1.0, 3.0], "target ε per client")
    seeds: list[int] = opt([0, 1, 2], "seeds")
    num_clients: int = opt(4, "clients")
    partition: str = opt("dirichlet", "client split", choices=("dirichlet", "group", "iid"))
    alpha: float = opt(0.1, "Dirichlet concentration")
    rounds: int = opt(12, "federated rounds")
    local_steps: int = opt(5, "local DP steps per round")
    fraction: float = opt(1.0, "fraction of clients per round")
    batch_size: int = opt(128, "expected Poisson batch size")
    lr: float = opt(3.0, "SGD lr (chosen on DP-LoRA, ε = 3, seed 0: see docs/results.md)")
    optimizer: str = opt("sgd", "client optimizer", choices=("sgd", "adamw"))
    max_grad_norm: float = opt(1.0, "clipping bound C")
    delta: float = opt(1e-5, "δ")
    rank: int = opt(4, "LoRA rank")
    lora_alpha: int = opt(8, "LoRA alpha")
    frozen_layers: int = opt(5, "bottom encoder layers frozen and computed once")
    pooling: str = opt("mean", "sentence representation", choices=("cls", "mean"))
    seq_len: int = opt(48, "tokens per example")
    n_train: int = opt(0, "0 = the whole training split")
    n_test: int = opt(1000, "test examples")
    reproducible_noise: bool = opt(True, "seed the DP noise from (seed, client, round): experiments only")
    threads: int = opt(2, "torch threads")
    out: Path = opt(RESULTS / "federated.json", "result JSON")
    plot: Path = opt(RESULTS / "federated.png", "plot")
    resume: bool = opt(False, "skip runs already in --out (same configuration)")
    no_progress: bool = opt(False, "no progress bars")
    replot: bool = opt(False, "only redraw --plot and print the tables from --out")
    smoke: bool = opt(False, "tiny model, 1 seed, 2 rounds × 2 steps, ε = 1")

    def validate(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
        if self.smoke:
            self.model, self.seeds, self.epsilons, self.rounds, self.local_steps = "tiny", [0], [1.0], 2, 2
            self.n_train, self.n_test, self.seq_len, self.frozen_layers, self.num_clients = 128, 64, 16, 1, 4
            self.batch_size, self.rank, self.lora_alpha = 8, 4, 8


def base_config(args: Config, seed: int, epsilon: float, method: str) -> FederationConfig:
    """The run's ``FederationConfig``: the grid's fields of the same name, the task, and the method's scheme."""
    algo, filt = METHODS[method]
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name in FEDERATION_FIELDS}
    options = {"frozen_layers": args.frozen_layers, "pooling": args.pooling} if args.frozen_layers else {}
    return FederationConfig(**shared, task=TASKS[args.model], task_options=json.dumps(options) if options else "",
                            algo=algo, filter=filt, seed=seed, epsilon=epsilon)  # fmt: skip


def run_key(method: str, epsilon: float, seed: int) -> str:
    return f"{method}|eps={epsilon:g}|seed={seed}"


def run_record(method: str, epsilon: float, seed: int, res: Any) -> dict[str, Any]:
    """The raw record of one run: per-round curves, privacy spent, wall time."""
    out = res.to_json()
    return {
        "method": method,
        "epsilon": epsilon,
        "seed": seed,
        "accuracy": out["accuracy"],
        "test_loss": [res.initial["loss"], *(r.loss for r in res.rounds)],
        "train_loss": [r.train_loss for r in res.rounds],
        "max_epsilon": out["max_epsilon"],
        "client_epsilon": out["epsilon"],
        "noise_multipliers": {c: v["noise_multipliers"] for c, v in out["privacy"]["clients"].items()},
        "sample_rates": {c: v["sample_rates"] for c, v in out["privacy"]["clients"].items()},
        "failed_rounds": out["failed_rounds"],
        "partition": out["partition"],
        "wall_s": out["wall_s"],
    }


def last_k_mean(acc: Sequence[float], k: int) -> float:
    """Mean test accuracy over the last ``k`` rounds (smooths round-to-round FedAvg oscillation)."""
    tail = [a for a in acc[1:][-k:] if math.isfinite(a)]
    return sum(tail) / len(tail) if tail else float("nan")


def summarize(runs: Sequence[dict[str, Any]], methods: Sequence[str], epsilons: Sequence[float]) -> dict[str, Any]:
    """Per (ε, method): final and last-3-rounds accuracy, mean ± std over seeds; and the paper's two
    comparisons at each ε (LA-LoRA − DP-LoRA, LA-LoRA − best of FFA-LoRA/RoLoRA) and the filter's gain, from
    seed means of the final accuracy (and, suffixed ``_last3``, of the last-3-rounds accuracy)."""
    table: dict[str, Any] = {}
    for eps in epsilons:
        row: dict[str, Any] = {}
        for m in methods:
            rs = [r for r in runs if r["method"] == m and r["epsilon"] == eps]
            if not rs:
                continue
            row[m] = {
                "seeds": sorted(r["seed"] for r in rs),
                "final": mean_std([r["accuracy"][-1] for r in rs]),
                "last3": mean_std([last_k_mean(r["accuracy"], 3) for r in rs]),
                "max_epsilon": max(r["max_epsilon"] for r in rs),
                "wall_s": mean_std([r["wall_s"] for r in rs]),
            }
        cmp: dict[str, Any] = {}
        if "la-lora" in row:
            for metric, suffix in (("final", ""), ("last3", "_last3")):
                la = row["la-lora"][metric][0]
                if "dp-lora" in row:
                    cmp["la_minus_dp_lora" + suffix] = la - row["dp-lora"][metric][0]
                rivals = [row[m][metric][0] for m in ("ffa-lora", "rolora") if m in row]
                if rivals:
                    cmp["la_minus_best_ffa_rolora" + suffix] = la - max(rivals)
                if "la-lora-nofilter" in row:
                    cmp["filter_gain" + suffix] = la - row["la-lora-nofilter"][metric][0]
        table[f"{eps:g}"] = {"methods": row, "comparisons": cmp}
    return table


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    epsilons = result["config"]["epsilons"]
    fig, axes = plt.subplots(1, len(epsilons), figsize=(5.5 * len(epsilons), 4), squeeze=False, sharey=True)
    for ax, eps in zip(axes[0], epsilons, strict=True):
        for m in result["config"]["methods"]:
            curves = [r["accuracy"] for r in result["runs"] if r["method"] == m and r["epsilon"] == eps]
            if not curves:
                continue
            a = np.asarray(curves, dtype=float)
            mu, sd = a.mean(0), a.std(0, ddof=1) if len(a) > 1 else np.zeros(a.shape[1])
            x = np.arange(a.shape[1])
            ax.plot(x, mu, label=f"{LABELS[m]} (n={len(a)})")
            ax.fill_between(x, mu - sd, mu + sd, alpha=0.15)
        ax.set_title(f"ε = {eps:g} per client, δ = {result['config']['delta']:g}")
        ax.set_xlabel("federated round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (global adapter)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    cfg = result["config"]
    clients = cfg.get("num_clients", cfg.get("clients"))  # "clients" in results written before the harness
    fig.suptitle(
        f"{cfg['model']}: {clients} clients, {cfg['partition']} α={cfg['alpha']}, {cfg['rounds']} rounds × "
        f"{cfg['local_steps']} local steps, B={cfg['batch_size']}, {cfg['optimizer']} lr={cfg['lr']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: Config) -> dict[str, Any]:
    from peft_lalora.federated.simulation import run_simulation

    quiet_warnings()
    warnings.filterwarnings("ignore", message=".*reproducible_noise=True.*")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = as_json(args)
    result: dict[str, Any] = {"config": config, "runs": []}
    if args.resume and args.out.is_file():
        old = json.loads(args.out.read_text())
        same = {k: v for k, v in old["config"].items() if k not in ("resume", "seeds", "methods", "epsilons")}
        now = {k: v for k, v in config.items() if k not in ("resume", "seeds", "methods", "epsilons")}
        if same != now:
            raise SystemExit(f"--resume: {args.out} was made with a different configuration; use another --out")
        result["runs"] = old["runs"]
    done = {run_key(r["method"], r["epsilon"], r["seed"]) for r in result["runs"]}
    t_all = time.perf_counter()
    for seed in args.seeds:
        todo = [(e, m) for e in args.epsilons for m in args.methods if run_key(m, e, seed) not in done]
        if not todo:
            continue
        t0 = time.perf_counter()
        task = build_task(base_config(args, seed, args.epsilons[0], args.methods[0]))
        print(f"seed {seed}: task built in {time.perf_counter() - t0:.1f} s", flush=True)
        for eps, method in todo:
            cfg = base_config(args, seed, eps, method)
            res = run_simulation(cfg, progress=not args.no_progress, task=task)
            rec = run_record(method, eps, seed, res)
            result["runs"].append(rec)
            print(
                f"  {method:18s} ε={eps:g} seed={seed}: acc {rec['accuracy'][0]:.3f} -> {rec['accuracy'][-1]:.3f} "
                f"(last-3 {last_k_mean(rec['accuracy'], 3):.3f}), max ε {rec['max_epsilon']:.3f}, "
                f"{rec['wall_s']:.0f} s",
                flush=True,
            )
            result["summary"] = summarize(result["runs"], args.methods, args.epsilons)
            result["versions"] = versions()
            result["machine"] = machine()
            result["wall_s_this_invocation"] = time.perf_counter() - t_all
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, allow_nan=True))
        del task
    result["summary"] = summarize(result["runs"], args.methods, args.epsilons)
    if result["runs"]:
        plot(result, args.plot)
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    for eps, block in result.get("summary", {}).items():
        print(f"\nε = {eps}")
        print("| method | final accuracy | last-3-rounds accuracy | max ε | seeds |")
        print("|---|---|---|---|---|")
        for m, s in block["methods"].items():
            print(f"| {LABELS[m]} | {fmt(s['final'])} | {fmt(s['last3'])} | {s['max_epsilon']:.3f} | {s['seeds']} |")
        for k, v in block["comparisons"].items():
            print(f"  {k}: {100 * v:+.1f} points")


def replot(args: Config) -> dict[str, Any]:
    """Regenerate the PNG and the tables from the JSON, without running anything."""
    result = json.loads(args.out.read_text())
    cfg = result["config"]
    result["summary"] = summarize(result["runs"], cfg["methods"], cfg["epsilons"])
    plot(result, args.plot)
    print_table(result)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_config(Config, argv, prog="dp-bench federated", description=__doc__.split("\n")[0])
    return replot(args) if args.replot else run(args)
