"""What a federation trains on: a :class:`Task` — train/test data and a deterministic base model.

:func:`build_task` makes it from the :class:`~peft_lalora.federated.config.TaskSettings` of a run
(``FederationConfig.task_settings()``; a ``FederationConfig`` is accepted and reduced to them):

* ``task="text"`` (default): the user's sequence classifier and data. ``model`` is a local folder (or hub id)
  that ``transformers.AutoModelForSequenceClassification`` and ``AutoTokenizer`` load; ``data`` is a CSV or
  JSON Lines file, or a folder written by ``datasets.save_to_disk`` (a ``DatasetDict`` with ``train``/``test``
  splits uses them). ``text_column`` and ``label_column`` name the columns (string labels are encoded in sorted
  order), ``group_column`` optionally the column for ``partition="group"``. The test split is ``test_data`` or,
  without it, a seeded stratified ``test_fraction`` of ``data``. Texts are tokenized to ``seq_len`` tokens.
  Both splits load on first use; built with ``server=True`` (the Flower server) the task never reads ``data``:
  the model needs ``num_labels`` (the plan fills it in) or ``test_data``, the operator's evaluation file.
* ``task="package.module:factory"``: ``factory(settings) -> Task`` (``settings``: the ``TaskSettings``), for
  experiment tasks (the ``dp-bench`` harness provides ``dp_bench.task:tiny`` and ``dp_bench.task:minilm_rt``).
  The factory must be importable in every process that runs the federation (each Flower SuperNode rebuilds the
  task from the configuration); its ``train`` should be a loader (see :class:`Task`) so that the Flower server,
  which builds the task for its model, loads no client data.

Every process must build the *same* task from the same configuration: splits and subsamples are seeded by
``settings.seed`` and the base model's freshly initialized head by the factory's seed, without touching the
caller's RNG.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import TaskSettings
from .inputs import InputError, check_loaded, column_roles, load_table, model_folder_problem, scan_table
from .truncation import cut_texts

__all__ = ["Task", "TaskSettings", "build_task", "load_table", "subsample", "text_task", "to_tensor_dataset"]

DEFAULT_SEQ_LEN = 64


@dataclass
class Task:
    """A classification task: train/test ``datasets.Dataset`` and a base-model factory.

    Attributes:
        name: for reports.
        train, test: datasets with the tensor ``columns`` (``label`` last) and, for ``partition="group"``, the
            ``group_column``; partitioners read ``train``'s ``label``. Either may be given as a zero-argument
            loader, called on first access only: the Flower server builds the task but never touches ``train``
            (the clients' data), and evaluates on ``test`` only when it is the operator's own data.
        num_labels: number of classes.
        columns: the tensor columns handed to the model, ``"label"`` last.
        model_factory: builds a fresh base model (called inside a forked RNG; must be deterministic).
        group_column: the column ``partition="group"`` splits by, if any.
        key: the settings the task was built from (``TaskSettings.key()``), so a built
            task is only reused for runs that would build the same one.
        test_from_train: ``test`` is carved from the clients' data source (loading it reads that source), so a
            server that holds no client data does not evaluate on it.
    """

    name: str
    train: Any = field(repr=False)
    test: Any = field(repr=False)
    num_labels: int
    columns: tuple[str, ...]
    model_factory: Callable[[], nn.Module]
    group_column: str | None = None
    key: dict[str, Any] = field(default_factory=dict)
    test_from_train: bool = False

    def __post_init__(self) -> None:
        loaders = {}
        for split in ("train", "test"):
            value = self.__dict__[split]
            if callable(value) and not hasattr(value, "__getitem__"):  # a loader, not a dataset
                loaders[split] = self.__dict__.pop(split)
        self.__dict__["_loaders"] = loaders

    def __getattr__(self, name: str) -> Any:  # only reached for a split that is not loaded yet
        loaders = self.__dict__.get("_loaders", {})
        if name in ("train", "test") and name in loaders:
            value = loaders.pop(name)()
            self.__dict__[name] = value
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def loaded(self, split: str) -> bool:
        """Whether ``split`` has been loaded (or was given as data)."""
        return split in self.__dict__

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


def _read(path: str | Path, cfg: TaskSettings) -> Any:
    """:func:`~peft_lalora.federated.data.inputs.load_table` after checking the file record by record
    (:func:`~peft_lalora.federated.data.inputs.scan_table`)."""
    scan_table(path, column_roles(cfg.text_column, cfg.label_column, cfg.group_column))
    return load_table(path)


def _prepare(ds: Any, cfg: TaskSettings, names: list[str] | None, where: str) -> tuple[Any, list[str] | None]:
    """Rename the text/label columns, encode string labels (with ``names`` if given), keep what is needed."""
    import datasets

    roles = column_roles(cfg.text_column, cfg.label_column, cfg.group_column)
    for role, col in roles.items():
        if col not in ds.column_names:
            raise InputError(f"{where}: column {col!r} (--{role}-column) not in the data (columns: {ds.column_names})")
    check_loaded(ds, where, roles)
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
            raise InputError(
                f"{where}: labels {unknown[:5]} in column {cfg.label_column!r} do not occur in the "
                f"training data's labels {names}"
            )
        features = ds.features.copy()
        features["label"] = datasets.ClassLabel(names=names)
        return ds.map(lambda b: {"label": [index[x] for x in b["label"]]}, batched=True, features=features), names
    return ds, names


class _TextSource:
    """The text task's splits, each loaded on first use: the clients' ``data`` and the operator's ``test_data``."""

    def __init__(self, cfg: TaskSettings, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.names: list[str] | None = None
        self._train: Any = None
        self._held_out: Any = None  # the test split carved from (or saved with) ``data``
        self._done: dict[str, Any] = {}  # tokenized splits

    def _tokenize(self, ds: Any) -> Any:
        seq_len = self.cfg.seq_len or DEFAULT_SEQ_LEN

        def tokenize(batch: dict[str, list[Any]]) -> Any:
            texts = cut_texts(batch["text"], self.tokenizer, seq_len)  # same tokens; a huge cell is not tokenized whole
            return self.tokenizer(texts, truncation=True, padding="max_length", max_length=seq_len)

        return ds.map(tokenize, batched=True, remove_columns=["text"])

    def _load_data(self) -> None:
        import datasets

        cfg = self.cfg
        raw = _read(cfg.data, cfg)
        if isinstance(raw, datasets.DatasetDict):
            if "train" not in raw:
                raise ValueError(f"{cfg.data}: a saved DatasetDict needs a 'train' split (has {list(raw)})")
            train, held = raw["train"], raw.get("test")
        else:
            train, held = raw, None
        split = " [train]" if held is not None else ""
        train, self.names = _prepare(train, cfg, None, f"{cfg.data}{split}")
        if cfg.test_data:
            held = None
        elif held is not None:
            held, self.names = _prepare(held, cfg, self.names, f"{cfg.data} [test]")
        else:
            stratify = "label" if isinstance(train.features["label"], datasets.ClassLabel) else None
            parts = train.train_test_split(test_size=cfg.test_fraction, seed=cfg.seed, stratify_by_column=stratify)
            train, held = parts["train"], parts["test"]
        self._train, self._held_out = subsample(train, cfg.n_train, cfg.seed), held

    def train(self) -> Any:
        if "train" not in self._done:
            if self._train is None:
                self._load_data()
            self._done["train"] = self._tokenize(self._train)
        return self._done["train"]

    def test(self) -> Any:
        if "test" not in self._done:
            self._done["test"] = self._test()
        return self._done["test"]

    def _test(self) -> Any:
        if not self.cfg.test_data:
            if self._train is None:
                self._load_data()
            return self._tokenize(subsample(self._held_out, self.cfg.n_test, self.cfg.seed + 1))
        test, names = _prepare(_read(self.cfg.test_data, self.cfg), self.cfg, self.names, str(self.cfg.test_data))
        if self.names is None and names is not None and self.cfg.num_labels and len(names) != self.cfg.num_labels:
            raise ValueError(
                f"{self.cfg.test_data}: its labels {names} are not the run's {self.cfg.num_labels} classes; string "
                "labels are encoded in sorted order, so the evaluation file must contain every class"
            )
        return self._tokenize(subsample(test, self.cfg.n_test, self.cfg.seed + 1))

    def num_labels(self, server: bool) -> int:
        """``cfg.num_labels``, else from the data: the server reads only ``test_data`` (never ``data``)."""
        if self.cfg.num_labels:
            return self.cfg.num_labels
        if server:
            if not self.cfg.test_data:
                raise ValueError("the server does not read the clients' data: set num_labels (or test_data)")
            return _count_labels(self.test(), None)
        train, test = self.train(), self.test()
        return _count_labels(train, test, self.names)


def _count_labels(a: Any, b: Any, names: list[str] | None = None) -> int:
    labels = np.asarray(list(a["label"]) + (list(b["label"]) if b is not None else []))
    if labels.size == 0 or labels.min() < 0:
        raise ValueError("labels must be non-negative integers or strings")
    return len(names) if names else int(labels.max()) + 1


def text_task(settings: TaskSettings | Any, *, server: bool = False) -> Task:
    """The user's text-classification task (``task="text"``); see the module docstring. ``server=True``: built
    for a server, which never reads ``data`` (only the model, and ``test_data`` when given)."""
    cfg = settings if isinstance(settings, TaskSettings) else settings.task_settings()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not cfg.model or not (cfg.data or server):
        raise ValueError("task='text' needs model=<model folder or hub id> and data=<CSV/JSONL file or dataset folder>")
    problem = model_folder_problem(cfg.model)
    if problem is not None:
        raise ValueError(f"model={cfg.model!r}: {problem}")
    source = _TextSource(cfg, AutoTokenizer.from_pretrained(cfg.model))
    num_labels = source.num_labels(server)
    known = source.tokenizer.model_input_names
    inputs = tuple(c for c in ("input_ids", "attention_mask", "token_type_ids") if c in known)
    seed = cfg.seed

    def make_model() -> nn.Module:
        torch.manual_seed(seed)  # the fresh head's init: the same in every process
        return AutoModelForSequenceClassification.from_pretrained(cfg.model, num_labels=num_labels)

    return Task(
        name=f"text:{Path(cfg.model).name}",
        train=source.train,
        test=source.test,
        num_labels=num_labels,
        columns=(*inputs, "label"),
        model_factory=make_model,
        group_column=cfg.group_column or None,
        key=cfg.key(),
        test_from_train=not cfg.test_data,
    )


def build_task(settings: TaskSettings | Any, *, server: bool = False) -> Task:
    """The task ``settings.task`` names: ``"text"`` or ``"package.module:factory"`` (see the module docstring).
    ``settings``: :class:`~peft_lalora.federated.config.TaskSettings` (a ``FederationConfig`` is reduced to its
    ``task_settings()``). ``server=True``: for the Flower server, which only builds the model and reads no client
    data."""
    cfg = settings if isinstance(settings, TaskSettings) else settings.task_settings()
    if cfg.task == "text":
        return text_task(cfg, server=server)
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
    task.key = cfg.key()
    return task
