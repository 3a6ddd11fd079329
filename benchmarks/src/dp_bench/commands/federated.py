"""Federated benchmark (LA-LoRA paper): DP-LoRA, FFA-LoRA, RoLoRA, LA-LoRA without and with its low-pass filter,
with a learning rate per method chosen on a validation split and paired seeds on one fixed test split.

Every method runs the same federation through :func:`peft_lalora.federated.simulation.run_simulation` — same clients,
partition, rounds, local steps, Poisson batch size, optimizer and per-client (ε, δ) (σ calibrated by the client's
accountant for rounds × local_steps steps) — at each ε and seed. The four LoRA schemes are four values of
``LALoraConfig.alternation``; "la-lora" adds the paper's ``[1,4,6,4,1]/16`` post-noise filter (post-processing).

Task (:func:`dp_bench.task.minilm_rt`, ``--model tiny`` for smoke runs): all-MiniLM-L6-v2 on packaged Rotten
Tomatoes, the bottom ``--frozen-layers`` encoder layers frozen and computed once, LoRA on ``--target-modules`` of the
layers above, the classifier head trainable or fixed at its seeded initialization (``--head fixed``: only the
adapters learn). The test split and the validation split (``--val-size`` examples carved from the training split,
never trained on) are fixed by ``--split-seed`` for every seed; the seed changes the partition, the head and adapter
initialization and the noise (seeded from (seed, client, round): ``reproducible_noise``, an experiment setting).

Protocol, in the order the command runs it:

1. Tuning: for each method, every lr of ``--lr-grid`` at ``--tune-epsilon`` with ``--tune-seed`` (not an evaluation
   seed), evaluated on the validation split; the lr with the best mean validation accuracy over the last three
   rounds is chosen; a best value at an end of what was tried extends the grid by a factor 2
   (:func:`dp_bench.lr_rule.lr_edge_step`, at most ``--max-extensions`` times). A grid of one value fixes the lr.
   LA-LoRA without its filter uses LA-LoRA's lr (``--share-filter-lr``: the filter's gain at equal settings).
   ``--lr-from other.json`` takes another grid's choice (and copies its tuning runs) instead of tuning.
2. Evaluation: every (seed, ε, method) with the method's lr, evaluated on the test split after every round.
3. Report (:mod:`.federated_report`): paired differences with 95 % t-intervals, verdicts at ε = 1; the gradient
   share (:mod:`dp_bench.probe`) of head / lora_A / lora_B at initialization and after the last round, per run.

Writes ``--out`` (config, versions, machine, every run's raw per-round curves, the lr choice, the analysis) after
every run — ``--resume`` keeps the runs already there — and the plot (``--plot``, default: ``--out`` with .png).

    dp-bench federated --out docs/results/federated_dir.json            # see docs/results.md for the protocol
    dp-bench federated --out docs/results/federated_dir.json --replot   # tables + PNG from the JSON
    dp-bench federated --smoke --out /tmp/f.json                        # tiny model: checks the plumbing
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peft_lalora.federated.config import FederationConfig
from peft_lalora.federated.data.task import Task, build_task

from .. import runner
from ..config import as_json, opt, parse_config, same_config, start
from ..meta import RESULTS, machine, versions
from ..probe import probe_federation
from ..runner import Cell
from ..store import SharedResult
from . import federated_report as report

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
#: the result JSON's ``json.dumps`` options
DUMPS = {"indent": 1, "allow_nan": True}
#: options that may change between invocations of one grid (``--resume``)
RESUMABLE = {"resume", "seeds", "methods", "epsilons", "progress", "threads", "out", "plot", "replot"}


@dataclass
class Config:
    model: str = opt("minilm-rt", "task", choices=tuple(TASKS))
    methods: list[str] = opt(list(METHODS), "methods: " + ", ".join(METHODS))
    epsilons: list[float] = opt([1.0], "target ε per client")
    seeds: list[int] = opt([0, 1, 2, 3, 4], "evaluation seeds (paired across methods)")
    num_clients: int = opt(10, "clients")
    partition: str = opt("dirichlet", "client split", choices=("dirichlet", "group", "iid"))
    alpha: float = opt(1.0, "Dirichlet concentration (partition=dirichlet)")
    rounds: int = opt(20, "federated rounds")
    local_steps: int = opt(5, "local DP steps per round")
    fraction: float = opt(1.0, "fraction of clients per round")
    batch_size: int = opt(64, "expected Poisson batch size")
    optimizer: str = opt("sgd", "client optimizer", choices=("sgd", "adamw"))
    max_grad_norm: float = opt(1.0, "clipping bound C")
    delta: float = opt(1e-5, "δ")
    accountant: str = opt("rdp", "the clients' accountant (σ calibration and ε spent)", choices=("rdp", "prv"))
    rank: int = opt(4, "LoRA rank")
    lora_alpha: int = opt(8, "LoRA alpha")
    target_modules: str = opt("query,value", "LoRA target modules (of the layers above the frozen ones)")
    frozen_layers: int = opt(5, "bottom encoder layers frozen and computed once")
    pooling: str = opt("mean", "sentence representation", choices=("cls", "mean"))
    head: str = opt(
        "trainable", "classifier head: trainable, or fixed at its seeded initialization", choices=("trainable", "fixed")
    )
    seq_len: int = opt(48, "tokens per example")
    n_train: int = opt(0, "0 = the whole training split")
    n_test: int = opt(0, "0 = the whole test split")
    split_seed: int = opt(0, "seed of the test subsample and the validation split (the same for every seed)")
    val_size: int = opt(1000, "validation examples carved from the training split")
    lr_grid: list[float] = opt(
        [0.5, 1.0, 2.0, 4.0], "learning rates tried per method (one value: no tuning)", type=float
    )
    tune_seed: int = opt(100, "seed of the tuning runs (not an evaluation seed)")
    tune_epsilon: float = opt(1.0, "ε of the tuning runs")
    max_extensions: int = opt(3, "edge extensions of the lr grid (factor 2 each)")
    share_filter_lr: bool = opt(True, "la-lora-nofilter uses la-lora's tuned lr (the filter's gain at equal settings)")
    lr_from: Path = opt(Path(""), "take the lr choice and its tuning runs from this grid JSON instead of tuning here")
    probe_examples: int = opt(64, "training examples of the gradient-share probe (0 = no probe)")
    reproducible_noise: bool = opt(True, "seed the DP noise from (seed, client, round): experiments only")
    threads: int = opt(2, "torch threads")
    out: Path = opt(RESULTS / "federated_paired.json", "result JSON")
    plot: Path = opt(Path(""), "plot (default: --out with .png)")
    resume: bool = opt(False, "keep the runs already in --out (same configuration)")
    progress: bool = opt(True, "progress bars (--no-progress: none)")
    replot: bool = opt(False, "only redraw the plot and print the tables from --out")
    smoke: bool = opt(False, "tiny model, 2 seeds, 2 rounds × 2 steps, ε = 1, two learning rates")

    def validate(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
        if not self.lr_grid or min(self.lr_grid) <= 0:
            raise ValueError("--lr-grid needs at least one learning rate, all > 0")
        tuning_here = len(self.lr_grid) > 1 and self.lr_from == Path("")
        if self.lr_from != Path("") and not self.lr_from.is_file():
            raise ValueError(f"--lr-from {self.lr_from}: no such file")
        if self.tune_seed in self.seeds and tuning_here:
            raise ValueError(f"--tune-seed {self.tune_seed} is an evaluation seed; tune on another one")
        if self.val_size < 1 and tuning_here:
            raise ValueError("tuning (more than one lr) needs a validation split: --val-size > 0")
        if self.max_extensions < 0:
            raise ValueError("--max-extensions must be >= 0")
        if self.smoke:
            self.model, self.seeds, self.epsilons, self.rounds, self.local_steps = "tiny", [0, 1], [1.0], 2, 2
            self.n_train, self.n_test, self.seq_len, self.frozen_layers, self.num_clients = 160, 64, 16, 1, 4
            self.batch_size, self.rank, self.lora_alpha, self.val_size = 8, 4, 8, 32
            self.lr_grid, self.max_extensions, self.probe_examples = [0.5, 1.0], 1, 8
        if self.plot == Path(""):
            self.plot = self.out.with_suffix(".png")


def task_options(args: Config, eval_split: str) -> str:
    """The task factory's options (:class:`dp_bench.task.TaskOptions`) as JSON."""
    opts: dict[str, Any] = {"split_seed": args.split_seed, "head": args.head}
    if args.frozen_layers:
        opts.update(frozen_layers=args.frozen_layers, pooling=args.pooling)
    if args.val_size:
        opts.update(val_size=args.val_size, eval_split=eval_split)
    return json.dumps(opts, sort_keys=True)


def base_config(args: Config, seed: int, epsilon: float, method: str, lr: float, eval_split: str) -> FederationConfig:
    """The run's ``FederationConfig``: the grid's fields of the same name, the task, the method's scheme and lr."""
    algo, filt = METHODS[method]
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name in FEDERATION_FIELDS}
    return FederationConfig(
        **shared,
        task=TASKS[args.model],
        task_options=task_options(args, eval_split),
        algo=algo,
        filter=filt,
        seed=seed,
        epsilon=epsilon,
        lr=lr,
    )


def record_key(record: dict[str, Any], lr: float | None = None) -> str:
    """A stored run's key (the runner's one format, ``phase|method|eps<ε>|s<seed>|lr<lr>``), from its record;
    ``lr``: the configured rate of a record from before records held theirs (and a phase: evaluation)."""
    return runner.run_key(
        record.get("phase", "eval"),
        record["method"],
        eps=record["epsilon"],
        seed=record["seed"],
        lr=record.get("lr", lr),
    )


def upgrade(result: dict[str, Any]) -> dict[str, Any]:
    """A stored grid with its runs keyed by :func:`record_key`: a JSON from before the one key format holds them as
    a list (in the order they ran, which the dict keeps)."""
    if isinstance(result.get("runs"), list):
        lr = result.get("config", {}).get("lr")
        result["runs"] = {record_key(r, lr): r for r in result["runs"]}
    return result


def one_run(args: Config, task: Task, phase: str, method: str, epsilon: float, seed: int, lr: float) -> dict[str, Any]:
    """Run one federation and return its raw record: per-round curves, privacy spent, gradient shares."""
    from peft_lalora.federated.simulation import run_simulation

    eval_split = "val" if phase == "tune" else "test"
    cfg = base_config(args, seed, epsilon, method, lr, eval_split)
    cpu0 = time.process_time()
    res = run_simulation(cfg, progress=args.progress, task=task)
    cpu_s = time.process_time() - cpu0
    out = res.to_json()
    share = {}
    if args.probe_examples:
        share = {
            "init": probe_federation(cfg, task, None, args.probe_examples),
            "final": probe_federation(cfg, task, res.state, args.probe_examples),
        }
    return {
        "phase": phase,
        "method": method,
        "algo": cfg.algo,
        "filter": cfg.filter,
        "epsilon": epsilon,
        "seed": seed,
        "lr": lr,
        "eval_split": eval_split,
        "n_eval": len(task.test),
        "n_train": len(task.train),
        "num_clients": cfg.num_clients,
        "partition": cfg.partition,
        "alpha": cfg.alpha,
        "fraction": cfg.fraction,
        "rounds": cfg.rounds,
        "local_steps": cfg.local_steps,
        "accuracy": out["accuracy"],
        "eval_loss": [res.initial["loss"], *(r.loss for r in res.rounds)],
        "train_loss": [r.train_loss for r in res.rounds],
        "max_epsilon": out["max_epsilon"],
        "client_epsilon": out["epsilon"],
        "noise_multipliers": {c: v["noise_multipliers"] for c, v in out["privacy"]["clients"].items()},
        "sample_rates": {c: v["sample_rates"] for c, v in out["privacy"]["clients"].items()},
        "failed_rounds": out["failed_rounds"],
        "partition_summary": out["partition"],
        "wall_s": out["wall_s"],
        "cpu_s": cpu_s,
        "epsilon_other": other_accountant(cfg, out["privacy"]["clients"]),
        "grad_share": share,
    }


def other_accountant(cfg: FederationConfig, clients: dict[str, Any]) -> dict[str, Any]:
    """Every client's ε under the other accountant (PRV beside RDP, RDP otherwise), from its (σ, q, steps) —
    for clients that ran one (σ, q), i.e. all of them in these grids."""
    from peft_lalora.federated.server.ledger import epsilon_from_history

    other = "prv" if cfg.accountant == "rdp" else "rdp"
    eps = {}
    for c, v in clients.items():
        if len(v["noise_multipliers"]) == 1 and len(v["sample_rates"]) == 1:
            steps = max(v["steps"], v["charged_steps"])
            eps[c] = epsilon_from_history([(v["noise_multipliers"][0], v["sample_rates"][0], steps)], cfg.delta, other)
    return {"accountant": other, "max_epsilon": max(eps.values(), default=float("nan")), "clients": eps}


def resumable(stored: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a stored grid was made with this configuration, up to the options of :data:`RESUMABLE` and
    options added since, at their defaults."""
    return same_config(stored, now, defaults=as_json(Config()), ignore=RESUMABLE)


class Grid:
    """The JSON of one grid, written after every run, and the tasks its runs share (built once each)."""

    def __init__(self, args: Config, header: dict[str, Any]) -> None:
        self.args = args
        old = runner.load(args.out, REPORT) if args.resume and args.out.is_file() else None
        if old is not None and not resumable(old["config"], header["config"]):
            raise SystemExit(f"--resume: {args.out} was made with a different configuration; use another --out")
        if old is None and args.out.is_file():  # a fresh grid: nothing of an old JSON under this name is merged in
            args.out.replace(args.out.with_name(args.out.name + ".old"))
        self.result: dict[str, Any] = {"runs": {}, "lr_choice": {}, **(old or {})}
        self.result.update(command=header["command"], config=header["config"])
        #: several workers may run the same --resume command at once (one per core): each run is claimed first
        self.store = SharedResult(args.out, self.result, dumps=DUMPS, wall=None, upgrade=upgrade)
        self.task: Task | None = None
        self.task_for: tuple[int, str] | None = None

    def task_of(self, seed: int, eval_split: str) -> Task:
        if self.task_for != (seed, eval_split):
            self.task = None  # free the previous task's tensors first
            t0 = time.perf_counter()
            m = self.args.methods[0]
            self.task = build_task(base_config(self.args, seed, self.args.tune_epsilon, m, 1.0, eval_split))
            self.task_for = (seed, eval_split)
            print(f"task for seed {seed} ({eval_split}) built in {time.perf_counter() - t0:.1f} s", flush=True)
            self.result.setdefault("data", {})[eval_split] = {
                "train": len(self.task.train),
                "evaluated": len(self.task.test),
                "split_seed": self.args.split_seed,
            }
        assert self.task is not None
        return self.task

    def train(self, cell: Cell, lr: float) -> dict[str, Any]:
        """Train one run of ``cell`` (the runner stores it)."""
        task = self.task_of(cell.seed, "val" if cell.phase == "tune" else "test")
        rec = one_run(self.args, task, cell.phase, cell.method, cell.eps, cell.seed, lr)
        self.result.update(versions=versions(), machine=machine())
        acc = rec["accuracy"]
        print(
            f"  {cell.key(lr):<48} acc {acc[0]:.3f} -> {acc[-1]:.3f} (last-3 {report.last_k_mean(acc, 3):.3f}), max ε "
            f"{rec['max_epsilon']:.3f}, {rec['wall_s']:.0f} s ({rec['cpu_s']:.0f} s CPU)",
            flush=True,
        )
        return rec

    def save(self) -> None:
        self.result.update(versions=versions(), machine=machine())
        self.store.save()


def planned(args: Config) -> list[Cell]:
    """Step 1 of the protocol, a tuning cell per method; then step 2, every (seed, ε, method), seed-major."""
    tune = [Cell("tune", m, args.tune_epsilon, args.tune_seed) for m in args.methods]
    return tune + [Cell("eval", m, eps, seed) for seed in args.seeds for eps in args.epsilons for m in args.methods]


@dataclass
class FederatedSchedule:
    """The federated part of the runner's schedule (step 1 of the protocol): a method's lr grid (+ edge
    extensions) on the validation split, the best mean validation accuracy over the last three rounds; a grid of
    one value fixes the lr; LA-LoRA without its filter takes LA-LoRA's (``--share-filter-lr``); a choice already
    stored (``--resume``, ``--lr-from``) stands. An evaluation cell runs its method's choice once made."""

    args: Config

    def lrs(self, cell: Cell, result: dict[str, Any]) -> list[float] | None:
        choice = result["lr_choice"]
        if cell.phase == "eval":
            return [choice[cell.method]["lr"]] if cell.method in choice else None
        a, method = self.args, cell.method
        if method in choice:
            return []
        if method == "la-lora-nofilter" and a.share_filter_lr and "la-lora" in a.methods:
            if "la-lora" not in choice:
                return None
            choice[method] = {**choice["la-lora"], "val_last3": {}, "tuned": False, "shared_with": "la-lora"}
            return []
        if len(a.lr_grid) == 1:
            choice[method] = {"lr": a.lr_grid[0], "val_last3": {}, "tuned": False}
            return []
        last3 = functools.partial(report.metric, name="last3")
        todo, best, tried = runner.tune_round(result["runs"], [cell], a.lr_grid, a.max_extensions, last3)
        if best is not None:
            choice[method] = {"lr": best, "val_last3": {f"{lr:g}": v for lr, v in sorted(tried.items())}, "tuned": True}
        return todo[0]


def borrow_lrs(grid: Grid) -> None:
    """``--lr-from``: the lr choice of another grid (e.g. tuned on the Dirichlet split, used for the by-movie one),
    with its tuning runs copied in so that this JSON holds the evidence for every lr it used."""
    src = runner.load(grid.args.lr_from, REPORT)
    missing = sorted(set(grid.args.methods) - set(src.get("lr_choice", {})))
    if missing:
        raise SystemExit(f"--lr-from {grid.args.lr_from} has no lr choice for {missing}")
    for m in grid.args.methods:
        grid.result["lr_choice"][m] = {**src["lr_choice"][m], "from": str(grid.args.lr_from)}
    for key, r in src["runs"].items():
        if r.get("phase") == "tune" and r["method"] in grid.args.methods:
            grid.result["runs"].setdefault(key, r)
    grid.result["lr_from_command"] = src.get("command")
    grid.save()


def run(args: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    header = start("federated", args, argv)
    warnings.filterwarnings("ignore", message=".*reproducible_noise=True.*")
    grid = Grid(args, header)
    t0 = time.perf_counter()
    if args.lr_from != Path(""):
        borrow_lrs(grid)
    runner.drive(grid.store, planned(args), FederatedSchedule(args), grid.train, desc="federated grid")
    grid.result["wall_s_this_invocation"] = time.perf_counter() - t0
    return runner.finish(grid.result, REPORT, args.plot, grid.save)


#: the runner's report protocol for this command (stored JSONs rekeyed on load: :func:`upgrade`)
REPORT = runner.Report(tables=report.tables, plot=report.plot, analyze=report.analyze, upgrade=upgrade)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_config(Config, argv, prog="dp-bench federated", description=__doc__)
    if args.replot:
        return runner.replot(args.out, REPORT, args.plot, dumps=DUMPS)
    return run(args, argv)
