"""What a federation trains on: a :class:`Task` — train/test data and a deterministic base model.

:func:`build_task` makes it from a :class:`~peft_lalora.federated.federation.FederationConfig`:

* ``task="text"`` (default): the user's sequence classifier and data. ``model`` is a local folder (or hub id)
  that ``transformers.AutoModelForSequenceClassification`` and ``AutoTokenizer`` load; ``data`` is a CSV or
  JSON Lines file, or a folder written by ``datasets.save_to_disk`` (a ``DatasetDict`` with ``train``/``test``
  splits uses them). ``text_column`` and ``label_column`` name the columns (string labels are encoded in sorted
  order), ``group_column`` optionally the column for ``partition="group"``. The test split is ``test_data`` or,
  without it, a seeded stratified ``test_fraction`` of ``data``. Texts are tokenized to ``seq_len`` tokens.
* ``task="package.module:factory"``: ``factory(cfg) -> Task``, for experiment tasks (the ``dp-bench`` harness
  provides ``dp_bench.task:tiny`` and ``dp_bench.task:minilm_rt``). The factory must be importable in every
  process that runs the federation (each Flower SuperNode rebuilds the task from the configuration).

Every process must build the *same* task from the same configuration: splits and subsamples are seeded by
``cfg.seed`` and the base model's freshly initialized head by the factory's seed, without touching the
caller's RNG.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from .federation import FederationConfig

__all__ = ["Task", "build_task", "load_table", "subsample", "text_task", "to_tensor_dataset"]

DEFAULT_SEQ_LEN = 64


@dataclass
class Task:
    """A classification task: train/test ``datasets.Dataset`` and a base-model factory.

    Attributes:
        name: for reports.
        train, test: datasets with the tensor ``columns`` (``label`` last) and, for ``partition="group"``, the
            ``group_column``; partitioners read ``train``'s ``label``.
        num_labels: number of classes.
        columns: the tensor columns handed to the model, ``"label"`` last.
        model_factory: builds a fresh base model (called inside a forked RNG; must be deterministic).
        group_column: the column ``partition="group"`` splits by, if any.
        key: the configuration fields the task was built from (``FederationConfig.task_key()``), so a built
            task is only reused for runs that would build the same one.
    """

    name: str
    train: Any
    test: Any
    num_labels: int
    columns: tuple[str, ...]
    model_factory: Callable[[], nn.Module]
    group_column: str | None = None
    key: dict[str, Any] = field(default_factory=dict)

    @property
    def input_names(self) -> tuple[str, ...]:
        """Keyword names of the model inputs, in the order of :meth:`tensors` (the label comes last)."""
        return tuple(c for c in self.columns if c != "label")

    def model(self) -> nn.Module:
        """A fresh base model in train mode, identical on every call, without touching the caller's RNG."""
        with torch.random.fork_rng(devices=[]):
            return self.model_factory().train()

    def tensors(self, split: str, indices: Sequence[int] | np.ndarray | None = None) -> torch.utils.data.TensorDataset:
        """``TensorDataset`` of :attr:`columns` for ``split`` (``"train"`` / ``"test"``), restricted to ``indices``."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        ds = self.train if split == "train" else self.test
        if indices is not None:
            ds = ds.select([int(i) for i in indices])
        return to_tensor_dataset(ds, self.columns)


def to_tensor_dataset(dataset: Any, columns: Sequence[str]) -> torch.utils.data.TensorDataset:
    """A ``TensorDataset`` of ``columns`` (label last) — plain tensor tuples batch and Poisson-sample
    robustly (Opacus builds empty batches from the shapes of ``dataset[0]``)."""
    plain = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset
    return torch.utils.data.TensorDataset(*[torch.as_tensor(np.asarray(plain[c])) for c in columns])


def subsample(dataset: Any, n: int, seed: int) -> Any:
    """A seeded subsample of ``n`` rows (all rows when ``n <= 0`` or ``n >= len``), in original order."""
    if n <= 0 or n >= dataset.num_rows:
        return dataset
    keep = np.sort(np.random.default_rng(seed).choice(dataset.num_rows, size=n, replace=False))
    return dataset.select(keep.tolist())


def load_table(path: str | Path) -> Any:
    """A ``datasets.Dataset`` (or ``DatasetDict``) from a CSV / JSON Lines file or a ``save_to_disk`` folder."""
    import datasets

    p = Path(path)
    if p.is_dir():
        return datasets.load_from_disk(str(p))
    if not p.is_file():
        raise FileNotFoundError(f"no data file or saved dataset folder at {p}")
    kinds = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}
    kind = kinds.get(p.suffix.lower())
    if kind is None:
        raise ValueError(f"{p}: expected .csv, .tsv, .json or .jsonl, or a folder written by datasets.save_to_disk")
    extra = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
    return datasets.load_dataset(kind, data_files=str(p), split="train", **extra)


def _prepare(ds: Any, cfg: FederationConfig, names: list[str] | None) -> tuple[Any, list[str] | None]:
    """Rename the text/label columns, encode string labels (with ``names`` if given), keep what is needed."""
    import datasets

    for col in (cfg.text_column, cfg.label_column, cfg.group_column):
        if col and col not in ds.column_names:
            raise ValueError(f"column {col!r} not in the data (columns: {ds.column_names})")
    keep = [cfg.text_column, cfg.label_column] + ([cfg.group_column] if cfg.group_column else [])
    ds = ds.select_columns(keep).rename_columns({cfg.text_column: "text", cfg.label_column: "label"})
    feature = ds.features["label"]
    if isinstance(feature, datasets.ClassLabel):
        return ds, names or list(feature.names)
    if feature.dtype in ("string", "large_string"):
        names = names or sorted(set(ds["label"]))
        index = {name: i for i, name in enumerate(names)}
        unknown = sorted(set(ds["label"]) - set(index))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} do not occur in the training data's labels {names}")
        features = ds.features.copy()
        features["label"] = datasets.ClassLabel(names=names)
        return ds.map(lambda b: {"label": [index[x] for x in b["label"]]}, batched=True, features=features), names
    return ds, names


def text_task(cfg: FederationConfig) -> Task:
    """The user's text-classification task (``task="text"``); see the module docstring."""
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not cfg.model or not cfg.data:
        raise ValueError("task='text' needs model=<model folder or hub id> and data=<CSV/JSONL file or dataset folder>")
    raw = load_table(cfg.data)
    if isinstance(raw, datasets.DatasetDict):
        if "train" not in raw:
            raise ValueError(f"{cfg.data}: a saved DatasetDict needs a 'train' split (has {list(raw)})")
        train, test = raw["train"], raw.get("test")
    else:
        train, test = raw, None
    if cfg.test_data:
        test = load_table(cfg.test_data)
    train, names = _prepare(train, cfg, None)
    if test is not None:
        test, names = _prepare(test, cfg, names)
    else:
        stratify = "label" if isinstance(train.features["label"], datasets.ClassLabel) else None
        parts = train.train_test_split(test_size=cfg.test_fraction, seed=cfg.seed, stratify_by_column=stratify)
        train, test = parts["train"], parts["test"]
    train, test = subsample(train, cfg.n_train, cfg.seed), subsample(test, cfg.n_test, cfg.seed + 1)
    labels = np.asarray(list(train["label"]) + list(test["label"]))
    if labels.size == 0 or labels.min() < 0:
        raise ValueError("labels must be non-negative integers or strings")
    num_labels = cfg.num_labels or (len(names) if names else int(labels.max()) + 1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    seq_len = cfg.seq_len or DEFAULT_SEQ_LEN

    def tokenize(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["text"], truncation=True, padding="max_length", max_length=seq_len)

    train = train.map(tokenize, batched=True, remove_columns=["text"])
    test = test.map(tokenize, batched=True, remove_columns=["text"])
    inputs = tuple(c for c in ("input_ids", "attention_mask", "token_type_ids") if c in train.column_names)
    seed = cfg.seed

    def make_model() -> nn.Module:
        torch.manual_seed(seed)  # the fresh head's init: the same in every process
        return AutoModelForSequenceClassification.from_pretrained(cfg.model, num_labels=num_labels)

    return Task(
        name=f"text:{Path(cfg.model).name}",
        train=train,
        test=test,
        num_labels=num_labels,
        columns=(*inputs, "label"),
        model_factory=make_model,
        group_column=cfg.group_column or None,
        key=cfg.task_key(),
    )


def build_task(cfg: FederationConfig) -> Task:
    """The task ``cfg.task`` names: ``"text"`` or ``"package.module:factory"`` (see the module docstring)."""
    if cfg.task == "text":
        return text_task(cfg)
    module, _, attr = cfg.task.partition(":")
    if not module or not attr:
        raise ValueError(f"task must be 'text' or 'package.module:factory', got {cfg.task!r}")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load task factory {cfg.task!r}: {err}") from err
    task = factory(cfg)
    if not isinstance(task, Task):
        raise TypeError(f"task factory {cfg.task!r} returned {type(task).__name__}, not a peft_lalora Task")
    task.key = cfg.task_key()
    return task
