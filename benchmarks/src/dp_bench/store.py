"""A grid's result JSON that several worker processes on one machine fill together.

Start the same ``dp-bench grid ... --resume`` command once per core: each worker claims a run before it trains
it, so no run is trained twice; it merges what the others stored before every write, so no run is lost; and
writes are atomic (a temporary file renamed over the JSON), so a worker killed mid-write leaves the last
complete JSON. A claim whose process is gone (a worker killed between sessions) is void, and its run is
trained again by whoever asks next.

Beside ``<name>.json`` live ``<name>.json.lock`` (an ``fcntl`` lock, held only while the JSON or the claims
change) and, while runs are in flight, ``<name>.json.claims``; neither belongs in version control.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["POLL_SECONDS", "SharedResult", "atomic_write_json"]

#: how often a waiting worker looks at the JSON again (a look reads the file: cheap next to a run)
POLL_SECONDS = 2.0


def atomic_write_json(path: Path, obj: Any, **dumps: Any) -> None:
    """Write ``obj`` as JSON (``json.dumps(obj, default=float, **dumps)``) to ``path`` (its folder made if needed)
    through a temporary file in the same folder and a rename: a reader, or a kill mid-write, never sees half a
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, **{"default": float, **dumps}))
    os.replace(tmp, path)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), which tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # another machine's worker: it cannot be checked from here
    pid = int(holder["pid"])
    if Path("/proc").is_dir():
        return _start_time(pid) is not None and _start_time(pid) == holder.get("start")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedResult:
    """The JSON at ``path`` and the in-memory ``result`` of this worker, kept in step (see the module doc).

    ``result["runs"]`` is a dict from run key (:func:`dp_bench.runner.run_key`) to record. ``dumps``: extra
    ``json.dumps`` options of the file; ``wall``: the record field summed into ``result["wall_seconds"]`` (None: no
    total); ``upgrade``: what brings the JSON on disk to the current format before it is merged (the command's
    report's, e.g. a JSON from before the one key format)."""

    def __init__(
        self,
        path: Path,
        result: dict[str, Any],
        *,
        dumps: dict[str, Any] | None = None,
        wall: str | None = "wall_seconds",
        upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.result = result
        self.dumps = dict(dumps or {})
        self.wall = wall
        self.upgrade = upgrade
        result.setdefault("runs", {})
        result.setdefault("lr_choice", {})
        self._lock = path.with_name(path.name + ".lock")
        self._claims = path.with_name(path.name + ".claims")
        self._me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def runs(self) -> dict[str, dict[str, Any]]:
        """The runs this worker knows to be stored, by key."""
        return self.result["runs"]

    def keys(self) -> set[str]:
        """The keys of the runs this worker knows to be stored."""
        return set(self.runs())

    def _merge(self) -> None:
        """Take in what other workers stored (runs and lr choices this worker does not have yet)."""
        if not self.path.is_file():
            return
        disk = json.loads(self.path.read_text())
        if self.upgrade is not None:
            disk = self.upgrade(disk)
        for key, value in disk.get("runs", {}).items():
            self.result["runs"].setdefault(key, value)
        for key, value in disk.get("lr_choice", {}).items():
            self.result["lr_choice"].setdefault(key, value)

    def _read_claims(self) -> dict[str, Any]:
        claims = json.loads(self._claims.read_text()) if self._claims.is_file() else {}
        return {k: v for k, v in claims.items() if _alive(v)}

    def _write_claims(self, claims: dict[str, Any]) -> None:
        if claims:
            atomic_write_json(self._claims, claims)
        elif self._claims.is_file():
            self._claims.unlink()

    def _write(self) -> None:
        if self.wall is not None:
            self.result["wall_seconds"] = sum(float(r.get(self.wall, 0.0)) for r in self.result["runs"].values())
        atomic_write_json(self.path, self.result, **self.dumps)

    def sync(self) -> None:
        """Merge what the other workers stored since the last look."""
        with self._locked():
            self._merge()

    def claim(self, key: str) -> bool:
        """Reserve the run ``key`` for this worker: False when it is stored or a live worker holds it."""
        with self._locked():
            self._merge()
            if key in self.keys():
                return False
            claims = self._read_claims()
            if key in claims and claims[key] != self._me:
                return False
            claims[key] = self._me
            self._write_claims(claims)
            return True

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Store this worker's finished run and release its claim (the JSON is rewritten, merged)."""
        with self._locked():
            self._merge()
            self.result["runs"][key] = record
            self._write()
            claims = self._read_claims()
            claims.pop(key, None)
            self._write_claims(claims)

    def release(self, key: str) -> None:
        """Give up this worker's claim on ``key`` without storing a run (a worker that stops early)."""
        with self._locked():
            claims = self._read_claims()
            if claims.get(key) == self._me:
                del claims[key]
                self._write_claims(claims)

    def save(self) -> None:
        """Rewrite the JSON with this worker's view merged with what is stored."""
        with self._locked():
            self._merge()
            self._write()

    def in_flight(self) -> set[str]:
        """The runs that live workers (this one included) have claimed and not stored yet."""
        with self._locked():
            return set(self._read_claims())

    def wait_until_idle(self, poll: float = POLL_SECONDS) -> None:
        """Block until no live worker holds a claim, then merge (e.g. before the final analysis)."""
        while self.in_flight():
            time.sleep(poll)
        self.sync()
