"""DPTrainer with ``noise_mechanism`` (docs/trainer.md, "Noise mechanisms"; docs/mechanisms.md): the argument's
forms, the batches the Trainer trains on drawn by the engine's cyclic Poisson sampler (group t mod b at rate b·q),
σ calibrated and ε reported through BandMF's accounting (checked against Opacus' own RDP accountant), b = 1 as
today's DP-SGD bit for bit, the mechanism in the privacy record, and a resume that keeps the partition and the
group cycle, ends at the uninterrupted run's ε and writes no noise buffer."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from opacus_spectral.hf.state import DP_STATE_FILE
from opacus_spectral.mechanisms.cyclic import partition, partition_digest
from peft import LoraConfig, get_peft_model
from repo_support import subprocess_env
from text_support import synthetic_text_task, tiny_bert
from torch import nn
from trainer_support import quiet_cpu_args
from transformers import HfArgumentParser

pytestmark = pytest.mark.slow

N, B, DELTA = 64, 8, 1e-5  # q = 1/8: 8 steps per epoch
Q = B / N


def lora_model() -> nn.Module:
    model = tiny_bert(seed=0)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))


class Recording(DPTrainer):
    """Keeps the rows (input_ids) of every micro-batch it trains on, per DP step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows = [tuple(r.tolist()) for r in inputs["input_ids"]]
        self.seen = getattr(self, "seen", [])
        if not self.seen or self.seen[-1][0] != self.state.global_step:
            self.seen.append((self.state.global_step, []))
        self.seen[-1][1].extend(rows)
        return super().training_step(model, inputs, num_items_in_batch)


def trainer(out, *, mechanism="bandmf", bands=2, seed=None, n=N, **kw) -> Recording:
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    spec = mechanism if bands is None else {"name": mechanism, "bands": bands}
    run = dict(per_device_train_batch_size=B, max_steps=6, learning_rate=0.05, noise_multiplier=1.0)
    a = quiet_cpu_args(out, **{**run, "noise_mechanism": spec, "noise_seed": seed, **kw})
    return quietly(
        Recording,
        model=model,
        args=a,
        train_dataset=synthetic_text_task(n, seq_len=8, seed=0),
        optimizers=(torch.optim.SGD(params, lr=0.05), None),
    )


def quietly(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        return fn(*args, **kw)


def opacus_epsilon(sigma: float, rate: float, steps: int) -> float:
    accountant = RDPAccountant()
    accountant.history = [(sigma, rate, steps)]
    return accountant.get_epsilon(DELTA)


def record_index() -> dict[tuple[int, ...], int]:
    data = synthetic_text_task(N, seq_len=8, seed=0)
    index = {tuple(data[i]["input_ids"].tolist()): i for i in range(N)}
    assert len(index) == N  # every record's tokens are its own
    return index


def groups_trained(t: Recording) -> list[tuple[int, set[int]]]:
    index = record_index()
    return [(step, {index[r] for r in rows}) for step, rows in t.seen]


# -- the argument --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "read"),
    [
        (None, "gaussian"),
        ("bandmf", "bandmf"),
        ({"name": "bandmf", "bands": 4}, {"name": "bandmf", "bands": 4}),
        ('{"name": "bandmf", "bands": 4}', {"name": "bandmf", "bands": 4}),
        (("bandmf", {"bands": 4}), {"name": "bandmf", "bands": 4}),
    ],
)
def test_noise_mechanism_forms(tmp_path, given, read):
    assert quiet_cpu_args(tmp_path, noise_multiplier=1.0, noise_mechanism=given).noise_mechanism == read


def test_noise_mechanism_from_the_command_line_and_back(tmp_path):
    parser = HfArgumentParser(DPTrainingArguments)
    cli = ["--output_dir", str(tmp_path), "--target_delta", "1e-5", "--noise_multiplier", "1", "--report_to", "none"]
    (a,) = parser.parse_args_into_dataclasses([*cli, "--noise_mechanism", '{"name": "bandmf", "bands": 4}'])
    assert a.noise_mechanism == {"name": "bandmf", "bands": 4}
    (b,) = parser.parse_dict(a.to_dict())
    assert b.noise_mechanism == {"name": "bandmf", "bands": 4}
    (c,) = parser.parse_args_into_dataclasses([*cli, "--noise_mechanism", "bandmf"])
    assert c.noise_mechanism == "bandmf"


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        ("bandfm", ValueError, "unknown noise mechanism 'bandfm'.*Did you mean 'bandmf'"),
        ({"name": "bandmf", "bands": 0}, ValueError, "bands must be an integer >= 1"),
        ({"bands": 4}, ValueError, "noise_mechanism.*needs a 'name'"),
        ('{"name": "bandmf", bands: 4}', ValueError, "noise_mechanism.*not a JSON object"),
        (["bandmf"], TypeError, "noise_mechanism must be"),
    ],
)
def test_a_bad_noise_mechanism_is_refused_when_the_arguments_are_built(tmp_path, given, error, match):
    with pytest.raises(error, match=match):
        quiet_cpu_args(tmp_path, noise_multiplier=1.0, noise_mechanism=given)


@pytest.mark.parametrize(
    ("hub", "refused"),
    [
        ({"hub_strategy": "checkpoint"}, True),
        ({"hub_strategy": "all_checkpoints"}, True),
        ({"hub_strategy": "every_save"}, False),
        ({"hub_strategy": "checkpoint", "hub_private_repo": True}, False),
    ],
)
def test_pushing_checkpoints_with_the_partition_seed_to_a_public_hub_repository_is_refused(tmp_path, hub, refused):
    """The checkpoints' DP state holds the partition seed: published, the ε holds for zero-out adjacency only."""
    kw = dict(noise_multiplier=1.0, noise_mechanism={"name": "bandmf", "bands": 4}, push_to_hub=True, **hub)
    if refused:
        with pytest.raises(ValueError, match="partition seed"):
            quiet_cpu_args(tmp_path, **kw)
    else:
        quiet_cpu_args(tmp_path, **kw)
    quiet_cpu_args(tmp_path, **{**kw, "noise_mechanism": {"name": "bandmf", "bands": 1}})  # b = 1: one group


def test_make_private_kwargs_may_not_choose_the_mechanism(tmp_path):
    with pytest.raises(ValueError, match=r"make_private_kwargs may not set \['noise_mechanism', 'steps'\]"):
        quiet_cpu_args(tmp_path, noise_multiplier=1.0, make_private_kwargs={"noise_mechanism": "bandmf", "steps": 4})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(bands=8, max_steps=4), r"bands=8 exceeds the run's 4 steps"),
        (dict(bands=16, max_steps=20), r"bands × B/N = 16 × 0\.125, exceeds 1: use at most 8 bands"),
        (dict(accountant="gdp"), r"noise_mechanism='bandmf' needs an upper-bound accountant"),
        (dict(post_hooks=["ema"]), r"EMADenoiser assume\(s\) DP noise independent across steps"),
    ],
    ids=["bands_over_steps", "rate_over_one", "gdp", "ema"],
)
def test_what_make_private_refuses_under_bandmf_the_trainer_refuses(tmp_path, kw, match):
    t = trainer(tmp_path, **{"bands": 2, **kw})
    with pytest.raises(ValueError, match=match):
        t.train()


# -- training ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bandmf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bandmf")
    t = trainer(out, bands=4, max_steps=7, save_strategy="steps", save_steps=3)
    t.train()
    t.save_model(str(out / "adapter"))
    return out, t


def test_the_trainer_trains_on_group_t_mod_b_of_the_engines_partition(bandmf_run):
    out, t = bandmf_run
    run = t.privacy_engine.mechanism_run
    parts = partition(N, 4, run.partition_seed)
    assert [set(p.tolist()) for p in run.loader.batch_sampler.parts] == [set(p.tolist()) for p in parts]
    trained = groups_trained(t)
    assert [s for s, _ in trained] == list(range(7))  # every step drew records (rate b·q = 1/2 of 16)
    for step, records in trained:
        assert records <= set(parts[step % 4].tolist()), step
    assert any(len(r) < N // 4 for _, r in trained)  # Poisson within the group, not the whole group
    assert run.loader.batch_sampler.step == 7  # the one sampler: its steps are the Trainer's
    assert t.privacy_engine.doctor is None or t.privacy_engine.doctor.findings == []


def test_epsilon_is_bandmf_accounting_checked_with_opacus(bandmf_run):
    out, t = bandmf_run
    history = [(1.0, 4 * Q, math.ceil(7 / 4))]  # σ, b·q, ⌈T/b⌉
    assert t.privacy_engine.accountant.history == history
    expected = opacus_epsilon(*history[0])
    assert t.get_epsilon() == pytest.approx(expected, rel=1e-9)
    assert [r["epsilon"] for r in t.state.log_history if "epsilon" in r][-1] == pytest.approx(expected, rel=1e-9)
    record = json.loads((out / "adapter" / "privacy_record.json").read_text())
    assert [(r["mechanism"], r["sampler"]) for r in record["runs"]] == [("bandmf", "cyclic_poisson")]


def test_calibration_to_target_epsilon_uses_bandmf_accounting(tmp_path):
    t = trainer(tmp_path, bands=2, max_steps=5, noise_multiplier=None, target_epsilon=4.0)
    t.train()
    sigma = t.noise_multiplier
    assert t.privacy_engine.accountant.history == [(sigma, 2 * Q, 3)]
    eps = opacus_epsilon(sigma, 2 * Q, 3)
    assert 4.0 - 0.05 <= eps <= 4.0 and t.get_epsilon() == pytest.approx(eps, rel=1e-9)
    assert opacus_epsilon(sigma, Q, 5) < 4.0 - 0.5  # not DP-SGD's calibration (which this σ over-noises)


def test_the_budget_stops_at_the_last_dp_step_of_the_last_accounted_step_within_it(tmp_path):
    target = opacus_epsilon(1.0, 2 * Q, 2) + 1e-3  # two accounted steps fit, a third does not
    t = trainer(tmp_path, bands=2, max_steps=8, target_epsilon=target)
    with pytest.warns(RuntimeWarning, match="stopping at step 4"):
        t.train()
    assert t.state.global_step == 4 and t.budget_steps == 4
    assert t.privacy_engine.accountant.history == [(1.0, 2 * Q, 2)] and t.get_epsilon() <= target


def test_one_band_is_todays_dp_sgd_bit_for_bit(tmp_path):
    runs = {}
    for name, bands in (("gaussian", None), ("bandmf", 1)):
        t = trainer(tmp_path / name, mechanism=name, bands=bands, seed=5, max_steps=4)
        quietly(t.train)
        weights = torch.cat([p.detach().flatten() for p in t.model.parameters() if p.requires_grad])
        runs[name] = (weights, t.privacy_engine.accountant.history, t.get_epsilon(), groups_trained(t))
    (w0, h0, e0, g0), (w1, h1, e1, g1) = runs["gaussian"], runs["bandmf"]
    assert torch.equal(w0, w1) and h0 == h1 == [(1.0, Q, 4)] and e0 == e1 and g0 == g1


def test_loader_workers_drawing_ahead_still_train_group_t_mod_b(tmp_path):
    t = trainer(tmp_path, bands=2, max_steps=3, dataloader_num_workers=1)
    t.train()
    parts = partition(N, 2, t.privacy_engine.mechanism_run.partition_seed)
    trained = groups_trained(t)
    assert [s for s, _ in trained] == list(range(3))
    for step, records in trained:
        assert records <= set(parts[step % 2].tolist()), step


# -- resume --------------------------------------------------------------------------------------------------
def test_a_resumed_run_keeps_the_partition_and_cycle_and_ends_at_the_same_epsilon(bandmf_run, tmp_path):
    out, full = bandmf_run
    checkpoint = out / "checkpoint-3"
    state = torch.load(checkpoint / DP_STATE_FILE, weights_only=True)
    seed = full.privacy_engine.mechanism_run.partition_seed
    digest = partition_digest(full.privacy_engine.mechanism_run.loader.batch_sampler.parts)
    realized = full.privacy_engine.mechanism_run.realization
    assert state["noise_mechanism"] == {
        "name": "bandmf",
        "bands": 4,
        "steps": 7,
        "coefficients": list(realized.coefficients),  # the strategy as a fact, compared exactly at a resume
        "kappa": 1.0,
        "sample_rate": Q,
        "noise_multiplier": 1.0,
        "max_grad_norm": full.args.per_sample_max_grad_norm,
        "partition_seed": seed,
        "partition_digest": digest,
        "step": 3,
    }
    assert state["config"]["noise_mechanism"] == {"name": "bandmf", "bands": 4, "steps": 7}
    shapes = {tuple(p.shape) for p in full.model.parameters() if p.requires_grad}

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict | list | tuple):
            for v in x.values() if isinstance(x, dict) else x:
                yield from tensors(v)

    assert not [t for t in tensors(state) if tuple(t.shape) in shapes]  # no noise buffer of a trained tensor
    resumed = trainer(tmp_path, bands=4, max_steps=7, save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    run = resumed.privacy_engine.mechanism_run
    assert run.partition_seed == seed and run.loader.batch_sampler.step == 7
    parts = partition(N, 4, seed)
    trained = groups_trained(resumed)
    assert [s for s, _ in trained] == [3, 4, 5, 6]
    for step, records in trained:
        assert records <= set(parts[step % 4].tolist()), step
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    assert resumed.get_epsilon() == full.get_epsilon()


@pytest.mark.parametrize(
    ("mechanism", "bands", "steps", "match"),
    [
        (
            "bandmf",
            2,
            7,
            r"noise_mechanism: checkpoint \{'name': 'bandmf', 'bands': 4, 'steps': 7\}, now \{.*'bands': 2,",
        ),
        ("bandmf", 4, 8, r"mechanism: checkpoint \{.*'steps': 7\}, now \{'name': 'bandmf', 'bands': 4, 'steps': 8"),
        ("gaussian", None, 7, r"noise_mechanism: checkpoint \{'name': 'bandmf'.*now \{'name': 'gaussian'\}"),
    ],
    ids=["other_bands", "other_length", "gaussian"],
)
def test_resuming_with_another_mechanism_is_refused(bandmf_run, tmp_path, mechanism, bands, steps, match):
    out, _ = bandmf_run
    t = trainer(tmp_path, mechanism=mechanism, bands=bands, max_steps=steps)
    with pytest.raises(ValueError, match=match):
        t.train(resume_from_checkpoint=str(out / "checkpoint-3"))


# -- across processes ----------------------------------------------------------------------------------------
DDP_N, DDP_STEPS, DDP_SAVE = 32, 6, 3  # logical batch 4 (2 per rank): q = 1/8; 4 bands: rate 1/2 in a group of 8


def ddp_run(out: Path) -> dict:
    """A torchrun rank (or one process): bandmf with 4 bands, OS-entropy noise and partition seed, 6 steps saved at
    3, then resumed from step 3 by a new DPTrainer; what each run trained on and released."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    results = []
    for resume in (None, str(out / f"checkpoint-{DDP_SAVE}")):
        t = trainer(
            out,
            bands=4,
            max_steps=DDP_STEPS,
            per_device_train_batch_size=4 // world,
            ddp_backend="gloo" if world > 1 else None,
            save_strategy="steps",
            save_steps=DDP_SAVE,
            n=DDP_N,
        )
        t.train(resume_from_checkpoint=resume)
        index = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(synthetic_text_task(DDP_N, seq_len=8, seed=0))}
        results.append(
            {
                "optimizer": type(t._dp).__name__,
                "seed": t.privacy_engine.mechanism_run.partition_seed,
                "trained": [(step, sorted(index[r] for r in rows)) for step, rows in t.seen],
                "history": t.privacy_engine.accountant.history,
                "eps": t.get_epsilon(),
                "adapter": torch.cat([p.detach().flatten() for p in t.model.parameters() if p.requires_grad]),
            }
        )
    return {"rank": int(os.environ.get("RANK", "0")), "runs": results}


@pytest.mark.ddp
def test_two_processes_sample_shares_of_the_same_group_with_one_partition(tmp_path):
    """torchrun --nproc_per_node 2: at step t each rank trains on records of its share of group t mod b only (the
    ranks' shares disjoint), every rank holds rank 0's partition seed (before and after a resume), the accountant
    holds BandMF's history (σ, b·q, ⌈T/b⌉) with Opacus' ε, and rank 0's noise reaches both ranks' weights."""
    port = _free_port()
    env = subprocess_env(base=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(port), __file__, str(tmp_path)]
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:  # a rank waiting in a collective: end the whole group
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
    assert proc.returncode == 0, log[-8000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["runs"] for r in range(2)]
    first, resumed = ranks[0]
    seed = first["seed"]
    parts = partition(DDP_N, 4, seed)
    assert first["optimizer"] == "DistributedDPOptimizer"
    assert {run["seed"] for rank in ranks for run in rank} == {seed}  # one partition, kept by the resume
    for i, steps in enumerate(([0, 1, 2, 3, 4, 5], [3, 4, 5])):
        assert [s for s, _ in ranks[0][i]["trained"]] == [s for s, _ in ranks[1][i]["trained"]] == steps
        for (step, mine), (_, theirs) in zip(ranks[0][i]["trained"], ranks[1][i]["trained"], strict=True):
            group = parts[step % 4].tolist()
            assert set(mine) <= set(group[0::2]) and set(theirs) <= set(group[1::2]), step
        history = [(1.0, 0.5, 2)]  # σ, b·q, ⌈6/4⌉
        assert ranks[0][i]["history"] == ranks[1][i]["history"] == history
        assert ranks[0][i]["eps"] == ranks[1][i]["eps"] == pytest.approx(opacus_epsilon(*history[0]), rel=1e-9)
        assert torch.equal(ranks[0][i]["adapter"], ranks[1][i]["adapter"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # the torchrun worker
    target = Path(sys.argv[1])
    result = ddp_run(target / "ddp")
    torch.save(result, target / f"rank{result['rank']}.pt")


def test_ranks_that_disagree_name_the_partition_seed_but_never_show_it(monkeypatch):
    """check_ranks_agree names what differs among the ranks with their values, except the records' fingerprint and
    the partition seed (a secret: with it the group assignment is public)."""
    import torch.distributed as dist
    from opacus_spectral.hf.distributed import check_ranks_agree

    ranks = [{"partition seed": 123456789, "sampler step": 3}, {"partition seed": 987654321, "sampler step": 4}]
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, local: out.__setitem__(slice(None), ranks))
    with pytest.raises(ValueError, match=r"the partition seed; sampler step \(rank 0: 3, rank 1: 4\)") as caught:
        check_ranks_agree(ranks[0])
    assert "123456789" not in str(caught.value) and "987654321" not in str(caught.value)
