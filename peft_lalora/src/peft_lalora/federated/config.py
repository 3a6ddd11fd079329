"""One description of a federated experiment: :class:`FederationConfig` (and the :class:`TaskSettings` part of it).

:class:`FederationConfig` is flat (str / int / float / bool), so it doubles as a Flower ``run_config`` and
as the ``peft-lalora federate`` command line (one flag per field, :mod:`peft_lalora.cli`): the in-process
runner and every Flower process rebuild *the same* task, partition, clients and evaluator from it
(:mod:`~peft_lalora.federated.builders`; this module imports none of them). The four algorithms of the LA-LoRA paper
(arXiv 2602.19926) are four values of ``LALoraConfig.alternation`` — not four code paths; :data:`ALGORITHMS` is
the one table between the federated ``algo`` and the alternation mode:

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
import difflib
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .server.ledger import ACCOUNTANTS, check_accountant
from .server.rules import NORM_POLICIES, RULES, trim_problem

__all__ = [
    "ALGORITHMS",
    "ConfigError",
    "DEFAULTS",
    "FILTERS",
    "FederationConfig",
    "PARTITIONS",
    "TaskSettings",
    "clients_per_round",
]

#: ``--algo`` -> ``LALoraConfig.alternation``: the one table between the two names of the LoRA scheme
ALGORITHMS: dict[str, str] = {"dp-lora": "none", "ffa-lora": "freeze_a", "rolora": "round", "la-lora": "step"}
#: ``--filter`` -> opacus_spectral post_hooks
FILTERS: dict[str, list[Any]] = {
    "none": [],
    "binomial5": [("lowpass", {"kernel": "binomial5"})],
    "laplacian": [("lowpass", {"kernel": "laplacian", "laplacian_dims": 2})],
}
PARTITIONS: tuple[str, ...] = ("dirichlet", "iid", "group")
_OPEN, _CLOSED = True, False
#: every float field's range ``(low, low open?, high, high open?)``, NaN and ±∞ always refused; 0 is in a range
#: only where it has a documented meaning (``epsilon`` 0: use noise_multiplier; ``max_update_norm`` 0: the derived
#: bound; ``weight_decay`` and ``trim_fraction`` 0: none)
FLOAT_RANGES: dict[str, tuple[float, bool, float, bool]] = {
    "alpha": (0.0, _OPEN, math.inf, _OPEN),
    "fraction": (0.0, _OPEN, 1.0, _CLOSED),
    "server_lr": (0.0, _OPEN, math.inf, _OPEN),
    "max_update_norm": (0.0, _CLOSED, math.inf, _OPEN),
    "trim_fraction": (0.0, _CLOSED, 0.5, _OPEN),
    "lr": (0.0, _OPEN, math.inf, _OPEN),
    "b_lr_ratio": (0.0, _OPEN, math.inf, _OPEN),
    "weight_decay": (0.0, _CLOSED, math.inf, _OPEN),
    "max_grad_norm": (0.0, _OPEN, math.inf, _OPEN),
    "epsilon": (0.0, _CLOSED, math.inf, _OPEN),
    "noise_multiplier": (0.0, _OPEN, math.inf, _OPEN),
    "delta": (0.0, _OPEN, 1.0, _OPEN),
}
#: every int field's least value (``n_train``/``n_test``/``seq_len``/``num_labels``: ``TaskSettings``, 0 = default)
INT_MINIMA: dict[str, int] = {
    "num_clients": 1,
    "rounds": 1,
    "local_steps": 1,
    "batch_size": 1,
    "min_clients": 1,
    "rank": 1,
    "lora_alpha": 1,
    "min_partition_size": 1,
    "seed": 0,
}


class ConfigError(ValueError):
    """A :class:`FederationConfig` number out of its range: ``field``, ``value`` and the ``rule`` (the CLI names the
    flag)."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        super().__init__(f"{field} must be {rule}, got {value!r}")
        self.field, self.value, self.rule = field, value, rule


def range_rule(low: float, low_open: bool, high: float, high_open: bool) -> str:
    """``"finite and > 0"``, ``"in (0, 1]"``, ... for a :data:`FLOAT_RANGES` entry."""
    if math.isinf(high):
        return f"finite and {'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_numbers(cfg: Any) -> None:
    """:class:`ConfigError` for the first field of ``cfg`` outside :data:`FLOAT_RANGES` / :data:`INT_MINIMA`."""
    for name, (low, low_open, high, high_open) in FLOAT_RANGES.items():
        v = getattr(cfg, name)
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        if not (ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)):
            raise ConfigError(name, v, range_rule(low, low_open, high, high_open))
    for name, least in INT_MINIMA.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < least:
            raise ConfigError(name, v, f"an integer >= {least}")


@dataclass(frozen=True)
class TaskSettings:
    """What a task is built from (:func:`~peft_lalora.federated.data.task.build_task`, a task factory's argument): the
    data, the base model and the seed — the task part of a :class:`FederationConfig`
    (:meth:`FederationConfig.task_settings`), validated here. Field meanings: the ``FederationConfig`` fields of the
    same name."""

    task: str = "text"
    model: str = ""
    data: str = ""
    test_data: str = ""
    test_fraction: float = 0.2
    text_column: str = "text"
    label_column: str = "label"
    group_column: str = ""
    n_train: int = 0
    n_test: int = 0
    seq_len: int = 0
    num_labels: int = 0
    task_options: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task != "text" and ":" not in self.task:
            raise ValueError(f"task must be 'text' or 'package.module:factory', got {self.task!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        for name in ("n_train", "n_test", "seq_len", "num_labels"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.task_option_dict()  # valid JSON object

    def task_option_dict(self) -> dict[str, Any]:
        """``task_options`` parsed (a JSON object; empty string = ``{}``)."""
        if not self.task_options:
            return {}
        try:
            opts = json.loads(self.task_options)
        except json.JSONDecodeError as err:
            raise ValueError(f"task_options must be a JSON object, got {self.task_options!r}: {err}") from None
        if not isinstance(opts, dict):
            raise ValueError(f"task_options must be a JSON object, got {self.task_options!r}")
        return opts

    def key(self) -> dict[str, Any]:
        """The settings as a dict: a built task is reused only for runs with the same key (``Task.key``)."""
        return dataclasses.asdict(self)


def _opt(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its default, the help text of its CLI flag and optional ``choices``."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class FederationConfig:
    """Everything that defines a run; flat so that it maps 1:1 to a Flower ``run_config`` and to CLI flags.

    Privacy: ``epsilon > 0`` calibrates each client's σ so that a client sampled in *every* round ends at
    ``(epsilon, delta)`` after ``rounds × local_steps`` steps; ``epsilon = 0`` uses ``noise_multiplier``. Every number
    is checked (:func:`check_numbers`: NaN, ±∞ and out-of-range values are :class:`ConfigError`); ``delta`` must also
    be below 1/N for every partition's N records, checked once the sizes are known
    (:func:`~peft_lalora.federated.server.ledger.check_delta`).

    ``reproducible_noise`` (default ``False``): seed each client's DP noise, Poisson sampling and dropout from
    ``(seed, client, round)`` instead of fresh OS entropy — so that runners can be compared bit for bit.
    ``seed`` is part of this (server-written) configuration, so such noise is **not private against whoever
    knows the seed**: experiments only. The result JSON records it (:func:`noise_record`).
    """

    # -- task (see peft_lalora.federated.data.task)
    task: str = _opt("text", "'text' (your model + data) or 'package.module:factory' returning a Task")
    model: str = _opt("", "task=text: model folder (or hub id) for AutoModelForSequenceClassification")
    data: str = _opt("", "task=text: CSV / JSON Lines file or datasets.save_to_disk folder")
    test_data: str = _opt("", "task=text: test file/folder (default: a stratified test_fraction of data)")
    test_fraction: float = _opt(0.2, "task=text: test share of data when there is no test_data")
    text_column: str = _opt("text", "task=text: the text column")
    label_column: str = _opt("label", "task=text: the label column (strings are encoded in sorted order)")
    group_column: str = _opt("", "column for partition=group (e.g. an author or a product)")
    n_train: int = _opt(0, "seeded subsample of the training split (0 = all)")
    n_test: int = _opt(0, "seeded subsample of the test split (0 = all)")
    seq_len: int = _opt(0, "tokens per example (0 = the task's default)")
    num_labels: int = _opt(0, "number of classes (0 = from the data)")
    task_options: str = _opt("", 'JSON options for a task factory (e.g. {"frozen_layers": 5})')
    # -- federation
    algo: str = _opt(
        "la-lora",
        "LoRA scheme: " + ", ".join(f"{k} (alternation={v})" for k, v in ALGORITHMS.items()),
        choices=tuple(ALGORITHMS),
    )
    filter: str = _opt("none", "post-noise low-pass filter", choices=tuple(FILTERS))
    first_factor: str = _opt("B", "factor trained first: B (paper) or A (reference code)", choices=("B", "A"))
    num_clients: int = _opt(8, "number of clients (partitions)")
    partition: str = _opt("dirichlet", "client split", choices=PARTITIONS)
    alpha: float = _opt(0.1, "Dirichlet label-skew concentration (partition=dirichlet), > 0")
    min_partition_size: int = _opt(4, "Dirichlet: minimum examples per client (>= 1)")
    partition_sizes: str = _opt(
        "",
        "the operator's plan: examples per partition, comma-separated (the Flower server "
        "uses it and never reads data; empty: computed from the shared source)",
    )
    partition_nodes: str = _opt(
        "",
        "the operator's plan: SuperNode ids in partition order, comma-separated (empty: "
        "the i-th smallest connected node id trains partition i)",
    )
    rounds: int = _opt(3, "federated rounds")
    local_steps: int = _opt(5, "DP-SGD steps per client and round")
    fraction: float = _opt(1.0, "fraction of clients sampled per round")
    min_clients: int = _opt(1, "fewest valid updates a round aggregates")
    server_lr: float = _opt(1.0, "server learning rate (1 = plain FedAvg)")
    weighted: bool = _opt(True, "weight FedAvg by the examples the server assigned (else uniform)")
    max_update_norm: float = _opt(
        0.0,
        "server-side bound on ||client state - global state|| (0 = the derived bound "
        "of an honest client, see auto_update_norm)",
    )
    auto_update_norm: bool = _opt(
        True,
        "with max_update_norm=0, bound updates by the longest one an honest client "
        "of this run can send (lr, local_steps, optimizer; docs/federated.md); "
        "--no-auto-update-norm: no bound at all (NOT robust, warns)",
    )
    update_norm_policy: str = _opt(
        "clip", "clip or reject updates longer than max_update_norm", choices=("clip", "reject")
    )
    aggregation: str = _opt(
        "mean",
        "mean (weighted FedAvg) or trimmed_mean (Flower's coordinate-wise, unweighted)",
        choices=("mean", "trimmed_mean"),
    )
    trim_fraction: float = _opt(0.1, "trimmed_mean: share of clients cut at each end per coordinate")
    # -- client
    batch_size: int = _opt(16, "expected Poisson batch size")
    lr: float = _opt(5e-3, "client learning rate")
    optimizer: str = _opt("adamw", "client optimizer", choices=("adamw", "sgd"))
    b_lr_ratio: float = _opt(1.0, "B's learning rate / A's (reference code: 2)")
    weight_decay: float = _opt(0.0, "weight decay")
    max_grad_norm: float = _opt(1.0, "per-example clipping bound C")
    epsilon: float = _opt(1.0, "target epsilon per client (0: use noise_multiplier)")
    noise_multiplier: float = _opt(1.0, "noise multiplier (noise std / max_grad_norm) when epsilon = 0; > 0")
    delta: float = _opt(
        1e-5, "delta of every epsilon; below 1/N for each client's N records (usual: well below, e.g. 1/N^1.1)"
    )
    accountant: str = _opt(
        "rdp",
        "Opacus accountant, an upper bound on epsilon ('gdp', an approximation, is refused)",
        choices=ACCOUNTANTS,
    )
    rank: int = _opt(4, "LoRA rank")
    lora_alpha: int = _opt(8, "LoRA alpha")
    target_modules: str = _opt("query,value", "comma-separated LoRA target modules")
    seed: int = _opt(0, "seed of splits, partition, sampling and adapter init (>= 0)")
    release_nonprivate_stats: bool = _opt(
        False, "NOT private: clients also send their noise-free mean training loss, and the result records it"
    )
    publish_label_counts: bool = _opt(
        False, "NOT private: the result lists every client's label counts (and groups) from the shared source"
    )
    reproducible_noise: bool = _opt(
        False,
        "seed DP noise and Poisson sampling from (seed, client, round): experiments only, NOT private against "
        "whoever knows the seed",
    )

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"unknown algo {self.algo!r}; expected one of {sorted(ALGORITHMS)}")
        if self.filter not in FILTERS:
            raise ValueError(f"unknown filter {self.filter!r}; expected one of {sorted(FILTERS)}")
        self.task_settings()  # the task part, validated by TaskSettings
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.partition == "group" and self.task == "text" and not self.group_column:
            raise ValueError("partition='group' needs group_column (the column to split by)")
        check_numbers(self)
        check_accountant(self.accountant)
        if self.min_clients > self.num_clients:
            raise ValueError(f"min_clients={self.min_clients} > num_clients={self.num_clients}")
        if self.update_norm_policy not in NORM_POLICIES:
            raise ValueError(f"update_norm_policy must be one of {NORM_POLICIES}, got {self.update_norm_policy!r}")
        if self.aggregation not in RULES:
            raise ValueError(f"aggregation must be one of {RULES}, got {self.aggregation!r}")
        if self.aggregation == "trimmed_mean":
            problem = trim_problem(self.trim_fraction, clients_per_round(self))
            if problem is not None:
                raise ValueError(
                    f"{clients_per_round(self)} of num_clients={self.num_clients} are sampled per round: {problem}"
                )
        self.planned_sizes()  # valid plan
        self.planned_nodes()

    def planned_nodes(self) -> list[int] | None:
        """``partition_nodes`` parsed (``None`` when empty): ``num_clients`` distinct SuperNode ids."""
        nodes = _int_list(self.partition_nodes, "partition_nodes", self.num_clients)
        if nodes is not None and len(set(nodes)) != len(nodes):
            raise ValueError(f"partition_nodes must be distinct node ids, got {self.partition_nodes!r}")
        return nodes

    def planned_sizes(self) -> list[int] | None:
        """``partition_sizes`` parsed (``None`` when empty): one integer >= 1 per client."""
        sizes = _int_list(self.partition_sizes, "partition_sizes", self.num_clients)
        if sizes is not None and min(sizes) < 1:
            raise ValueError(f"partition_sizes must be >= 1, got {self.partition_sizes!r}")
        return sizes

    @property
    def alternation(self) -> str:
        """The ``LALoraConfig.alternation`` of ``algo`` (:data:`ALGORITHMS`)."""
        return ALGORITHMS[self.algo]

    def task_settings(self) -> TaskSettings:
        """The fields that define the task's data and base model: what
        :func:`~peft_lalora.federated.data.task.build_task` and a task factory read (every :class:`TaskSettings` field
        named here; ``tests`` pin that none is left out)."""
        return TaskSettings(
            task=self.task,
            model=self.model,
            data=self.data,
            test_data=self.test_data,
            test_fraction=self.test_fraction,
            text_column=self.text_column,
            label_column=self.label_column,
            group_column=self.group_column,
            n_train=self.n_train,
            n_test=self.n_test,
            seq_len=self.seq_len,
            num_labels=self.num_labels,
            task_options=self.task_options,
            seed=self.seed,
        )

    def task_option_dict(self) -> dict[str, Any]:
        """``task_options`` parsed (a JSON object; empty string = ``{}``)."""
        return self.task_settings().task_option_dict()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def task_key(self) -> dict[str, Any]:
        """The task part of the run as a dict (:meth:`TaskSettings.key`): a built task's ``key``."""
        return self.task_settings().key()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, extra_keys: Sequence[str] = ()) -> FederationConfig:
        """Build from a (Flower run_config-like) mapping: '-' == '_', values cast to the field's type.

        An unknown key is an error (a typo such as ``noise-multiplyer`` would otherwise silently fall back to
        the default); ``extra_keys`` are keys the caller handles itself (e.g. the Flower app's ``result-path``).
        """
        extra = {k.replace("-", "_") for k in extra_keys}
        unknown = sorted(k for k in d if k.replace("-", "_") not in DEFAULTS and k.replace("-", "_") not in extra)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k.replace("-", "_"), list(DEFAULTS), n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""))
            raise ValueError(f"unknown federation config key(s): {', '.join(hints)}")
        kw: dict[str, Any] = {}
        for k, v in d.items():
            name = k.replace("-", "_")
            if name not in DEFAULTS:
                continue
            typ = type(DEFAULTS[name])
            if typ is bool and isinstance(v, str):
                if v.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"{k}: expected a boolean, got {v!r}")
                v = v.lower() in ("true", "1")
            elif typ in (int, float, str) and not isinstance(v, typ):
                v = typ(v)
            kw[name] = v
        return cls(**kw)


def _int_list(value: str, name: str, n: int) -> list[int] | None:
    """A comma-separated list of ``n`` integers (``None`` when ``value`` is empty)."""
    if not value.strip():
        return None
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {value!r}") from None
    if len(out) != n:
        raise ValueError(f"{name} needs {n} integers (one per client), got {value!r}")
    return out


#: default value of every FederationConfig field
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(FederationConfig)}


def clients_per_round(cfg: FederationConfig) -> int:
    """How many clients a round samples: ``max(min_clients, round(fraction·N))``, at most N."""
    return min(cfg.num_clients, max(cfg.min_clients, int(round(cfg.fraction * cfg.num_clients))))
