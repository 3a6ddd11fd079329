"""Cost of DPTrainer's DDP data check (``docs/trainer.md``, "Across processes"): the SHA-256 fingerprint of every
record, in order, that the ranks compare before the first step (``opacus_spectral.hf.distributed``).

Synthetic tokenized records of 8–63 tokens (``input_ids``, ``attention_mask``, ``labels``) as a ``datasets.Dataset``
in Python and in torch format, and as a list of ``(tensor, label)`` pairs; seconds for one fingerprint of each,
median of ``--reps``.

    dp-bench fingerprint-cost                  # docs/results/fingerprint_cost.json + .png
    dp-bench fingerprint-cost --replot
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS


@dataclass
class Config:
    records: int = opt(100_000, "records of the dataset")
    reps: int = opt(3, "fingerprints per form (the median is reported)")
    threads: int = opt(1, "torch threads")
    out: Path = opt(RESULTS / "fingerprint_cost.json", "result JSON")
    plot: Path = opt(RESULTS / "fingerprint_cost.png", "result plot (PNG)")
    replot: bool = opt(False, "only the table and the plot from --out")


def forms(n: int) -> dict[str, Any]:
    """The same ``n`` records in the three forms a Trainer's dataset takes."""
    import datasets

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 64, (n,), generator=g).tolist()
    ids = [torch.randint(0, 30_000, (k,), generator=g).tolist() for k in lengths]
    table = datasets.Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * k for k in lengths], "labels": [i % 2 for i in range(n)]}
    )
    pairs = [(torch.tensor(x), i % 2) for i, x in enumerate(ids)]
    return {"datasets, python format": table, "datasets, torch format": table.with_format("torch"), "pairs": pairs}


def tables(res: dict[str, Any]) -> str:
    lines = ["| records | form | seconds (median) | µs per record |", "|---|---|---|---|"]
    for name, s in res["seconds"].items():
        lines.append(f"| {res['records']:,} | {name} | {s:.2f} | {1e6 * s / res['records']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(res["seconds"])
    ax.barh(names, [res["seconds"][k] for k in names])
    ax.set_xlabel(f"seconds per fingerprint of {res['records']:,} records")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench fingerprint-cost", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, cfg.plot)
    from opacus_spectral.hf.distributed import dataset_fingerprint

    res: dict[str, Any] = {**start("fingerprint-cost", cfg, argv), "records": cfg.records, "seconds": {}}
    for name, data in forms(cfg.records).items():
        times = []
        for _ in range(cfg.reps):
            t0 = time.perf_counter()
            dataset_fingerprint(data)
            times.append(time.perf_counter() - t0)
        res["seconds"][name] = statistics.median(times)
    return runner.write(res, REPORT, cfg.out, cfg.plot, indent=2)
