"""Shared helpers of the federated tests (no tests here): the LA-LoRA configuration both runners are compared on, the
hand-written reference replay, state comparison, the processes a federation left behind, and a user's own model
and data files for the CLI."""

from __future__ import annotations

import json
import os

import torch
from peft_lalora.federated.builders import build_client, build_evaluator, build_partition, build_task
from peft_lalora.federated.config import FederationConfig
from peft_lalora.federated.server.aggregate import fedavg

# LA-LoRA (step alternation) with the paper's binomial low-pass filter, DP via calibrated noise.
CFG = dict(
    task="fed_tiny:tiny",
    algo="la-lora",
    filter="binomial5",
    num_clients=2,
    alpha=1.0,
    rounds=2,
    local_steps=2,
    batch_size=8,
    n_train=64,
    n_test=32,
    epsilon=5.0,
    seed=3,
    reproducible_noise=True,
)


def replay(cfg: FederationConfig):
    """Clients and FedAvg called by hand: the reference for both runners."""
    task = build_task(cfg)
    part = build_partition(cfg, task)
    g0 = build_evaluator(cfg, task).initial_state()
    clients = [build_client(cfg, task, part, i) for i in range(cfg.num_clients)]
    g = g0
    for rnd in range(1, cfg.rounds + 1):
        ups = [c.fit(g, rnd) for c in clients]
        g = fedavg([u.state for u in ups], [u.num_examples for u in ups], global_state=g).state
    return g0, g, [c.epsilon() for c in clients]


def assert_states_equal(x, y, atol=0.0):
    assert x.keys() == y.keys()
    for k in x:
        assert torch.allclose(x[k], y[k], rtol=0, atol=atol), f"{k}: max diff {(x[k] - y[k]).abs().max()}"


def marked_processes(marker: str) -> list[int]:
    needle = f"LALORA_FEDERATION_ID={marker}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def user_model_and_data(tmp_path, fmt: str):
    """A tiny BERT saved with its own WordPiece tokenizer, and a labelled text file (string labels)."""
    from text_support import tiny_bert
    from transformers import BertTokenizerFast

    words = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "the", "was"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    model_dir = tmp_path / "model"
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(model_dir)
    tiny_bert(num_labels=2, seed=0).save_pretrained(model_dir)
    rows = []
    for i in range(60):
        pos = i % 2 == 0
        adj = ["good", "great", "fine"][i % 3] if pos else ["bad", "awful", "poor"][i % 3]
        rows.append({"review": f"the movie was {adj}", "sentiment": "pos" if pos else "neg", "film": f"f{i % 6}"})
    if fmt == "csv":
        import csv

        path = tmp_path / "reviews.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["review", "sentiment", "film"])
            w.writeheader()
            w.writerows(rows)
    elif fmt == "jsonl":
        path = tmp_path / "reviews.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).train_test_split(test_size=0.25, seed=0).save_to_disk(str(path))
    return model_dir, path
