"""Cost of DPTrainer's batch-independence check (``docs/trainer.md``, "Batch independence") and of the engine's audit
on the run's batches (``docs/engine.md``), beside a DP step.

all-MiniLM-L6-v2 (packaged weights) with LoRA r = 8 on query/value, sequence classification, DPTrainer with
hooks-mode DP-SGD (σ = 1) on synthetic sentences of 5–47 words, padded on the right and on the left: the check's
time (it runs once, before the first step; a warm-up forward is paid before it, as the first step would pay it), and
the median time of the DP steps after the first, in one run. The engine's audit: the same model and data through
``make_private`` and a hand-written loop (right padding) for ``--engine-steps`` steps; the audits' mean time and the
median step (without an audit), in the same run, give its amortized share over a 1,000-step run from the schedule's
expected number of audits (8 + Σ_{k=8}^{999} 4/(k + 1) ≈ 27).

    OMP_NUM_THREADS=2 dp-bench batch-check-cost
    dp-bench batch-check-cost --replot    # the tables of docs/results/batch_check_cost.json
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.errors import BatchDependenceError

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS


@dataclass
class Config:
    steps: int = opt(6, "DP steps per padding side (the first is not timed)")
    engine_steps: int = opt(24, "DP steps of the engine's audited loop (the first 8 are all audited)")
    batch: int = opt(32, "logical batch (expected Poisson batch size)")
    records: int = opt(512, "training records")
    seed: int = opt(0, "seed of the classifier head and the LoRA initialization")
    out: Path = opt(RESULTS / "batch_check_cost.json", "result JSON")
    replot: bool = opt(False, "only print the tables of --out")


def _dataset(tokenizer: Any, n: int) -> Any:
    import datasets

    g = torch.Generator().manual_seed(0)
    words = ["good", "bad", "film", "plot", "actor", "boring", "great", "story", "the", "a"]
    lengths = torch.randint(5, 48, (n,), generator=g).tolist()
    texts = [" ".join(words[int(i)] for i in torch.randint(0, 10, (k,), generator=g)) for k in lengths]
    table = datasets.Dataset.from_dict({"text": texts, "labels": [i % 2 for i in range(n)]})
    return table.map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), remove_columns=["text"])


def _lora(cfg: Config, side: str) -> tuple[Any, Any, Any]:
    """The LoRA model (warmed up by one forward), its tokenizer padding on ``side``, and the tokenized records."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from ..data import minilm_path

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = side
    data = _dataset(tokenizer, cfg.records)
    with torch.random.fork_rng(devices=[]):  # the classifier head and LoRA are drawn from the global RNG
        torch.manual_seed(cfg.seed)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    with torch.no_grad():  # the warm-up forward the first step would otherwise pay inside the check
        model(**DataCollatorWithPadding(tokenizer)([data[0], data[1]]).data)
    return model, tokenizer, data


def measure(side: str, cfg: Config) -> dict[str, Any]:
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments
    from transformers import DataCollatorWithPadding, TrainerCallback

    model, tokenizer, data = _lora(cfg, side)

    class Steps(TrainerCallback):
        times: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    steps = Steps()
    args = DPTrainingArguments(
        tempfile.mkdtemp(),
        per_device_train_batch_size=cfg.batch,
        max_steps=cfg.steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        noise_multiplier=1.0,
        target_delta=1e-5,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[steps],
        )
        try:
            trainer.train()
        except BatchDependenceError:
            pass  # refused before the first step: only the check was timed
    check = trainer.batch_check_result
    return {
        "check_s": check.seconds,
        "step_s_median": statistics.median(steps.times[1:]) if len(steps.times) > 1 else None,
        "independent": check.outcome.independent,
        "worst_relative_difference": check.outcome.worst,
        "refused": not check.outcome.independent,
        "position_ids_from_mask": trainer.position_ids_from_mask,
    }


def tables(result: dict[str, Any]) -> str:
    """One line per padding side: the check's time in DP steps, and whether the set-up was refused; the engine's
    audit's amortized share."""
    lines = []
    e = result.get("engine_audit")
    if e is not None:
        lines.append(
            f"engine audit: {e['audits']} audits in {e['steps']} steps, {e['audit_s_mean']:.3f} s each "
            f"(training mode: {e['train_mode']}), step {e['step_s_median_without_audit']:.3f} s; amortized over 1,000 "
            f"steps ({e['expected_audits_1000']:.1f} audits): {100 * e['amortized_share_1000']:.2f} %\n"
        )
    for side, r in result["sides"].items():
        outcome = "refused (BatchDependenceError)" if r["refused"] else "trained"
        fix = ", position_ids from the mask" if r["position_ids_from_mask"] else ""
        lines.append(
            f"{side} padding: check {r['check_s']:.3f} s once = {result['check_over_step'][side]:.2f} DP steps; "
            f"{outcome}{fix}\n"
        )
    return "".join(lines)


REPORT = runner.Report(tables=tables)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench batch-check-cost", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, None)
    res = {**start("batch-check-cost", cfg, argv), "torch": torch.__version__}
    res["command"] = "OMP_NUM_THREADS=2 " + res["command"]
    res.update(threads=torch.get_num_threads(), batch=cfg.batch)
    res["sides"] = {side: measure(side, cfg) for side in ("right", "left")}
    step = res["sides"]["right"]["step_s_median"]
    res["check_over_step"] = {side: r["check_s"] / step for side, r in res["sides"].items()}
    res["engine_audit"] = measure_engine(cfg)
    return runner.write(res, REPORT, cfg.out, indent=2)


def expected_audits(steps: int) -> float:
    """Audits the engine's schedule runs over ``steps`` training forwards, in expectation."""
    from opacus_spectral.doctor.batch_check import DENSE, SPARSE

    return min(steps, DENSE) + sum(SPARSE / (k + 1) for k in range(DENSE, steps))


def measure_engine(cfg: Config) -> dict[str, Any]:
    """The engine's audit on a hand-written DP-LoRA loop: mean seconds per audit, median step without an audit, and
    the amortized share over 1,000 steps."""
    from transformers import DataCollatorWithPadding

    from opacus_spectral import PrivacyEngine

    model, tokenizer, data = _lora(cfg, "right")
    model.train()
    collate = DataCollatorWithPadding(tokenizer)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch, collate_fn=lambda rows: collate(rows).data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="prv")
        gsm, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    audit, plain, done = engine.batch_check, [], 0
    while done < cfg.engine_steps:
        for batch in dl:
            labels = batch.pop("labels")
            if not len(labels):
                continue  # an empty Poisson batch: nothing to time (a timing loop, not a training run)
            before, t0 = audit.audits, time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(gsm(**batch).logits, labels).backward()
            opt.step()
            if audit.audits == before and done > 0:
                plain.append(time.perf_counter() - t0)
            done += 1
            if done == cfg.engine_steps:
                break
    per_audit = audit.total_seconds / max(audit.audits, 1)
    step = statistics.median(plain)
    return {
        "steps": done,
        "audits": audit.audits,
        "train_mode": audit.train_mode,
        "audit_s_mean": per_audit,
        "step_s_median_without_audit": step,
        "expected_audits_1000": expected_audits(1000),
        "amortized_share_1000": expected_audits(1000) * per_audit / (1000 * step),
    }
