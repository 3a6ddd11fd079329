"""dp_bench.store: workers filling one grid JSON — a claimed run is handed to one worker only, what another
worker stored is merged in before every write, a dead worker's claim is void, and writes are atomic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dp_bench.store import SharedResult, _start_time, atomic_write_json

pytestmark = pytest.mark.slow

#: a run key as the grid commands print it when a run is trained (progress bars may share the line)
RUN_LINE = re.compile(r"(?<![\w|])(?:tune|eval)\|[^\s]+")


def test_a_claim_is_exclusive_until_stored_and_workers_merge_what_the_others_stored(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    a, b = SharedResult(path, {"runs": {}}), SharedResult(path, {"runs": {}})
    b._me = {"pid": os.getppid(), "host": a._me["host"], "start": _start_time(os.getppid())}  # a second, live worker
    assert a.claim("tune|x|lr1")
    assert not b.claim("tune|x|lr1")  # held by a live worker
    assert b.claim("tune|x|lr2")
    assert a.in_flight() == {"tune|x|lr1", "tune|x|lr2"}
    a.put("tune|x|lr1", {"final_val": 0.5, "wall_seconds": 2.0})
    b.put("tune|x|lr2", {"final_val": 0.6, "wall_seconds": 3.0})
    assert not a.claim("tune|x|lr2")  # stored by b: merged in, not trained again
    stored = json.loads(path.read_text())
    assert set(stored["runs"]) == {"tune|x|lr1", "tune|x|lr2"} and stored["wall_seconds"] == 5.0
    assert not (tmp_path / "g.json.claims").exists()  # no run in flight: no claims file left behind
    a.sync()
    assert a.result["runs"]["tune|x|lr2"]["final_val"] == 0.6


def test_a_json_from_before_the_key_format_is_upgraded_before_it_is_merged(tmp_path: Path) -> None:
    """A worker resuming a federated grid stored as a list of runs merges it under the one key format (the
    command's ``upgrade``), and its first write stores it so."""
    from dp_bench.commands import federated

    path = tmp_path / "f.json"
    old = [{"phase": "tune", "method": "dp-lora", "epsilon": 1.0, "seed": 100, "lr": 0.5}]
    path.write_text(json.dumps({"runs": old, "lr_choice": {}}))
    a = SharedResult(path, {"runs": {}}, upgrade=federated.upgrade)
    assert not a.claim("tune|dp-lora|eps1|s100|lr0.5")  # stored already: merged in under its key
    a.put("eval|dp-lora|eps1|s0|lr0.5", {"phase": "eval"})
    assert set(json.loads(path.read_text())["runs"]) == {"tune|dp-lora|eps1|s100|lr0.5", "eval|dp-lora|eps1|s0|lr0.5"}


def test_a_dead_workers_claim_is_void(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    a = SharedResult(path, {"runs": {}})
    atomic_write_json(tmp_path / "g.json.claims", {"eval|x": {"pid": pid, "host": a._me["host"], "start": "1"}})
    assert a.in_flight() == set()
    assert a.claim("eval|x")


def test_atomic_write_leaves_no_temporary_and_replaces_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.slow
def test_two_grid_workers_share_one_grid_without_training_a_run_twice(tmp_path: Path) -> None:
    pytest.importorskip("opacus_spectral")
    from fmnist_support import synthetic_fmnist  # the tests folder is on sys.path (pytest's pythonpath)

    env = {**os.environ, "FASHION_MNIST_ROOT": str(synthetic_fmnist(tmp_path / "data"))}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from dp_bench.commands import grid; grid.main(sys.argv[1:])",
        "--smoke",
        "--methods",
        "none",
        "--epsilons",
        "3",
        "--out",
        str(tmp_path),
        "--name",
        "w",
        "--no-references",
        "--threads",
        "1",
        "--resume",
    ]
    workers = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    outs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outs[0][-2000:] + outs[1][-2000:]
    trained = [k for out in outs for k in RUN_LINE.findall(out)]  # the key each worker prints per trained run
    saved = json.loads((tmp_path / "w.json").read_text())
    assert sorted(trained) == sorted(saved["runs"])  # every stored run trained exactly once, by one worker
    assert len(RUN_LINE.findall(outs[0])) < len(trained)  # both workers trained runs
    evals = [k for k in saved["runs"] if k.startswith("eval|")]
    assert len(evals) == 2  # 2 smoke seeds, each once
    assert "analysis" in saved and not (tmp_path / "w.json.claims").exists()


@pytest.mark.slow
def test_two_federated_workers_share_one_grid_without_training_a_run_twice(tmp_path: Path) -> None:
    pytest.importorskip("flwr_datasets")
    out = tmp_path / "fed.json"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from dp_bench.commands import federated; federated.main(sys.argv[1:])",
        "--smoke",
        "--out",
        str(out),
        "--threads",
        "1",
        "--resume",
        "--no-progress",
        "--methods",
        "la-lora",
    ]
    workers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outs[0][-2000:] + outs[1][-2000:]
    trained = [k for o in outs for k in RUN_LINE.findall(o)]
    saved = json.loads(out.read_text())
    runs = saved["runs"]
    assert all(
        k == f"{r['phase']}|{r['method']}|eps{r['epsilon']:g}|s{r['seed']}|lr{r['lr']:g}" for k, r in runs.items()
    )
    assert sorted(trained) == sorted(runs)  # each run trained once, stored once
    assert {r["seed"] for r in runs.values() if r["phase"] == "eval"} == {0, 1}
    assert set(saved["lr_choice"]) == {"la-lora"} and "analysis" in saved
    assert {r["lr"] for r in runs.values() if r["phase"] == "tune"} >= {0.5, 1.0}  # the tuning round, shared
