"""One-command local Flower federation on loopback: SuperLink + N SuperNodes, TLS + SuperNode
authentication by default, always torn down.

:func:`~peft_lalora.federated.launcher.run.run_flower` writes a Flower app (a ``pyproject.toml`` naming the components
:mod:`~peft_lalora.federated.flower.server_app` and :mod:`~peft_lalora.federated.flower.client_app`:
:mod:`~peft_lalora.federated.flower.app_config`) with the run's
configuration into a private work folder (:mod:`~peft_lalora.federated.launcher.workdir`: ``0700``, removed at the end
unless kept) and, by default (secure),

* generates into ``<workdir>/credentials/`` a throw-away CA and a SuperLink certificate for
  ``127.0.0.1``/``localhost`` (:mod:`~peft_lalora.federated.launcher.certificates`; or uses the user's
  :class:`TLSConfig`) and one P-384 key pair per SuperNode (:mod:`~peft_lalora.federated.launcher.node_keys`); private
  keys are written with mode 0600;
* starts ``flower-superlink --ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key
  --enable-supernode-auth --disable-runtime-dependency-installation --host 127.0.0.1 --port <port>``
  (no ``uv sync``, which would fetch a CUDA torch; no Ray — this is the deployment engine);
* registers every SuperNode's public key with ``flwr supernode register <key.pub> lalora-local``
  **before** that node starts (an unregistered node's activation is refused and it exits), then starts
  N ``flower-supernode --root-certificates ca.pem --auth-supernode-private-key <key> --superlink
  127.0.0.1:<port> --node-config 'num-partitions=N'`` (the ServerApp assigns each node its partition), each
  with its own runtime-API port on 127.0.0.1;

and ``flwr run <app> lalora-local --stream`` against a connection in a private ``$FLWR_HOME/config.toml``
(``address = "127.0.0.1:<port>"``, ``root-certificates = "<ca.pem>"``). ``insecure=True`` instead runs
everything with ``--insecure`` (plain HTTP, no node authentication; ``insecure = true`` in the
connection) and warns: for local testing only. See ``docs/deployment.md``.

All processes run in **one new process group** (not our shell's) and are torn down in a ``finally``.
Flower's SuperLink starts its SuperExec in a *new session* (``start_new_session=True``), which escapes the
process group, so every process of the federation also carries a marker environment variable
(``LALORA_FEDERATION_ID``); teardown signals the group *and* every process that carries the marker
(found through ``/proc``), then verifies that none is left (:meth:`LocalFederation.leftovers`).
Telemetry and update checks are off (``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .certificates import TLSConfig, generate_tls
from .node_keys import NodeKeys, generate_node_keys
from .processes import MARKER, free_port, group_kwargs, marked_pids
from .workdir import new_workdir, private_dir

__all__ = ["CONNECTION", "INSECURE_WARNING", "LocalFederation"]

CONNECTION = "lalora-local"
INSECURE_WARNING = (
    "insecure=True: the federation's traffic (adapters, updates, run configuration) is unencrypted and "
    "its SuperNodes are unauthenticated (any process that reaches the port can join); for local testing only"
)


class LocalFederation:
    """A SuperLink and ``num_supernodes`` SuperNodes on 127.0.0.1 (use as a context manager).

    Args:
        num_supernodes: one per partition (the ServerApp assigns partitions 0..N-1 to the nodes it sees).
        workdir: where ``flwr_home/``, ``logs/``, ``credentials/`` go, each ``0700`` (default: a new ``0700``
            temp dir; :func:`run_flower` removes the one it made unless asked to keep it).
        startup_timeout: seconds to wait for the SuperLink port.
        extra_env: added to every process's environment.
        insecure: plain HTTP and no SuperNode authentication (today's ``--insecure``); warns with a
            ``RuntimeWarning``. Local testing only.
        tls: the user's CA/server certificate/key; default: generated into ``credentials/``.
    """

    def __init__(
        self,
        num_supernodes: int,
        workdir: str | Path | None = None,
        *,
        startup_timeout: float = 60.0,
        extra_env: Mapping[str, str] | None = None,
        insecure: bool = False,
        tls: TLSConfig | None = None,
    ) -> None:
        if insecure and tls is not None:
            raise ValueError("insecure=True disables TLS; do not pass tls certificates with it")
        if num_supernodes < 1:
            raise ValueError(f"num_supernodes must be >= 1, got {num_supernodes}")
        if not sys.platform.startswith("linux"):
            raise RuntimeError("LocalFederation needs Linux (/proc) to guarantee teardown")
        self.num_supernodes = int(num_supernodes)
        self.workdir = Path(workdir) if workdir is not None else new_workdir()
        self.startup_timeout = float(startup_timeout)
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.flwr_home = self.workdir / "flwr_home"
        self.log_dir = self.workdir / "logs"
        self.credentials_dir = self.workdir / "credentials"
        self.insecure = bool(insecure)
        self._generate_tls = not self.insecure and tls is None
        self.tls: TLSConfig | None = None
        if not self.insecure:
            cred = self.credentials_dir
            self.tls = tls or TLSConfig(cred / "ca.pem", cred / "server.pem", cred / "server.key")
        self.node_keys: dict[str, NodeKeys] = {}  # SuperNode name -> key files (secure mode only)
        self.node_ids: dict[str, int] = {}  # SuperNode name -> node id the SuperLink registered
        if self.insecure:
            warnings.warn(INSECURE_WARNING, RuntimeWarning, stacklevel=2)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self.pgid: int | None = None
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            **(extra_env or {}),
            MARKER: self.marker,
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
            "PYTHONUNBUFFERED": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }
        self._atexit_registered = False

    # ----------------------------------------------------------------------------------------- processes
    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` as a process of this federation (its group, marker and ``logs/<name>.log``)."""
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        # first process: leader of a new group (setpgid(0, 0)); the others join it. (A new *session* would
        # forbid the others from joining: setpgid across sessions fails with EPERM.)
        proc = subprocess.Popen(
            argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            **group_kwargs(0 if self.pgid is None else self.pgid),
        )
        if self.pgid is None:
            self.pgid = proc.pid
        self._procs.append(proc)
        return proc

    def _wait_port(self, port: int, proc: subprocess.Popen[bytes], name: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.log_dir / (name + '.log')}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{name} did not open 127.0.0.1:{port} within {self.startup_timeout:.0f}s")

    # ------------------------------------------------------------------------------------ commands
    def config_toml(self) -> str:
        """``$FLWR_HOME/config.toml``: the ``lalora-local`` connection used by ``flwr run`` and
        ``flwr supernode register/list`` (``root-certificates`` = the CA, or ``insecure = true``)."""
        lines = [
            "[superlink]",
            f'default = "{CONNECTION}"',
            "",
            f"[superlink.{CONNECTION}]",
            f'address = "127.0.0.1:{self.port}"',
        ]
        if self.tls is None:
            lines.append("insecure = true")
        else:
            lines += [f"root-certificates = {json.dumps(str(self.tls.ca_cert))}", "insecure = false"]
        return "\n".join(lines) + "\n"

    def superlink_command(self) -> list[str]:
        """``flower-superlink`` on 127.0.0.1: TLS + ``--enable-supernode-auth``, or ``--insecure``."""
        if self.tls is None:
            security = ["--insecure"]
        else:
            security = [
                "--ssl-ca-certfile",
                str(self.tls.ca_cert),
                "--ssl-certfile",
                str(self.tls.server_cert),
                "--ssl-keyfile",
                str(self.tls.server_key),
                "--enable-supernode-auth",
            ]
        return [
            "flower-superlink",
            *security,
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def supernode_command(self, index: int, port: int, private_key: Path | None = None) -> list[str]:
        """``flower-supernode`` number ``index`` (its partition is assigned by the ServerApp):
        ``--root-certificates`` + its auth key, or ``--insecure``; the SuperNode's own runtime API listens on
        ``127.0.0.1:port``."""
        if self.tls is None:
            if private_key is not None:
                raise ValueError("an insecure federation has no SuperNode authentication")
            security = ["--insecure"]
        else:
            if private_key is None:
                raise ValueError("a secure federation needs the SuperNode's private key")
            security = [
                "--root-certificates",
                str(self.tls.ca_cert),
                "--auth-supernode-private-key",
                str(private_key),
            ]
        return [
            "flower-supernode",
            *security,
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--node-config",
            f"num-partitions={self.num_supernodes}",  # the server assigns each node its partition
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    # ------------------------------------------------------------------------------------------- start
    def _cli(self, argv: list[str], name: str, timeout: float = 60.0) -> str:
        """Run a short ``flwr`` CLI command in the federation's group; its output, or RuntimeError."""
        proc = subprocess.Popen(
            argv,
            env={**self.env, "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            **group_kwargs(self.pgid),
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        (self.log_dir / f"{name}.log").write_text(out or "")
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed with code {proc.returncode}:\n{out}")
        return out or ""

    def _cli_json(self, argv: list[str], name: str) -> dict[str, Any]:
        out = self._cli([*argv, "--format", "json"], name)
        try:
            data, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])  # the CLI may log before it
        except ValueError as exc:
            raise RuntimeError(f"{' '.join(argv[:3])}: no JSON in its output:\n{out}") from exc
        if not data.get("success"):
            raise RuntimeError(f"{' '.join(argv[:3])} failed: {data}")
        return data

    def register_node(self, public_key: str | Path) -> int:
        """``flwr supernode register <public_key> lalora-local``: allow the SuperNode holding the matching
        private key to join; returns its node id. Must run *before* that SuperNode starts."""
        name = f"register-{Path(public_key).stem}"
        data = self._cli_json(["flwr", "supernode", "register", str(public_key), CONNECTION], name)
        return int(data["node-id"])

    def list_nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode list lalora-local --format json``: the SuperLink's nodes (``node-id``,
        ``status``: ``registered``/``online``/``offline``/...)."""
        return list(self._cli_json(["flwr", "supernode", "list", CONNECTION], "supernode-list")["nodes"])

    def add_supernode(
        self, index: int, keys: NodeKeys | None = None, *, register: bool = True, name: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the SuperNode of partition ``index``. Secure: uses ``keys`` (default: a fresh pair in
        ``credentials/``) and registers its public key first unless ``register=False`` (then the
        SuperLink refuses it)."""
        name = name or f"supernode-{index}"
        private_key = None
        if self.tls is not None:
            keys = keys or generate_node_keys(self.credentials_dir, name)
            self.node_keys[name] = keys
            if register:
                self.node_ids[name] = self.register_node(keys.public_key)
            private_key = keys.private_key
        elif keys is not None:
            raise ValueError("an insecure federation has no SuperNode authentication")
        return self.spawn(name, self.supernode_command(index, free_port(), private_key))

    def _prepare_tls(self) -> None:
        if self.tls is None:
            return
        if self._generate_tls:
            self.tls = generate_tls(self.credentials_dir)
            self._generate_tls = False  # a restarted federation keeps its CA
        elif missing := self.tls.missing():
            raise FileNotFoundError(f"TLS files not found: {', '.join(map(str, missing))}")

    def start(self) -> LocalFederation:
        """Start SuperLink and SuperNodes; on any failure everything started so far is stopped."""
        private_dir(self.flwr_home)  # owner-only: config.toml, logs and keys of this federation
        private_dir(self.log_dir)
        self._prepare_tls()
        (self.flwr_home / "config.toml").write_text(self.config_toml())
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            link = self.spawn("superlink", self.superlink_command())
            self._wait_port(self.port, link, "superlink")
            for i in range(self.num_supernodes):
                self.add_supernode(i)
        except BaseException:
            self.stop()
            raise
        return self

    # ------------------------------------------------------------------------------------------- run
    def run(self, app_dir: str | Path, *, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """``flwr run <app_dir> <connection> --stream`` (blocks until the run ends or ``timeout``)."""
        for i, p in enumerate(self._procs):
            if p.poll() is not None:
                raise RuntimeError(
                    f"federation process {i} exited early with code {p.returncode}; logs in {self.log_dir}"
                )
        argv = ["flwr", "run", str(app_dir), CONNECTION, "--stream"]
        proc = subprocess.Popen(
            argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            **group_kwargs(self.pgid),
        )
        self._procs.append(proc)  # type: ignore[arg-type]
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            (self.log_dir / "flwr-run.log").write_text(out or "")
            raise TimeoutError(f"flwr run did not finish within {timeout:.0f}s; logs in {self.log_dir}") from None
        (self.log_dir / "flwr-run.log").write_text(out or "")
        return subprocess.CompletedProcess(argv, proc.returncode, out, "")

    # ------------------------------------------------------------------------------------------- stop
    def leftovers(self) -> list[int]:
        """PIDs of this federation's processes still alive (should be ``[]`` after :meth:`stop`)."""
        return marked_pids(self.marker)

    def _signal_all(self, sig: int) -> None:
        # signal the group only while one of our direct children is alive: then the group id cannot have
        # been recycled by an unrelated process
        if self.pgid is not None and any(p.poll() is None for p in self._procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
        for pid in marked_pids(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the group and every marked process, SIGKILL what is left after ``grace`` s, reap."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.leftovers():
            for p in self._procs:
                p.poll()
            time.sleep(0.1)
        for _ in range(3):
            if not self.leftovers():
                break
            self._signal_all(signal.SIGKILL)
            time.sleep(0.2)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2.0)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._procs.clear()
        self.pgid = None
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
