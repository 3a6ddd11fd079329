"""One description of a federated experiment, and the builders both runners share.

:class:`FederationConfig` is flat (str / int / float / bool), so it doubles as a Flower ``run_config``:
the in-process runner and every Flower process rebuild *the same* task, partition, clients and
evaluator from it. The four algorithms of the LA-LoRA paper are four values of
``LALoraConfig.alternation`` — not four code paths:

=============  ===============  ===================================================
``algo``       ``alternation``  method
=============  ===============  ===================================================
``dp-lora``    ``none``         both factors every step
``ffa-lora``   ``freeze_a``     A frozen at init, B trains
``rolora``     ``round``        one factor per round
``la-lora``    ``step``         B and A alternate every local step (paper)
=============  ===============  ===================================================

``filter`` selects the post-noise low-pass denoiser (pure post-processing, no privacy cost):
``binomial5`` is the paper's 5-tap ``[1,4,6,4,1]/16`` kernel, ``laplacian`` the reference code's
Laplacian smoothing ``(I − σΔ)⁻¹``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "ALGORITHMS",
    "FILTERS",
    "FederationConfig",
    "PARTITIONS",
    "TASKS",
    "Task",
    "aggregate_updates",
    "build_client",
    "build_evaluator",
    "build_partition",
    "build_task",
    "make_peft_config",
    "make_peft_model",
    "noise_record",
    "sample_clients",
    "to_tensor_dataset",
]

#: ``--algo`` -> ``LALoraConfig.alternation``
ALGORITHMS: dict[str, str] = {"dp-lora": "none", "ffa-lora": "freeze_a", "rolora": "round", "la-lora": "step"}
#: ``--filter`` -> opacus_spectral post_hooks
FILTERS: dict[str, list[Any]] = {
    "none": [],
    "binomial5": [("lowpass", {"kernel": "binomial5"})],
    "laplacian": [("lowpass", {"kernel": "laplacian", "laplacian_dims": 2})],
}
#: ``tiny``: random tiny BERT on generated data (smoke runs); ``minilm-rt``: all-MiniLM-L6-v2 on Rotten
#: Tomatoes reviews (packaged, offline; see :mod:`peft_lalora.data`), grouped by ``movie_name`` if asked.
TASKS: tuple[str, ...] = ("tiny", "minilm-rt")
PARTITIONS: tuple[str, ...] = ("dirichlet", "iid", "group")
_DEFAULT_SEQ_LEN = {"tiny": 16, "minilm-rt": 64}
_GROUP_COLUMN = {"minilm-rt": "movie_name"}


@dataclass
class FederationConfig:
    """Everything that defines a run; flat so that it maps 1:1 to a Flower ``run_config``.

    Privacy: ``epsilon > 0`` calibrates each client's σ so that a client sampled in *every* round ends
    at ``(epsilon, delta)`` after ``rounds × local_steps`` steps; ``epsilon <= 0`` uses
    ``noise_multiplier`` as given.

    ``reproducible_noise`` (default ``False``): seed each client's DP noise, Poisson sampling and dropout
    from ``(seed, client, round)`` instead of fresh OS entropy — so that runners can be compared bit for
    bit. ``seed`` is part of this (server-written) configuration, so such noise is **not private against
    whoever knows the seed**: experiments only. The result JSON records it (:func:`noise_record`).
    """

    task: str = "tiny"
    algo: str = "la-lora"
    filter: str = "none"
    first_factor: str = "B"
    num_clients: int = 8
    partition: str = "dirichlet"  #: "dirichlet", "iid" or "group" (minilm-rt: by movie)
    alpha: float = 0.1
    min_partition_size: int = 4
    rounds: int = 3
    local_steps: int = 5
    fraction: float = 1.0  #: fraction of clients sampled per round
    min_clients: int = 1
    server_lr: float = 1.0
    weighted: bool = True  #: weight FedAvg by the examples the server assigned (else uniform)
    #: server-side bound on ‖client state − global state‖₂ (0 = none); see :func:`~.aggregate.fedavg`
    max_update_norm: float = 0.0
    update_norm_policy: str = "clip"  #: "clip" or "reject" updates longer than max_update_norm
    aggregation: str = "mean"  #: "mean" (weighted FedAvg) or "trimmed_mean" (coordinate-wise, Flower's)
    trim_fraction: float = 0.1  #: share trimmed at each end per coordinate (aggregation="trimmed_mean")
    batch_size: int = 16
    lr: float = 5e-3
    optimizer: str = "adamw"
    b_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epsilon: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    rank: int = 4
    lora_alpha: int = 8
    target_modules: str = "query,value"
    seed: int = 0
    reproducible_noise: bool = False  #: noise seeded from public seeds — experiments only, not private
    # data sizes: tiny = generated examples; minilm-rt = seeded subsample of the split (0 = all of it)
    n_train: int = 512
    n_test: int = 256
    seq_len: int = 0  #: tokens per example; 0 = task default (tiny 16, minilm-rt 64)
    num_labels: int = 2  #: tiny only (Rotten Tomatoes has 2)
    #: bottom encoder layers frozen (no adapter) and computed once per example (0 = train the full model);
    #: LoRA then sits in the top layers only (see :mod:`peft_lalora.data.frozen`)
    frozen_layers: int = 0
    #: sentence representation fed to the head: "cls" (BertForSequenceClassification's pooler on [CLS]) or
    #: "mean" (attention-masked mean of the last hidden states, as sentence-transformers; needs frozen_layers)
    pooling: str = "cls"

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"unknown algo {self.algo!r}; expected one of {sorted(ALGORITHMS)}")
        if self.filter not in FILTERS:
            raise ValueError(f"unknown filter {self.filter!r}; expected one of {sorted(FILTERS)}")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; expected one of {TASKS}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.partition == "group" and self.task not in _GROUP_COLUMN:
            raise ValueError(f"task {self.task!r} has no group column for partition='group'")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        for name in ("num_clients", "rounds", "local_steps", "batch_size", "min_clients", "rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.frozen_layers) < 0:
            raise ValueError(f"frozen_layers must be >= 0, got {self.frozen_layers}")
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {self.pooling!r}")
        if self.pooling == "mean" and int(self.frozen_layers) < 1:
            raise ValueError(
                "pooling='mean' is implemented by the frozen-bottom model only: set frozen_layers >= 1 "
                "(BertForSequenceClassification itself pools with [CLS])"
            )
        if self.min_clients > self.num_clients:
            raise ValueError(f"min_clients={self.min_clients} > num_clients={self.num_clients}")
        if not self.max_update_norm >= 0:
            raise ValueError(f"max_update_norm must be >= 0 (0 = no bound), got {self.max_update_norm}")
        from .aggregate import NORM_POLICIES, RULES

        if self.update_norm_policy not in NORM_POLICIES:
            raise ValueError(f"update_norm_policy must be one of {NORM_POLICIES}, got {self.update_norm_policy!r}")
        if self.aggregation not in RULES:
            raise ValueError(f"aggregation must be one of {RULES}, got {self.aggregation!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")

    @property
    def alternation(self) -> str:
        return ALGORITHMS[self.algo]

    @property
    def tokens(self) -> int:
        """Sequence length actually used (``seq_len`` or the task's default)."""
        return self.seq_len if self.seq_len > 0 else _DEFAULT_SEQ_LEN[self.task]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def task_key(self) -> dict[str, Any]:
        """The fields that define the task's data and base model (what :func:`build_task` reads)."""
        keys = ("task", "seed", "n_train", "n_test", "seq_len", "num_labels", "frozen_layers", "pooling")
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, extra_keys: Sequence[str] = ()) -> FederationConfig:
        """Build from a (Flower run_config-like) mapping: '-' == '_', values cast to the field's type.

        An unknown key is an error (a typo such as ``noise-multiplyer`` would otherwise silently fall back to
        the default); ``extra_keys`` are keys the caller handles itself (e.g. the Flower app's ``result-path``).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra = {k.replace("-", "_") for k in extra_keys}
        unknown = sorted(k for k in d if k.replace("-", "_") not in fields and k.replace("-", "_") not in extra)
        if unknown:
            import difflib

            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k.replace("-", "_"), list(fields), n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""))
            raise ValueError(f"unknown federation config key(s): {', '.join(hints)}")
        kw: dict[str, Any] = {}
        for k, v in d.items():
            name = k.replace("-", "_")
            if name not in fields:
                continue
            typ = type(fields[name].default)
            if typ is bool and isinstance(v, str):
                if v.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"{k}: expected a boolean, got {v!r}")
                v = v.lower() in ("true", "1")
            elif typ in (int, float, str) and not isinstance(v, typ):
                v = typ(v)
            kw[name] = v
        return cls(**kw)

    def client_config(self) -> Any:
        from .client import ClientConfig

        calibrate = self.epsilon > 0
        return ClientConfig(
            local_steps=self.local_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            optimizer=self.optimizer,
            weight_decay=self.weight_decay,
            b_lr_ratio=self.b_lr_ratio,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=None if calibrate else self.noise_multiplier,
            target_epsilon=self.epsilon if calibrate else None,
            planned_steps=self.rounds * self.local_steps if calibrate else None,
            delta=self.delta,
            accountant=self.accountant,
            reproducible_noise=self.reproducible_noise,
            post_hooks=[tuple(h) if isinstance(h, list) else h for h in FILTERS[self.filter]],
        )


@dataclass
class Task:
    """A classification task: a deterministic base-model factory plus train/test ``datasets.Dataset``."""

    name: str
    train: Any
    test: Any
    num_labels: int
    columns: tuple[str, ...]
    model_seed: int
    config: FederationConfig
    group_column: str | None = None
    #: with ``config.frozen_layers = k > 0``: hidden states after layer ``k - 1`` of every train/test row
    #: (``{"train": tensor, "test": tensor}``); the model is then :class:`~peft_lalora.data.frozen.BertTop`
    hidden: dict[str, torch.Tensor] | None = None

    @property
    def input_names(self) -> tuple[str, ...]:
        """Keyword names of the model inputs, in the order of :meth:`tensors` (the label comes last)."""
        return tuple(c for c in self.columns if c != "label")

    def full_model(self) -> torch.nn.Module:
        """A fresh full base model in train mode; identical weights on every call (clients, server and
        evaluator must agree), without touching the caller's RNG state."""
        with torch.random.fork_rng(devices=[]):
            if self.name == "tiny":
                from ..data import tiny_bert

                return tiny_bert(num_labels=self.num_labels, seed=self.model_seed)
            if self.name == "minilm-rt":
                from ..data import load_minilm

                model, _ = load_minilm(num_labels=self.num_labels, seed=self.model_seed)
                return model.train()
        raise ValueError(f"unknown task {self.name!r}")  # pragma: no cover

    def model(self) -> torch.nn.Module:
        """The model the adapter is put on: the full model, or its top (``BertTop``) when layers are frozen."""
        model = self.full_model()
        k = int(self.config.frozen_layers)
        if k > 0:
            from ..data.frozen import BertTop

            return BertTop(model, k, pooling=self.config.pooling).train()
        return model

    def tensors(self, split: str, indices: Sequence[int] | np.ndarray | None = None) -> torch.utils.data.TensorDataset:
        """``TensorDataset`` of the model inputs (:attr:`input_names`) and the label for ``split``
        (``"train"`` / ``"test"``), restricted to ``indices`` (rows of that split) if given."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        ds = self.train if split == "train" else self.test
        if self.hidden is None:
            if indices is not None:
                ds = ds.select([int(i) for i in indices])
            return to_tensor_dataset(ds, self.columns)
        plain = ds.with_format(None)
        cols = {"inputs_embeds": self.hidden[split]}
        for c in ("attention_mask", "label"):
            cols[c] = torch.as_tensor(np.asarray(plain[c]))
        if indices is not None:
            ix = torch.as_tensor(np.asarray(indices, dtype=np.int64))
            cols = {c: t[ix] for c, t in cols.items()}
        return torch.utils.data.TensorDataset(*[cols[c] for c in self.columns])


def to_tensor_dataset(dataset: Any, columns: Sequence[str]) -> torch.utils.data.TensorDataset:
    """A ``TensorDataset`` of ``columns`` (label last) — plain tensor tuples batch and Poisson-sample
    robustly (Opacus builds empty batches from the shapes of ``dataset[0]``)."""
    plain = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset
    return torch.utils.data.TensorDataset(*[torch.as_tensor(np.asarray(plain[c])) for c in columns])


def _subsample(dataset: Any, n: int, seed: int) -> Any:
    """A seeded subsample of ``n`` rows (all rows when ``n <= 0`` or ``n >= len``), in original order."""
    if n <= 0 or n >= dataset.num_rows:
        return dataset
    keep = np.sort(np.random.default_rng(seed).choice(dataset.num_rows, size=n, replace=False))
    return dataset.select(keep.tolist())


def build_task(cfg: FederationConfig, *, progress: bool = False) -> Task:
    """The task named by ``cfg.task``: ``"tiny"`` (tiny random BERT on generated trigger-token data) or
    ``"minilm-rt"`` (all-MiniLM-L6-v2 on Rotten Tomatoes, packaged copies, no network).

    With ``cfg.frozen_layers = k > 0`` the hidden states after layer ``k - 1`` of every train and test
    example are computed here, once (``progress``: a tqdm bar), and the task's inputs become
    ``(inputs_embeds, attention_mask)``."""
    task = _build_raw_task(cfg)
    k = int(cfg.frozen_layers)
    if k <= 0:
        return task
    from ..data.frozen import encode_bottom

    full = task.full_model()
    hidden = {}
    for split in ("train", "test"):
        t = task.tensors(split)
        cols = dict(zip(task.columns, t.tensors, strict=True))
        hidden[split] = encode_bottom(
            full, k, cols["input_ids"], cols["attention_mask"], cols.get("token_type_ids"), progress=progress
        )
    task.hidden = hidden
    task.columns = ("inputs_embeds", "attention_mask", "label")
    return task


def _build_raw_task(cfg: FederationConfig) -> Task:
    cols: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids", "label")
    if cfg.task == "tiny":
        from ..data import synthetic_text_task

        n_lab = cfg.num_labels
        train = synthetic_text_task(cfg.n_train, seq_len=cfg.tokens, seed=cfg.seed, num_labels=n_lab)
        test = synthetic_text_task(cfg.n_test, seq_len=cfg.tokens, seed=cfg.seed + 10_007, num_labels=n_lab)
        return Task("tiny", train, test, n_lab, cols, model_seed=cfg.seed, config=cfg)
    if cfg.task == "minilm-rt":
        from transformers import AutoTokenizer

        from ..data import load_rotten_tomatoes, minilm_path, tokenize

        splits = load_rotten_tomatoes("packaged", seed=cfg.seed)
        tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
        train = tokenize(_subsample(splits["train"], cfg.n_train, cfg.seed), tokenizer, max_length=cfg.tokens)
        test = tokenize(_subsample(splits["test"], cfg.n_test, cfg.seed + 1), tokenizer, max_length=cfg.tokens)
        cols = tuple(c for c in cols if c in train.column_names)
        return Task("minilm-rt", train, test, 2, cols, model_seed=cfg.seed, config=cfg, group_column="movie_name")
    raise ValueError(f"unknown task {cfg.task!r}")


def make_peft_config(cfg: FederationConfig) -> Any:
    """The ``LALoraConfig`` of the run (alternation from ``cfg.algo``; classifier head trainable)."""
    from ..config import LALoraConfig

    return LALoraConfig(
        task_type="SEQ_CLS",
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=[m.strip() for m in cfg.target_modules.split(",") if m.strip()],
        alternation=cfg.alternation,
        first_factor=cfg.first_factor,
    )


def make_peft_model(cfg: FederationConfig, task: Task) -> Any:
    """Base model + LALoRA adapter, with the adapter's random init (LoRA A, head) seeded by ``cfg.seed``:
    the initial global adapter must not depend on the process's RNG state (server vs. simulation)."""
    from peft import get_peft_model

    base = task.model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        return get_peft_model(base, make_peft_config(cfg))


def build_partition(cfg: FederationConfig, task: Task) -> Any:
    """Split ``task.train`` over ``cfg.num_clients`` clients as ``cfg.partition`` says."""
    from .partition import dirichlet_partition, group_partition, iid_partition

    if cfg.partition == "iid":
        return iid_partition(task.train, cfg.num_clients, seed=cfg.seed)
    if cfg.partition == "group":
        if task.group_column is None:
            raise ValueError(f"task {task.name!r} has no group column")
        return group_partition(task.train.with_format(None), task.group_column, cfg.num_clients, seed=cfg.seed)
    return dirichlet_partition(
        task.train, cfg.num_clients, cfg.alpha, seed=cfg.seed, min_partition_size=cfg.min_partition_size
    )


def build_client(cfg: FederationConfig, task: Task, partition: Any, client_id: int) -> Any:
    """The :class:`~peft_lalora.federated.client.DPClient` for partition ``client_id``."""
    from .client import DPClient, NamedInputsLoss

    data = task.tensors("train", partition.indices[client_id])
    return DPClient(
        client_id,
        make_peft_model(cfg, task),
        None,
        data,
        cfg.client_config(),
        seed=cfg.seed,
        loss_fn=NamedInputsLoss(task.input_names),
    )


def build_evaluator(cfg: FederationConfig, task: Task) -> Any:
    """Server-side evaluator; its freshly built adapter is the initial global state."""
    from .client import Evaluator

    return Evaluator(make_peft_model(cfg, task), None, task.tensors("test"), input_names=task.input_names)


def noise_record(cfg: FederationConfig) -> dict[str, Any]:
    """What the result JSON says about where the DP noise came from (``"noise"`` key)."""
    from .client import REPRODUCIBLE_NOISE_NOTE

    if cfg.reproducible_noise:
        return {
            "reproducible": True,
            "source": "seeded from (seed, client, round) — public: seed is in the run config",
            "note": REPRODUCIBLE_NOISE_NOTE,
        }
    return {
        "reproducible": False,
        "source": "fresh OS entropy per client and round (secrets), never stored or sent",
        "note": "not reproducible run to run; rounds are refused if replayed",
    }


def sample_clients(cfg: FederationConfig, round_index: int) -> list[int]:
    """Sorted ids of the clients sampled in ``round_index``: ``max(min_clients, round(fraction·N))`` drawn
    without replacement from a generator seeded by ``(seed, round)``."""
    n = cfg.num_clients
    m = max(cfg.min_clients, int(round(cfg.fraction * n)))
    m = min(m, n)
    if m == n:
        return list(range(n))
    rng = np.random.default_rng([cfg.seed, round_index, 0x5A])
    return sorted(int(i) for i in rng.choice(n, size=m, replace=False))


def aggregate_updates(
    cfg: FederationConfig,
    global_state: Mapping[str, torch.Tensor],
    states: Sequence[Mapping[str, torch.Tensor]],
    num_examples: Sequence[int],
    client_ids: Sequence[int],
) -> Any:
    """FedAvg of the round's updates in client-id order (same float sums in every runner).

    ``num_examples`` must be the sizes the *server* assigned (``partition.sizes``), never client reports."""
    from .aggregate import fedavg

    order = sorted(range(len(client_ids)), key=lambda i: client_ids[i])
    return fedavg(
        [states[i] for i in order],
        [float(num_examples[i]) for i in order] if cfg.weighted else None,
        server_lr=cfg.server_lr,
        global_state=global_state,
        min_clients=cfg.min_clients,
        client_ids=[client_ids[i] for i in order],
        max_update_norm=cfg.max_update_norm or None,
        update_norm_policy=cfg.update_norm_policy,
        rule=cfg.aggregation,
        trim_fraction=cfg.trim_fraction,
    )
