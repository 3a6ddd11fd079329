"""DDP with 2 processes (gloo on 127.0.0.1): the pipeline runs after the all-reduce, so every rank sees the same
noisy gradient (never rank 1's clean clipped sum), with sigma = nm*C/(B*k*W) measured."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

NM, C, N, B = 1.3, 0.7, 64, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, wrapper: str) -> None:
    from engine_helpers import Recorder, loader, mlp
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from opacus_spectral import PrivacyEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = (DPDDP if wrapper == "dpddp" else DDP)(mlp(seed=0))  # same init on both ranks
        rec = Recorder()
        engine = PrivacyEngine(accountant="rdp")
        model, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(N, B),
            noise_multiplier=NM,
            max_grad_norm=C,
            post_hooks=[rec],
        )
        it = iter(dl)
        for zero in (True, False):  # step 0: zero clipped sum (pure noise); step 1: a real loss
            x, y = next(it)
            opt.zero_grad()
            out = model(x)
            nn.functional.mse_loss(out * 0.0 if zero else out, torch.zeros_like(y) if zero else y).backward()
            opt.step()
        torch.save(
            {"seen": rec.seen, "world": opt.world_size, "params": [p.detach() for p in model.parameters()]},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", ["dpddp", "ddp"])
def test_ddp_hook_sees_identical_post_allreduce_noise(tmp_path, wrapper):
    world = 2
    mp.start_processes(
        _worker, args=(world, _free_port(), str(tmp_path), wrapper), nprocs=world, join=True, start_method="spawn"
    )
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["world"] == r1["world"] == 2
    for step in range(2):
        a, b = r0["seen"][step], r1["seen"][step]
        assert [x["name"] for x in a] == [x["name"] for x in b]
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["tensor"], y["tensor"])  # identical on every rank
            assert x["sigma"] == y["sigma"]
    # per-worker B = 16/2 = 8; std = nm*C/(B*k*W) = nm*C/16
    expected = NM * C / (8 * 1 * 2)
    assert r0["seen"][0][0]["sigma"] == pytest.approx(expected, rel=1e-9)
    flat = torch.cat([x["tensor"].flatten().double() for x in r1["seen"][0]])
    assert float(flat.std()) == pytest.approx(expected, rel=0.03)  # rank 1 holds noise, not its clean (zero) sum
    for p, q in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p, q)
