"""BandMF's set-up at any horizon (``docs/mechanisms.md``, "Any horizon"): the O(T·b) coefficient
optimizer against the dense T × T one it replaced, ``make_private`` at T = 100,000, the optimizer at T = 10⁶, and a
10,000-step ``DPTrainer`` run with BandMF end to end.

Each case runs in a fresh child process (one torch thread, the coefficient cache off, except for the two
``make_private`` runs: the first with an empty cache, the second reading what the first wrote): wall seconds and the
child's peak resident memory above what it held before the case (``ru_maxrss``), after a warm-up of the same case at
a small T (imports and first-call costs paid before the baseline).

* ``dense``: for T in ``--dense-steps`` and b in ``--dense-bands``, the dense L-BFGS optimum (the optimizer before
  the O(T·b) one, kept for learning-rate schedules) and the structured one: seconds each and the relative objective
  κ²‖A M⁻¹‖²_F of the structured optimum against the dense one (target ≤ 1e-6);
* ``make_private``: ``make_private(..., noise_mechanism=("bandmf", {"bands": b}), steps=T)`` on a small model,
  the optimization included (target ≤ 10 s, ≤ 200 MB), then again with the coefficients cached on disk;
* ``long``: the optimizer alone at ``--long-steps``;
* ``trainer``: ``DPTrainer`` (tiny BERT, LoRA r = 2 on the queries) for ``--trainer-steps`` steps with BandMF.

    dp-bench mechanism-setup                  # docs/results/mechanism_setup.json + .png
    dp-bench mechanism-setup --replot
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS

TARGET_SECONDS, TARGET_MB, TARGET_REL = 10.0, 200.0, 1e-6


@dataclass
class Config:
    dense_steps: str = opt("256,1024,2048", "comma-separated T of the dense-vs-structured comparison")
    dense_bands: str = opt("4,16", "comma-separated b of the dense-vs-structured comparison")
    setup_steps: int = opt(100_000, "T of the make_private case")
    setup_bands: int = opt(64, "b of the make_private case")
    long_steps: int = opt(1_000_000, "T of the optimizer-only case (0: skip)")
    long_bands: int = opt(64, "b of the optimizer-only case")
    trainer_steps: int = opt(10_000, "DPTrainer steps with BandMF (0: skip)")
    trainer_bands: int = opt(4, "b of the DPTrainer case")
    out: Path = opt(RESULTS / "mechanism_setup.json", "result JSON")
    plot: Path = opt(RESULTS / "mechanism_setup.png", "result plot (PNG)")
    replot: bool = opt(False, "only the table and the plot from --out")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# -- the cases, each run by a child process -------------------------------------------------------------------------
def case_dense(steps: int, bands: int) -> dict[str, Any]:
    from opacus_spectral.mechanisms import bandmf_math

    t0 = time.perf_counter()
    dense = bandmf_math._optimize_dense(steps, bands, 0.0, (1.0,) * steps)
    t1 = time.perf_counter()
    ours = bandmf_math.optimal_coefficients(steps, bands)
    t2 = time.perf_counter()
    e_dense, e_ours = (bandmf_math.toeplitz_error(c, steps)[0] for c in (dense, ours))
    return {"dense_seconds": t1 - t0, "structured_seconds": t2 - t1, "relative_objective": e_ours / e_dense - 1}


def case_make_private(steps: int, bands: int) -> dict[str, Any]:
    import torch

    from opacus_spectral import PrivacyEngine

    model = torch.nn.Linear(16, 2)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randint(0, 2, (1024,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    t0 = time.perf_counter()
    PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_mechanism=("bandmf", {"bands": bands}),
        steps=steps,
    )
    return {"seconds": time.perf_counter() - t0}


def case_long(steps: int, bands: int) -> dict[str, Any]:
    from opacus_spectral.mechanisms import bandmf_math

    t0 = time.perf_counter()
    c = bandmf_math.optimal_coefficients(steps, bands)
    seconds = time.perf_counter() - t0
    start = bandmf_math.normalized(bandmf_math.sqrt_factorization(bands)).numpy()
    ratio = bandmf_math.toeplitz_error(c, steps)[0] / bandmf_math.toeplitz_error(start, steps)[0]
    return {"seconds": seconds, "error_vs_sqrt_start": ratio}


def case_trainer(steps: int, bands: int) -> dict[str, Any]:
    import datasets
    import torch
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=2
    )
    model = get_peft_model(BertForSequenceClassification(config), LoraConfig(r=2, target_modules=["query"]))
    n, length = 512, 8
    ids = torch.randint(3, 100, (n, length))
    data = datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * length] * n, "label": (ids[:, 0] % 2).tolist()}
    ).with_format("torch")
    with tempfile.TemporaryDirectory() as out:
        args = DPTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=steps,
            learning_rate=0.01,
            noise_multiplier=1.0,
            target_delta=1e-5,
            noise_mechanism={"name": "bandmf", "bands": bands},
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1000,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = DPTrainer(model=model, args=args, train_dataset=data)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        epsilon = trainer.get_epsilon()
    return {"seconds": seconds, "steps_done": int(trainer.state.global_step), "epsilon": float(epsilon)}


CASES = {"dense": case_dense, "make_private": case_make_private, "long": case_long, "trainer": case_trainer}


#: a case's arguments for its warm-up, from its own: the same code at a small T (imports and first-call costs paid
#: before the baseline)
WARM_UP = {"dense": lambda t, b: [4 * b, b], "make_private": lambda t, b: [4 * b, b], "long": lambda t, b: [4 * b, b]}


def child(name: str, arguments: list[int]) -> None:
    """Run one case after its warm-up and print ``{"result", "peak_rss_mb"}`` as JSON (a child process): the
    peak resident memory above the baseline after the warm-up."""
    import resource

    import torch

    torch.set_num_threads(1)
    if name in WARM_UP:
        CASES[name](*WARM_UP[name](*arguments))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = CASES[name](*arguments)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("RESULT " + json.dumps({"result": result, "peak_rss_mb": (after - before) / 1024}))


def run_case(name: str, arguments: list[int], *, cache: str = "off") -> dict[str, Any]:
    code = f"from dp_bench.commands.mechanism_setup import child; child({name!r}, {arguments!r})"
    env = {**os.environ, "OPACUS_SPECTRAL_CACHE": cache, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"case {name} {arguments} failed:\n{done.stderr[-3000:]}")
    out = json.loads(line.removeprefix("RESULT "))
    print(name, arguments, out, flush=True)
    return out


# -- report -----------------------------------------------------------------------------------------------------
def tables(res: dict[str, Any]) -> str:
    lines = ["| T | b | dense s | structured s | speed-up | relative objective (structured − dense) |"]
    lines.append("|---|---|---|---|---|---|")
    for c in res["dense"]:
        r = c["result"]
        lines.append(
            f"| {c['steps']:,} | {c['bands']} | {r['dense_seconds']:.2f} | {r['structured_seconds']:.3f} | "
            f"{r['dense_seconds'] / r['structured_seconds']:.0f}× | {r['relative_objective']:+.1e} |"
        )
    lines += ["", "| case | T | b | seconds | peak RSS over baseline, MB | note |"]
    lines.append("|---|---|---|---|---|---|")
    for key in ("make_private", "make_private_cached", "long", "trainer"):
        c = res.get(key)
        if c is None:
            continue
        r = c["result"]
        note = {
            "long": f"error {r.get('error_vs_sqrt_start', 0):.3f}× the start's",
            "trainer": f"{r.get('steps_done')} steps, ε {r.get('epsilon', 0):.3f}",
        }.get(key, "")
        lines.append(
            f"| {key} | {c['steps']:,} | {c['bands']} | {r['seconds']:.2f} | {c['peak_rss_mb']:.1f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for bands in sorted({c["bands"] for c in res["dense"]}):
        cases = [c for c in res["dense"] if c["bands"] == bands]
        steps = [c["steps"] for c in cases]
        ax.plot(steps, [c["result"]["dense_seconds"] for c in cases], "o--", label=f"dense T × T, b = {bands}")
        ax.plot(steps, [c["result"]["structured_seconds"] for c in cases], "o-", label=f"O(T·b), b = {bands}")
    for key, marker in (("make_private", "s"), ("long", "^")):
        if res.get(key):
            c = res[key]
            ax.plot([c["steps"]], [c["result"]["seconds"]], marker, label=f"{key}, b = {c['bands']}")
    ax.set(xscale="log", yscale="log", xlabel="steps T", ylabel="seconds (one core)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench mechanism-setup", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, cfg.plot)
    res: dict[str, Any] = {**start("mechanism-setup", cfg, argv, threads=1), "dense": []}
    for steps in _ints(cfg.dense_steps):
        for bands in _ints(cfg.dense_bands):
            res["dense"].append({"steps": steps, "bands": bands, **run_case("dense", [steps, bands])})
    args = [cfg.setup_steps, cfg.setup_bands]
    with tempfile.TemporaryDirectory() as cache:  # empty: the first make_private optimizes and fills it
        for key in ("make_private", "make_private_cached"):
            res[key] = {"steps": args[0], "bands": args[1], **run_case("make_private", args, cache=cache)}
    if cfg.long_steps:
        args = [cfg.long_steps, cfg.long_bands]
        res["long"] = {"steps": args[0], "bands": args[1], **run_case("long", args)}
    if cfg.trainer_steps:
        args = [cfg.trainer_steps, cfg.trainer_bands]
        res["trainer"] = {"steps": args[0], "bands": args[1], **run_case("trainer", args)}
    res["targets"] = {"seconds": TARGET_SECONDS, "peak_mb": TARGET_MB, "relative_objective": TARGET_REL}
    return runner.write(res, REPORT, cfg.out, cfg.plot, indent=2)
