"""The operator's federation plan: how many examples each partition holds — all the server needs of the data.

The server weights FedAvg by partition size and charges each client's privacy ledger with the (σ, q) those sizes
give (:func:`~peft_lalora.federated.client.dp_client.privacy_parameters`). Sizes are a statistic of private data, so
they are the *operator's* configuration (``FederationConfig.partition_sizes``), not something the server computes
from rows: in a real deployment the operator writes them down (what each node agreed to contribute); in the
local runners they are computed once from the shared source by the operator's own process
(:func:`planned_config`). The Flower ServerApp then never loads a training row, and each node checks that
its data has the planned size before it trains (:func:`check_local_size`).

What the server learns: the sizes (and hence σ, q and the FedAvg weights), the noisy updates and the
accountant histories. Per-client label counts and groups go into a result only with
``publish_label_counts=True`` (not private; :func:`partition_summary`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig
    from ..data.partition import Partition
    from ..data.task import Task

__all__ = ["FederationPlan", "check_local_size", "partition_summary", "planned_config"]


@dataclass(frozen=True)
class FederationPlan:
    """Examples per partition ``0..N-1``, as the operator fixed them."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(n, bool) or int(n) != n or n < 1 for n in self.sizes):
            raise ValueError(f"partition sizes must be integers >= 1, got {list(self.sizes)}")

    @classmethod
    def from_config(cls, cfg: FederationConfig) -> FederationPlan:
        """The plan in ``cfg.partition_sizes``; ``ValueError`` (saying how to supply it) when there is none."""
        sizes = cfg.planned_sizes()
        if sizes is None:
            raise ValueError(
                "no federation plan: set partition_sizes (examples per partition, e.g. '120,80'); the Flower "
                "server weights and accounts with the operator's plan and never reads the clients' data "
                "(run_flower / --runner flower computes it from a shared source)"
            )
        return cls(tuple(sizes))

    @classmethod
    def from_partition(cls, partition: Partition) -> FederationPlan:
        return cls(tuple(int(n) for n in partition.sizes))


def planned_config(cfg: FederationConfig, task: Task) -> tuple[FederationConfig, Partition]:
    """``cfg`` with the plan of the shared source filled in (``partition_sizes`` and, for a text task, the
    ``num_labels`` the server's model needs), and the partition — computed in the operator's process."""
    from ..builders import build_partition

    partition = build_partition(cfg, task)
    sizes = ",".join(str(n) for n in FederationPlan.from_partition(partition).sizes)
    if cfg.partition_sizes and cfg.partition_sizes.replace(" ", "") != sizes:
        raise ValueError(f"partition_sizes={cfg.partition_sizes!r} but the shared source splits into {sizes}")
    return dataclasses.replace(cfg, partition_sizes=sizes, num_labels=cfg.num_labels or task.num_labels), partition


def check_local_size(cfg: FederationConfig, partition_id: int, n: int) -> None:
    """A node refuses to train when its data does not have the planned size (the server would weight and
    account it wrongly). The message names the plan only, not the node's own count (it goes to the server)."""
    sizes = cfg.planned_sizes()
    if sizes is not None and sizes[partition_id] != n:
        raise ValueError(
            f"this node's data does not have the {sizes[partition_id]} examples the plan (partition_sizes) gives "
            f"partition {partition_id}; fix the plan or the node's data"
        )


def partition_summary(
    cfg: FederationConfig,
    plan: FederationPlan,
    partition: Partition | None = None,
) -> dict[str, Any]:
    """What a result says about the split: scheme and planned sizes; label counts, classes and groups only
    with ``cfg.publish_label_counts`` (and a partition the operator computed)."""
    out: dict[str, Any] = {"scheme": cfg.partition, "num_clients": cfg.num_clients, "sizes": list(plan.sizes)}
    if cfg.publish_label_counts and partition is not None:
        full = partition.summary()
        out.update({k: full[k] for k in ("classes", "label_histograms", "groups") if k in full})
        out["note"] = "label counts published on request (publish_label_counts): not private"
    return out
