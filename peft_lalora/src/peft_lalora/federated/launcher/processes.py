"""Process bookkeeping for a local federation: process groups and the marker variable that finds every
process of one federation (Flower's SuperLink starts its SuperExec in a new session, outside any group)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

__all__ = ["MARKER", "free_port", "group_kwargs", "marked_pids"]

MARKER = "LALORA_FEDERATION_ID"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_kwargs(pgid: int | None) -> dict[str, Any]:
    """Popen kwargs that put the child in process group ``pgid`` (0: a new group led by the child)."""
    if pgid is None:
        return {}
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # pragma: no cover - Python 3.10


def marked_pids(marker_value: str) -> list[int]:
    """PIDs of live processes whose environment carries ``MARKER=marker_value`` (Linux /proc)."""
    needle = f"{MARKER}={marker_value}".encode()
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state == b"Z":  # zombie: already dead, waiting to be reaped
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry))
    return sorted(out)
