"""What a client sends the server after a round — one definition for both runners, and an allowlist.

A reply holds the client's noisy adapter state (the DP release) and these metrics:

* ``partition-id`` — the partition the server assigned (an echo; the server attributes by sender anyway);
* ``dp-noise-multiplier`` / ``dp-q`` / ``dp-steps`` — the client's accountant history ``[(σ, q, steps)]``, which the
  server can check against what it charged (σ and q follow from the plan's sizes, the steps from its own
  count; :func:`~peft_lalora.federated.server.ledger.report_problem`).

Nothing else derived from the private data leaves the client: not the example count (the plan fixes it), not
the ε (the server recomputes it), and not the training loss, which is noise-free and at q = 1 an exact function
of the data — unless the operator opts in with ``release_nonprivate_stats=True`` (``train-loss``, NOT private).

The server parses a reply's arrays with :func:`state_from_arrays`: every ``.npy`` header is read and checked
against the global adapter's keys, shapes and dtypes, and the byte count against what they need, *before* any
array is allocated; anything else is :class:`MalformedReply` (that reply only is rejected).

A failed round reaches the server as one of :data:`CLIENT_FAILURES` (an error reply whose reason is the category);
the node keeps the detail — exception text, file paths, cell values — in its own log. The server records any
other reason as :data:`UNKNOWN_FAILURE`, never the text (:func:`failure_category`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..client.dp_client import ClientUpdate
    from ..config import FederationConfig

__all__ = [
    "CLIENT_FAILURES",
    "MalformedReply",
    "NONPRIVATE_METRICS",
    "REPLY_METRICS",
    "UNKNOWN_FAILURE",
    "failure_category",
    "history_of",
    "number",
    "numbers",
    "reply_metrics",
    "state_from_arrays",
]

#: the metrics a reply may carry by default
REPLY_METRICS = frozenset({"partition-id", "dp-noise-multiplier", "dp-q", "dp-steps"})
#: noise-free statistics, sent only with ``release_nonprivate_stats=True``
NONPRIVATE_METRICS = frozenset({"train-loss"})
#: why a round failed on a node, as the node tells the server (the error reply's whole reason)
CLIENT_FAILURES = ("data_error", "client_setup_error", "assignment_refused", "replayed_round", "training_error")
#: what the server records for an error reply whose reason is not one of :data:`CLIENT_FAILURES`
UNKNOWN_FAILURE = "client_error"
#: the longest ``.npy`` header read (numpy's own ``np.load`` limit)
MAX_HEADER_BYTES = 10_000
_MAGIC = b"\x93NUMPY"


class MalformedReply(ValueError):
    """A reply's arrays do not parse as the global adapter's keys, shapes and dtypes."""


def failure_category(reason: Any) -> str:
    """The category an error reply's ``reason`` names, or :data:`UNKNOWN_FAILURE`: the text itself is never kept."""
    return reason if isinstance(reason, str) and reason in CLIENT_FAILURES else UNKNOWN_FAILURE


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
        raise TypeError(f"{key!r}: expected a list of numbers, got a {type(v).__name__}")
    return [float(x) for x in v]


def history_of(record: Mapping[str, Any]) -> list[tuple[float, float, float]]:
    """The accountant history ``[(σ, q, steps)]`` stored as three parallel lists in ``record``; the values are
    left as sent (the ledger bounds them before any accountant sees them)."""
    multipliers, q, steps = numbers(record, "dp-noise-multiplier"), numbers(record, "dp-q"), numbers(record, "dp-steps")
    return list(zip(multipliers, q, steps, strict=True))


def _npy_header(key: str, data: Any) -> tuple[dict[str, Any], int]:
    """The header dict of ``.npy`` bytes and where the array data starts; :class:`MalformedReply` otherwise.
    Reads at most :data:`MAX_HEADER_BYTES` of literals (``ast.literal_eval``): nothing is allocated for the array."""
    import ast

    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:6]) != _MAGIC or len(data) < 10:
        raise MalformedReply(f"{key!r}: not an .npy array (no NUMPY magic; zip, pickle and empty data are refused)")
    major, width = data[6], 2 if data[6] == 1 else 4
    if major not in (1, 2, 3) or len(data) < 8 + width:
        raise MalformedReply(f"{key!r}: unsupported .npy header (version {major})")
    size, start = int.from_bytes(bytes(data[8 : 8 + width]), "little"), 8 + width
    if size > MAX_HEADER_BYTES or len(data) < start + size:
        raise MalformedReply(f"{key!r}: .npy header of {size} bytes (at most {MAX_HEADER_BYTES}, and within the data)")
    try:
        header = ast.literal_eval(bytes(data[start : start + size]).decode("latin1" if major < 3 else "utf8"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        raise MalformedReply(f"{key!r}: unreadable .npy header") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise MalformedReply(f"{key!r}: the .npy header must hold exactly descr, fortran_order and shape")
    return header, start + size


def _array(key: str, arr: Any, ref: Any) -> Any:
    """One reply array as a fresh tensor of ``ref``'s shape and dtype, checked before it is allocated."""
    import numpy as np
    import torch

    if getattr(arr, "stype", None) != "numpy.ndarray":
        raise MalformedReply(f"{key!r}: serialization {getattr(arr, 'stype', None)!r}, expected 'numpy.ndarray'")
    header, offset = _npy_header(key, arr.data)
    want = torch.empty((), dtype=ref.dtype).numpy().dtype
    descr, shape, fortran = header["descr"], header["shape"], header["fortran_order"]
    try:
        same = isinstance(descr, str) and len(descr) <= 16 and np.dtype(descr) == want
    except TypeError:
        same = False
    if not same:
        raise MalformedReply(f"{key!r}: dtype {str(descr)[:16]!r}, expected {want.str!r}")
    if not isinstance(shape, tuple) or tuple(shape) != tuple(ref.shape) or not isinstance(fortran, bool):
        raise MalformedReply(f"{key!r}: shape {str(shape)[:40]}, expected {tuple(ref.shape)}")
    count = int(ref.numel())
    if len(arr.data) - offset != count * want.itemsize:
        raise MalformedReply(f"{key!r}: {len(arr.data) - offset} data bytes, expected {count * want.itemsize}")
    flat = np.frombuffer(arr.data, dtype=want, count=count, offset=offset)
    return torch.from_numpy(flat.reshape(shape, order="F" if fortran else "C").copy(order="C"))


def state_from_arrays(arrays: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """A reply's ``ArrayRecord`` as a state dict with exactly ``expected``'s keys, shapes and dtypes (the global
    adapter). Every header and byte count is checked before its array is allocated (a client that claims 4e12
    floats, sends zip, pickled or empty bytes is refused); :class:`MalformedReply` names the first problem."""
    missing = [k for k in expected if k not in arrays]
    extra = sum(1 for k in arrays if k not in expected)
    if missing or extra:
        shown = f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else ""
        raise MalformedReply("; ".join(x for x in (shown, f"{extra} unexpected key(s)" if extra else "") if x))
    return {k: _array(k, arrays[k], ref) for k, ref in expected.items()}
