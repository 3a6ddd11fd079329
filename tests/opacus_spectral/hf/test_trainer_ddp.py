"""DPTrainer across processes: ``torchrun --nproc_per_node 2`` (gloo on 127.0.0.1) against one process with the same
logical batch. Run as a script, this file is the torchrun worker
(``torchrun ... tests/opacus_spectral/hf/test_trainer_ddp.py OUT``).

* sample rate 1 (every record in every step, so both runs train on the same records), σ = 1, the same
  ``noise_seed`` (rank 0 then draws the one-process noise): the same LA-LoRA adapter to 1e-5 relative after 3 steps,
  the same accountant and ε, and both ranks release the same noisy gradient, equal to the one-process one;
* sample rate 1/4 on 8 records, σ calibrated for ε = 3, OS-entropy noise on each rank: the one-process σ, history
  and ε; every rank takes all 20 steps though a rank's Poisson batch is empty at some of them (Opacus' distributed
  sampler skips those), both ranks release the same gradient (rank 0's noise), the doctor (``"raise"``) stays silent;
* ghost clipping as the first run; a run stopped at step 2 and resumed has the uninterrupted accounting;
* FSDP is refused under torchrun, a causal LM's evaluation across processes too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_support import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

RUNS: dict[str, dict[str, Any]] = {
    # records, logical batch (= per_device x accumulation x processes), accumulation, steps, DP settings
    "full": dict(
        n=32, logical=32, accum=2, steps=3, lr=0.05, dp=dict(noise_multiplier=1.0, noise_seed=7, accountant="rdp")
    ),
    "poisson": dict(n=8, logical=2, accum=1, steps=20, lr=0.01, dp=dict(target_epsilon=3.0, accountant="rdp")),
    "ghost": dict(
        n=32,
        logical=32,
        accum=1,
        steps=2,
        lr=0.05,
        dp=dict(noise_multiplier=1.0, noise_seed=7, accountant="rdp", grad_sample_mode="ghost"),
    ),
    "resume": dict(
        n=16, logical=8, accum=1, steps=4, lr=0.05, save_steps=2, dp=dict(noise_multiplier=1.0, accountant="rdp")
    ),  # stopped at 2 and resumed to 4
}


def train(out: Path, name: str) -> dict[str, Any]:
    """One DPTrainer run of RUNS[name] in this process (a torchrun worker, or one process): what it released.
    A run with ``save_steps`` is trained, then a new DPTrainer resumes it from its checkpoint at ``save_steps``."""
    import warnings

    from engine_helpers import Recorder
    from opacus_spectral.errors import ReproducibleNoiseWarning
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments
    from opacus_spectral.hf.distributed import LockstepPoissonSampler
    from peft import get_peft_model
    from text_support import synthetic_text_task, tiny_bert

    import peft_lalora  # noqa: F401  (registers LALORA; DPTrainer attaches the alternation)
    from peft_lalora import LALoraConfig

    run = RUNS[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)

    def model_of() -> torch.nn.Module:  # the same initial weights in every process
        model = tiny_bert(seed=0)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            cfg = LALoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query"], task_type="SEQ_CLS", alternation="step"
            )
            return get_peft_model(model, cfg)

    save = dict(save_strategy="steps", save_steps=run["save_steps"]) if "save_steps" in run else {"save_strategy": "no"}
    recorder = Recorder()
    args = DPTrainingArguments(
        output_dir=str(out / name),
        per_device_train_batch_size=run["logical"] // (run["accum"] * world),
        gradient_accumulation_steps=run["accum"],
        max_steps=run["steps"],
        learning_rate=run["lr"],
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **save,
        target_delta=1e-5,
        post_hooks=[recorder],
        **run["dp"],
    )
    sizes: list[int] = []
    plain_iter = LockstepPoissonSampler.__iter__

    def recorded(self: Any) -> Any:  # the local Poisson batch sizes this rank drew
        for batch in plain_iter(self):
            sizes.append(len(batch))
            yield batch

    model = model_of()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    def trainer_of(model: torch.nn.Module) -> DPTrainer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReproducibleNoiseWarning)
            return DPTrainer(model=model, args=args, train_dataset=synthetic_text_task(run["n"], seq_len=8, seed=0))

    trainer = trainer_of(model)
    LockstepPoissonSampler.__iter__ = recorded  # type: ignore[method-assign]
    try:
        trainer.train()
        if "save_steps" in run:
            model = model_of()  # a new process would start from the initial weights, then load the checkpoint
            trainer = trainer_of(model)
            trainer.train(resume_from_checkpoint=str(out / name / f"checkpoint-{run['save_steps']}"))
    finally:
        LockstepPoissonSampler.__iter__ = plain_iter  # type: ignore[method-assign]
    return {
        "world": trainer.args.world_size,
        "optimizer": type(trainer._dp).__name__,
        "wrapped": type(trainer.model_wrapped).__name__,
        "steps": trainer.state.global_step,
        "sigma": trainer.noise_multiplier,
        "q": trainer.sample_rate,
        "eps": trainer.get_epsilon(),
        "history": trainer.privacy_engine.accountant.history,
        "sizes": sizes[: run["steps"]],
        "released": [torch.cat([g["tensor"].flatten() for g in step]) for step in recorder.seen],
        "adapter": {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n},
        "before": before,
        "findings": trainer.privacy_engine.doctor.findings if trainer.privacy_engine.doctor else [],
    }


#: how rank 1's run differs from rank 0's in the agreement checks (rank 0: 16 records in order, C = 1)
MISMATCHES = ("same", "order", "length", "setup")


def mismatch_refusal(out: Path, kind: str) -> str:
    """The error of a one-step DPTrainer run whose rank 1 holds the records in another order, one record fewer, or
    another clipping bound ("same": rank 1 builds the same records itself); "no error" if it trains."""
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments
    from peft import LoraConfig, get_peft_model
    from text_support import synthetic_text_task, tiny_bert

    rank = int(os.environ.get("RANK", "0"))
    data = synthetic_text_task(16, seq_len=8, seed=0)  # logical batch 8: q = 1/2 with 16 or 15 records
    if rank == 1 and kind == "order":
        data = data.select(list(reversed(range(16))))
    if rank == 1 and kind == "length":
        data = data.select(range(15))
    clip = 2.0 if rank == 1 and kind == "setup" else 1.0
    args = DPTrainingArguments(
        str(out / kind),
        per_device_train_batch_size=4,
        max_steps=1,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        target_delta=1e-5,
        noise_multiplier=1.0,
        per_sample_max_grad_norm=clip,
    )
    model = get_peft_model(tiny_bert(seed=0), LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    t = DPTrainer(model=model, args=args, train_dataset=data)
    try:
        t.train()
    except ValueError as err:
        return str(err)
    return "no error"


def left_padding_sums(out: Path) -> dict[str, torch.Tensor]:
    """The batch-independence cell across processes (tests/support/padding_support.py): the all-reduced clipped sums of
    a left-padded GPT-2 LoRA step on all six records, on all but the longest, and on the longest alone."""
    from padding_support import LENGTHS, clipped_sum

    rows = {"all": list(range(len(LENGTHS))), "rest": list(range(1, len(LENGTHS))), "longest": [0]}
    return {name: clipped_sum(out / f"left-{name}", "causal_lm", "left", r) for name, r in rows.items()}


def fsdp_refusal(out: Path) -> str:
    """The error of a DPTrainer built with an FSDP configuration (last: it leaves FSDP set in the environment)."""
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments
    from text_support import synthetic_text_task, tiny_bert

    args = DPTrainingArguments(
        str(out / "fsdp"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        fsdp=True,
        max_steps=1,
        target_delta=1e-5,
        noise_multiplier=1.0,
    )
    try:
        DPTrainer(
            model=tiny_bert(seed=0),
            args=args,
            train_dataset=synthetic_text_task(8, seq_len=8, seed=0),
        )
    except ValueError as err:
        return str(err)
    return "no error"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    """Both runs on 2 processes (one torchrun) and on one process (here)."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = subprocess_env(base=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    cmd = [
        str(torchrun),
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        __file__,
        str(out),
    ]
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:  # a rank waiting in a collective: end the whole group
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
    assert proc.returncode == 0, log[-8000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    one = {name: train(out / "one", name) for name in RUNS}
    return {"ranks": ranks, "one": one}


def test_two_processes_train_the_one_process_adapter(results):
    r0, r1, one = results["ranks"][0]["full"], results["ranks"][1]["full"], results["one"]["full"]
    assert r0["world"] == 2 and one["world"] == 1
    assert r0["optimizer"] == "DistributedDPOptimizer" and one["optimizer"] == "DPOptimizer"
    assert r0["wrapped"] == "DifferentiallyPrivateDistributedDataParallel"  # never torch DDP
    assert r0["q"] == one["q"] == 1.0 and r0["sizes"] == r1["sizes"] == [16] * 3  # each rank its half
    assert r0["sigma"] == r1["sigma"] == one["sigma"] == 1.0
    assert r0["history"] == r1["history"] == one["history"] == [(1.0, 1.0, 3)]
    assert r0["eps"] == r1["eps"] == one["eps"]
    for a, b in zip(r0["released"], r1["released"], strict=True):
        assert torch.equal(a, b)  # the denoisers' input is identical on every rank
    assert len(one["released"]) == 3
    for a, b in zip(r0["released"], one["released"], strict=True):  # rank 0's noise is the one-process noise
        assert float((a - b).norm() / b.norm()) < 1e-5
    for name, p in one["adapter"].items():
        assert not torch.equal(p, one["before"][name])  # every LoRA factor trained (A and B alternate)
        assert torch.equal(r0["adapter"][name], r1["adapter"][name])
        assert float((r0["adapter"][name] - p).norm()) <= 1e-5 * float(p.norm())


def test_two_processes_poisson_steps_in_lockstep_with_rank_zero_noise(results):
    r0, r1, one = results["ranks"][0]["poisson"], results["ranks"][1]["poisson"], results["one"]["poisson"]
    assert r0["q"] == one["q"] == 0.25
    assert r0["sigma"] == r1["sigma"] == one["sigma"] > 0  # calibrated alike: same q, same steps
    assert r0["history"] == r1["history"] == one["history"] == [(one["sigma"], 0.25, 20)]
    assert r0["eps"] == r1["eps"] == one["eps"] <= 3.0
    assert r0["steps"] == r1["steps"] == 20 and len(r0["released"]) == len(r1["released"]) == 20
    assert 0 in r0["sizes"] + r1["sizes"]  # an empty local batch on some rank: still a step on both
    assert r0["sizes"] != r1["sizes"]  # each rank samples its own shard with its own generator
    for a, b in zip(r0["released"], r1["released"], strict=True):
        assert torch.equal(a, b)
    assert r0["findings"] == r1["findings"] == []
    for name, p in r0["adapter"].items():
        assert torch.equal(p, r1["adapter"][name])


def test_fsdp_is_refused_naming_torchrun_data_parallel(results):
    for rank in results["ranks"]:
        assert rank["fsdp_refusal"].startswith("DPTrainer cannot train with FSDP")
        assert "torchrun --nproc_per_node N" in rank["fsdp_refusal"]


def test_ranks_with_the_same_records_train(results):
    assert [rank["mismatch"]["same"] for rank in results["ranks"]] == ["no error", "no error"]


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("order", r"the records \(a hash of their content, in order, differs\)\. "),
        ("length", r"dataset length \(rank 0: 16, rank 1: 15\); the records"),
        ("setup", r"per_sample_max_grad_norm \(rank 0: 1\.0, rank 1: 2\.0\)\. "),
    ],
)
def test_ranks_holding_other_records_or_settings_are_refused_on_every_rank(results, kind, names):
    """Each rank takes its share of what it holds: records in another order on rank 1 put one record in both
    shards (drawn twice in a step: 2C) and another in none; another length gives rank 0 a lower ε to save."""
    errors = [rank["mismatch"][kind] for rank in results["ranks"]]
    assert errors[0] == errors[1]  # the same error on both ranks
    assert errors[0].startswith("DPTrainer's ranks do not train the same run: ")
    assert re.search(names, errors[0]), errors[0]
    assert not re.search(r"[0-9a-f]{16}", errors[0])  # the fingerprint is never shown


def test_the_dataset_fingerprint_sees_every_record_in_order():
    """What the ranks compare (one process): records built apart agree; a swap or one changed token does not,
    wherever it is (before: beyond 4,096 records only evenly spaced ones were read, and two records swapped at unread
    positions of 9,000 passed); dataclass records count by their fields (before: by their type, so a reversed list
    passed)."""
    import dataclasses

    from opacus_spectral.hf import distributed as td
    from text_support import synthetic_text_task

    data = synthetic_text_task(10, seq_len=8, seed=0)
    again = synthetic_text_task(10, seq_len=8, seed=0)
    swapped = data.select([1, 0, *range(2, 10)])
    ids = [list(row) for row in data.with_format(None)["input_ids"]]
    ids[3][0] += 1
    edited = data.remove_columns("input_ids").add_column("input_ids", ids).with_format("torch")
    base = td.dataset_fingerprint(data)
    assert td.dataset_fingerprint(again) == base
    assert base not in {td.dataset_fingerprint(swapped), td.dataset_fingerprint(edited)}
    assert td.dataset_fingerprint(data.with_format(None)) != base  # Python lists, not tensors: typed apart
    large = [torch.tensor([i]) for i in range(9000)]
    moved = list(large)
    moved[1], moved[2] = moved[2], moved[1]
    assert td.dataset_fingerprint(large) != td.dataset_fingerprint(moved)

    @dataclasses.dataclass
    class Record:
        x: int

    records = [(Record(i),) for i in range(8)]
    assert td.dataset_fingerprint(records) != td.dataset_fingerprint(records[::-1])
    assert td.dataset_fingerprint([{"x": object()}]) == td.dataset_fingerprint([{"x": object()}])


def test_left_padding_across_processes_moves_the_clipped_sum_by_the_removed_records_own_gradient(results):
    """DESIGN invariant 8 with two processes: each rank runs the batch check and passes GPT-2 the same position_ids;
    the all-reduced clipped sum moves by exactly the longest record's own clipped gradient (≤ C)."""
    from padding_support import C

    sums = [results["ranks"][r]["left_padding"] for r in range(2)]
    assert all(torch.equal(sums[0][k], sums[1][k]) for k in sums[0])  # every rank released the same gradient
    diff = sums[0]["all"] - sums[0]["rest"]
    assert diff.norm().item() <= C * (1 + 1e-5)
    torch.testing.assert_close(diff, sums[0]["longest"], rtol=0, atol=1e-4 * C)


def test_causal_lm_evaluation_across_processes_is_refused(tmp_path, monkeypatch):
    from causal_lm_support import args, lm_dataset, lora_llama, trainer
    from transformers import TrainingArguments

    data = lm_dataset(8)
    t = trainer(tmp_path, lora_llama(), data)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))  # as under torchrun
    with pytest.raises(ValueError, match="causal LM's evaluation across processes.*Evaluate in one process"):
        t.evaluate(data)
    with pytest.raises(ValueError, match="causal LM's evaluation across processes"):
        trainer(
            tmp_path,
            lora_llama(),
            data,
            eval_dataset=data,
            train_args=args(tmp_path, eval_strategy="steps", eval_steps=1),
        )


def test_two_processes_ghost_clipping_trains_the_one_process_adapter(results):
    r0, r1, one = results["ranks"][0]["ghost"], results["ranks"][1]["ghost"], results["one"]["ghost"]
    assert r0["optimizer"] == "DistributedDPOptimizerFastGradientClipping"
    assert r0["history"] == one["history"] == [(1.0, 1.0, 2)] and r0["eps"] == one["eps"]
    for name, p in one["adapter"].items():
        assert not torch.equal(p, one["before"][name])
        assert torch.equal(r0["adapter"][name], r1["adapter"][name])
        assert float((r0["adapter"][name] - p).norm()) <= 1e-5 * float(p.norm())


def test_two_processes_resume_with_the_uninterrupted_accounting(results):
    r0, r1, one = results["ranks"][0]["resume"], results["ranks"][1]["resume"], results["one"]["resume"]
    assert r0["steps"] == r1["steps"] == one["steps"] == 4  # the resumed trainer ran steps 3 and 4
    assert r0["history"] == r1["history"] == one["history"] == [(1.0, 0.5, 4)]
    assert r0["eps"] == r1["eps"] == one["eps"]
    assert len(r0["released"]) == 4 + 2  # first run: 4 steps; resumed run: 2
    for a, b in zip(r0["released"], r1["released"], strict=True):
        assert torch.equal(a, b)


if __name__ == "__main__":  # the torchrun worker
    target = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {name: train(target / "ddp", name) for name in RUNS}
    out["mismatch"] = {kind: mismatch_refusal(target / "mismatch", kind) for kind in MISMATCHES}
    out["left_padding"] = left_padding_sums(target)
    out["fsdp_refusal"] = fsdp_refusal(target)
    torch.save(out, target / f"rank{rank}.pt")
    print(json.dumps({"rank": rank, "done": sorted(out)}))
