"""Split a labelled ``datasets.Dataset`` into disjoint federated clients.

Three schemes, all seeded and reproducible:

* ``"dirichlet"`` — label skew: for every class ``k`` the fractions ``p_k ~ Dir(α·1_N)`` of its examples
  go to the ``N`` clients (Hsu et al. 2019; the LA-LoRA paper uses β = α = 0.1 for vision, 0.8 for
  language). Small α → each client sees few classes; α → ∞ → IID. Backed by
  :class:`flwr_datasets.partitioner.DirichletPartitioner`.
* ``"iid"`` — a seeded shuffle, then equal contiguous shards (:class:`~flwr_datasets.partitioner.IidPartitioner`
  shards without shuffling, so the shuffle is done here first).
* ``"group"`` — by a group column (e.g. the movie of a review): every group lives on exactly one client.
  With ``num_clients=None`` each group is its own client
  (:class:`~flwr_datasets.partitioner.NaturalIdPartitioner`). With a fixed ``num_clients`` the groups are
  packed onto clients here, because ``GroupedNaturalIdPartitioner`` neither yields an exact number of
  partitions nor takes a seed: groups are visited largest first (ties in a seeded random order) and each
  goes to the client with the fewest examples so far (LPT packing).

The partitioners work on a copy of the dataset with a row-index column, so the result is a list of index
arrays into the *original* dataset — easy to check for disjointness and coverage and cheap to ship to
Flower nodes, which rebuild their own partition from the same seed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import datasets

Scheme = Literal["dirichlet", "iid", "group"]
SCHEMES: tuple[str, ...] = ("dirichlet", "iid", "group")
_ROW = "__peft_lalora_row__"


class PartitionError(ValueError):
    """A split these settings cannot make. ``problem`` and ``advice`` name the settings in braces (``{alpha}``):
    :meth:`worded` writes them as keyword names (the message) or as the ``federate`` flags (``--alpha``)."""

    def __init__(self, problem: str, settings: Mapping[str, Any], advice: str) -> None:
        self.problem, self.settings, self.advice = problem, dict(settings), advice
        super().__init__(self.worded())

    def worded(self, flags: bool = False) -> str:
        names = {k: "--" + k.replace("_", "-") if flags else k for k in self.settings}
        shown = {k: format(v, "g") if isinstance(v, float) else str(v) for k, v in self.settings.items()}
        given = ", ".join(f"{names[k]} {shown[k]}" if flags else f"{k}={shown[k]}" for k in self.settings)
        return f"{given}: {self.problem.format(**names)}; {self.advice.format(**names)}"


def _require_flwr_datasets() -> Any:
    try:
        import flwr_datasets.partitioner as partitioner
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "peft_lalora.federated.data.partition needs flwr-datasets; install the extra: "
            "pip install -c constraints.txt './peft_lalora[flower]' (README, Install)"
        ) from err
    return partitioner


@dataclass(frozen=True)
class Partition:
    """Result of a split: per-client row indices into the original dataset and label statistics.

    Attributes:
        indices: one sorted ``int64`` array per client.
        classes: the sorted distinct labels; columns of ``label_histograms``.
        label_histograms: ``[num_clients, num_classes]`` example counts per client and class.
        scheme, seed, params: how it was made (for reports).
        groups: for ``scheme="group"``, the group values held by each client.
    """

    indices: list[np.ndarray]
    classes: list[Any]
    label_histograms: np.ndarray
    scheme: str
    seed: int
    params: dict[str, Any] = field(default_factory=dict)
    groups: list[list[Any]] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> list[int]:
        return [int(len(ix)) for ix in self.indices]

    def client_dataset(self, dataset: datasets.Dataset, client: int) -> datasets.Dataset:
        """Rows of ``dataset`` (the dataset that was split) that belong to ``client``."""
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} out of range for {self.num_clients} clients")
        return dataset.select(self.indices[client].tolist())

    def summary(self) -> dict[str, Any]:
        """JSON-ready description: scheme, params, sizes and per-client label histograms."""
        out: dict[str, Any] = {
            "scheme": self.scheme,
            "seed": self.seed,
            **self.params,
            "num_clients": self.num_clients,
            "sizes": self.sizes,
            "classes": [c.item() if isinstance(c, np.generic) else c for c in self.classes],
            "label_histograms": self.label_histograms.astype(int).tolist(),
        }
        if self.groups is not None:
            out["groups"] = [[g.item() if isinstance(g, np.generic) else g for g in gs] for gs in self.groups]
        return out


def label_histograms(labels: Sequence[Any] | np.ndarray, indices: Sequence[np.ndarray]) -> tuple[list[Any], np.ndarray]:
    """Sorted distinct labels and the ``[clients, classes]`` count matrix of ``labels[indices[i]]``."""
    arr = np.asarray(labels)
    classes, codes = np.unique(arr, return_inverse=True)
    codes = codes.reshape(-1)
    hist = (
        np.stack([np.bincount(codes[ix], minlength=len(classes)) for ix in indices])
        if len(indices)
        else np.zeros((0, len(classes)), dtype=np.int64)
    )
    return classes.tolist(), hist.astype(np.int64)


def label_skew(hist: np.ndarray) -> float:
    """Mean total-variation distance between each client's label distribution and the pooled one.

    0 for perfectly IID clients; approaches ``1 - 1/C``-ish values when each client holds one class.
    Clients without examples are ignored.
    """
    hist = np.asarray(hist, dtype=np.float64)
    rows = hist.sum(axis=1)
    keep = rows > 0
    if not keep.any():
        raise ValueError("label_skew: every client is empty")
    local = hist[keep] / rows[keep, None]
    pooled = hist.sum(axis=0) / hist.sum()
    return float(0.5 * np.abs(local - pooled).sum(axis=1).mean())


def _with_rows(dataset: datasets.Dataset) -> datasets.Dataset:
    if _ROW in dataset.column_names:
        raise ValueError(f"dataset already has a column named {_ROW!r}")
    return dataset.add_column(_ROW, np.arange(dataset.num_rows, dtype=np.int64).tolist())


def _rows(part: datasets.Dataset) -> np.ndarray:
    return np.sort(np.asarray(part[_ROW], dtype=np.int64))


def _check_common(dataset: datasets.Dataset, num_clients: int | None, column: str, what: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(f"{what} column {column!r} not in dataset columns {dataset.column_names}")
    if num_clients is not None:
        if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool) or num_clients < 1:
            raise ValueError(f"num_clients must be a positive int, got {num_clients!r}")
        if num_clients > dataset.num_rows:
            raise PartitionError(
                f"more clients than the {dataset.num_rows} training rows",
                {"num_clients": int(num_clients)},
                "lower {num_clients} (each client needs rows of its own)",
            )


def dirichlet_partition(
    dataset: datasets.Dataset,
    num_clients: int,
    alpha: float,
    *,
    label_column: str = "label",
    seed: int = 0,
    min_partition_size: int = 1,
    self_balancing: bool = False,
) -> Partition:
    """Label-skewed split with per-class client fractions ``~ Dir(α)`` (flwr-datasets ``DirichletPartitioner``).

    ``min_partition_size``: Dirichlet draws are repeated (up to 10 times, then ``ValueError``) until every
    client holds at least this many examples.
    """
    _check_common(dataset, num_clients, label_column, "label")
    if not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    P = _require_flwr_datasets()
    part = P.DirichletPartitioner(
        num_partitions=int(num_clients),
        partition_by=label_column,
        alpha=float(alpha),
        min_partition_size=int(min_partition_size),
        self_balancing=self_balancing,
        shuffle=False,
        seed=int(seed),
    )
    part.dataset = _with_rows(dataset)
    with warnings.catch_warnings():  # flwr-datasets warns at every redraw: one PartitionError says it instead
        warnings.filterwarnings("ignore", message=".*min_partition_size.*", category=UserWarning)
        try:
            indices = [_rows(part.load_partition(i)) for i in range(num_clients)]
        except ValueError as err:
            if "attempts" not in str(err):
                raise
            raise PartitionError(
                f"the Dirichlet split drew no partition in which every one of the {num_clients} clients holds at "
                f"least {min_partition_size} of the {dataset.num_rows} training rows (10 draws)",
                {"num_clients": int(num_clients), "alpha": float(alpha), "min_partition_size": int(min_partition_size)},
                "raise {alpha} (e.g. 0.1 or more: less label skew), lower {num_clients}, or lower {min_partition_size}",
            ) from None
    classes, hist = label_histograms(dataset[label_column], indices)
    return Partition(
        indices, classes, hist, "dirichlet", int(seed), {"alpha": float(alpha), "label_column": label_column}
    )


def iid_partition(
    dataset: datasets.Dataset, num_clients: int, *, label_column: str = "label", seed: int = 0
) -> Partition:
    """Seeded shuffle, then ``num_clients`` near-equal shards (flwr-datasets ``IidPartitioner``)."""
    _check_common(dataset, num_clients, label_column, "label")
    P = _require_flwr_datasets()
    part = P.IidPartitioner(num_partitions=int(num_clients))
    part.dataset = _with_rows(dataset).shuffle(seed=int(seed))
    indices = [_rows(part.load_partition(i)) for i in range(num_clients)]
    classes, hist = label_histograms(dataset[label_column], indices)
    return Partition(indices, classes, hist, "iid", int(seed), {"label_column": label_column})


def group_partition(
    dataset: datasets.Dataset,
    group_column: str,
    num_clients: int | None = None,
    *,
    label_column: str = "label",
    seed: int = 0,
) -> Partition:
    """Every value of ``group_column`` on exactly one client (see module doc for the packing rule)."""
    _check_common(dataset, num_clients, group_column, "group")
    _check_common(dataset, None, label_column, "label")
    values = np.asarray(dataset[group_column])
    uniq, codes, counts = np.unique(values, return_inverse=True, return_counts=True)
    codes = codes.reshape(-1)
    if num_clients is None:
        P = _require_flwr_datasets()
        part = P.NaturalIdPartitioner(partition_by=group_column)
        part.dataset = _with_rows(dataset)
        n = part.num_partitions
        indices = [_rows(part.load_partition(i)) for i in range(n)]
        groups = [[part.partition_id_to_natural_id[i]] for i in range(n)]
    else:
        if num_clients > len(uniq):
            raise PartitionError(
                f"more clients than the {len(uniq)} distinct values of the group column {group_column!r}",
                {"num_clients": int(num_clients)},
                "lower {num_clients} (every group lives on one client), or split by another column",
            )
        rng = np.random.default_rng(int(seed))
        tie = rng.permutation(len(uniq))
        order = np.lexsort((tie, -counts))  # largest group first, seeded tie order
        load = np.zeros(num_clients, dtype=np.int64)
        owner = np.empty(len(uniq), dtype=np.int64)
        for g in order:  # LPT packing: O(G·N) on group counts only, not on rows
            c = int(np.argmin(load))
            owner[g] = c
            load[c] += counts[g]
        row_owner = owner[codes]
        indices = [np.flatnonzero(row_owner == c).astype(np.int64) for c in range(num_clients)]
        groups = [sorted(uniq[owner == c].tolist()) for c in range(num_clients)]
    classes, hist = label_histograms(dataset[label_column], indices)
    return Partition(
        indices, classes, hist, "group", int(seed), {"group_column": group_column, "label_column": label_column}, groups
    )


def partition_dataset(
    dataset: datasets.Dataset,
    num_clients: int | None,
    *,
    scheme: Scheme = "dirichlet",
    alpha: float | None = None,
    label_column: str = "label",
    group_column: str | None = None,
    seed: int = 0,
    min_partition_size: int = 1,
) -> Partition:
    """Dispatch to :func:`dirichlet_partition`, :func:`iid_partition` or :func:`group_partition`."""
    if scheme == "dirichlet":
        if alpha is None or num_clients is None:
            raise ValueError("scheme='dirichlet' needs alpha and num_clients")
        return dirichlet_partition(
            dataset, num_clients, alpha, label_column=label_column, seed=seed, min_partition_size=min_partition_size
        )
    if scheme == "iid":
        if num_clients is None:
            raise ValueError("scheme='iid' needs num_clients")
        return iid_partition(dataset, num_clients, label_column=label_column, seed=seed)
    if scheme == "group":
        if group_column is None:
            raise ValueError("scheme='group' needs group_column")
        return group_partition(dataset, group_column, num_clients, label_column=label_column, seed=seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; expected one of {SCHEMES}")
