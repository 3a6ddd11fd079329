"""What a client sends the server after a round — one definition for both runners, and an allowlist.

A reply holds the client's noisy adapter state (the DP release) and these metrics:

* ``partition-id`` — the partition the server assigned (an echo; the server attributes by sender anyway);
* ``dp-noise-multiplier`` / ``dp-q`` / ``dp-steps`` — the client's accountant history ``[(σ, q, steps)]``, which the
  server can check against what it charged (σ and q follow from the plan's sizes, the steps from its own
  count; :func:`~peft_lalora.federated.ledger.report_problem`).

Nothing else derived from the private data leaves the client: not the example count (the plan fixes it), not
the ε (the server recomputes it), and not the training loss, which is noise-free and at q = 1 an exact function
of the data — unless the operator opts in with ``release_nonprivate_stats=True`` (``train-loss``, NOT private).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .client import ClientUpdate
    from .config import FederationConfig

__all__ = ["NONPRIVATE_METRICS", "REPLY_METRICS", "history_of", "number", "numbers", "reply_metrics"]

#: the metrics a reply may carry by default
REPLY_METRICS = frozenset({"partition-id", "dp-noise-multiplier", "dp-q", "dp-steps"})
#: noise-free statistics, sent only with ``release_nonprivate_stats=True``
NONPRIVATE_METRICS = frozenset({"train-loss"})


def reply_metrics(update: ClientUpdate, cfg: FederationConfig) -> dict[str, Any]:
    """The metrics of ``update``'s reply: the allowlist, plus ``train-loss`` only when released."""
    hist = update.history
    out: dict[str, Any] = {
        "partition-id": int(update.client),
        "dp-noise-multiplier": [float(h[0]) for h in hist],
        "dp-q": [float(h[1]) for h in hist],
        "dp-steps": [int(h[2]) for h in hist],
    }
    if cfg.release_nonprivate_stats:
        out["train-loss"] = float(update.loss)
    return out


def number(record: Mapping[str, Any], key: str) -> float:
    """``record[key]`` as a number; ``TypeError`` naming the key otherwise (replies are remote input)."""
    v = record[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{key!r}: expected a number, got {type(v).__name__}")
    return v


def numbers(record: Mapping[str, Any], key: str) -> list[float]:
    """``record[key]`` as a list of numbers (``TypeError`` otherwise)."""
    v = record[key]
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise TypeError(f"{key!r}: expected a list of numbers, got {v!r}")
    return [float(x) for x in v]


def history_of(record: Mapping[str, Any]) -> list[tuple[float, float, float]]:
    """The accountant history ``[(σ, q, steps)]`` stored as three parallel lists in ``record``; the values are
    left as sent (the ledger bounds them before any accountant sees them)."""
    multipliers, q, steps = numbers(record, "dp-noise-multiplier"), numbers(record, "dp-q"), numbers(record, "dp-steps")
    return list(zip(multipliers, q, steps, strict=True))
