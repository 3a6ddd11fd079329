"""BandMF under DDP with 2 processes (gloo on 127.0.0.1), no noise_seed: every rank uses rank 0's partition, at step t
the ranks sample disjoint shares of group t mod b, the noise is added once (rank 0) and every rank ends with the
same weights, denoisers seeing the same per-step noise std; the accountant is charged (σ, b·q) every b steps."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

N, B, BANDS, STEPS = 96, 24, 2, 6  # q = 1/4, rate 1/2 within a group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from engine_helpers import Recorder
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_spectral import PrivacyEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same init on both ranks
        model = DPDDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        data = TensorDataset(torch.randn(N, 4, generator=torch.Generator().manual_seed(1)), torch.arange(N))
        rec = Recorder()
        engine = PrivacyEngine(accountant="rdp")  # OS-entropy seeds: the partition seed must still agree
        model, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=B),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            post_hooks=[rec],
            noise_mechanism=("bandmf", {"bands": BANDS}),
            steps=STEPS,
        )
        batches: list[list[int]] = []
        while len(batches) < STEPS:  # 4 steps per pass: the group cycle runs on across the pass boundary
            for x, idx in dl:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                batches.append(idx.tolist())
                if len(batches) == STEPS:
                    break
        torch.save(
            {
                "seed": engine.mechanism_run.partition_seed,
                "batches": batches,
                "sigmas": [step[0]["sigma"] for step in rec.seen],
                "history": engine.accountant.history,
                "params": [p.detach() for p in model.parameters()],
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_ranks_share_the_partition_and_sample_disjoint_shares_of_one_group(tmp_path):
    from opacus_spectral.mechanisms.cyclic import partition

    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["seed"] == r1["seed"]
    group_of = {int(i): g for g, part in enumerate(partition(N, BANDS, r0["seed"])) for i in part}
    for t, (a, b) in enumerate(zip(r0["batches"], r1["batches"], strict=True)):
        assert not set(a) & set(b)
        assert all(group_of[i] == t % BANDS for i in a + b)
    assert sum(len(a) + len(b) for a, b in zip(r0["batches"], r1["batches"], strict=True)) > 0.5 * STEPS * B
    assert r0["sigmas"] == r1["sigmas"] and len(set(r0["sigmas"])) > 1  # the std of M⁻¹'s rows, on both ranks
    assert r0["history"] == [(1.0, BANDS / 4, STEPS // BANDS)]
    assert all(torch.equal(p, q) for p, q in zip(r0["params"], r1["params"], strict=True))


def _noise_worker(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    """Zero-loss steps (the update is the released noise) under DDP with ``noise_seed``, in ``mode`` clipping."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_spectral import PrivacyEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DPDDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)))
        data = TensorDataset(torch.randn(N, 4, generator=torch.Generator().manual_seed(1)), torch.arange(N))
        kw = {"grad_sample_mode": "ghost", "criterion": nn.MSELoss()} if mode == "ghost" else {}
        out = PrivacyEngine(accountant="rdp", noise_seed=7).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(data, batch_size=B),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_mechanism=("bandmf", {"bands": BANDS}),
            steps=STEPS,
            **kw,
        )
        model, opt, dl = out[0], out[1], out[-1]
        criterion = out[2] if mode == "ghost" else nn.MSELoss()
        done = 0
        while done < STEPS:
            for x, _ in dl:
                opt.zero_grad()
                y = model(x)
                criterion(y, y.detach()).backward()  # zero per-example gradients (one output per example)
                opt.step()
                done += 1
                if done == STEPS:
                    break
        torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"{mode}{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ghost_clipping_adds_the_noise_once_as_hooks_does(tmp_path):
    """Opacus' ghost DDP optimizer is not a DistributedDPOptimizer: rank 0 alone must still add the noise. With the
    same noise_seed and zero gradients, ghost and hooks runs release the same noise (not √W or W times it)."""
    for mode in ("hooks", "ghost"):
        args = (2, _free_port(), str(tmp_path), mode)
        mp.start_processes(_noise_worker, args=args, nprocs=2, join=True, start_method="spawn")
    torch.manual_seed(0)
    init = [p.detach() for p in nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).parameters()]
    runs = {f"{m}{r}": torch.load(tmp_path / f"{m}{r}.pt") for m in ("hooks", "ghost") for r in (0, 1)}
    moved = [torch.cat([(p - q).reshape(-1) for p, q in zip(run, init, strict=True)]) for run in runs.values()]
    assert float(moved[0].abs().max()) > 1e-3  # the noise moved the weights
    for other in moved[1:]:
        assert torch.allclose(other, moved[0], atol=1e-6)
