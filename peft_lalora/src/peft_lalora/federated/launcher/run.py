"""``run_flower``: one run of a configuration on a fresh local Flower federation
(:mod:`~peft_lalora.federated.launcher.launcher`), with its private work folder removed at the end
(:mod:`~peft_lalora.federated.launcher.workdir`) and, on request, the trained adapter saved
(:mod:`peft_lalora.federated.client.save`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workdir import new_workdir, private_dir, remove_workdir

if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig
    from .certificates import TLSConfig

__all__ = ["run_flower"]


def run_flower(
    cfg: FederationConfig,
    *,
    workdir: str | Path | None = None,
    threads: int = 0,
    timeout: float = 600.0,
    insecure: bool = False,
    tls: TLSConfig | None = None,
    keep_workdir: bool = False,
    save_adapter: str | Path | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` on a fresh local Flower federation (``cfg.num_clients`` SuperNodes) and return the
    result JSON (same layout as :meth:`FederationResult.to_json`) plus ``"state_path"`` (the final
    global adapter saved with ``torch.save``) and ``"workdir"`` (logs, app, credentials) — both ``None`` once the
    folder is removed —, ``"adapter"`` (with ``save_adapter``: :func:`~peft_lalora.federated.client.save.save_adapter`'s
    folders), ``"federation_id"`` (the value of ``LALORA_FEDERATION_ID`` its processes carried), ``"leftover_pids"``
    (checked after teardown) and ``"transport"`` (``{"tls": bool, "supernode_auth": bool}``).

    ``workdir``: the caller's folder, kept. Default: a new ``0700`` temp folder (it holds the CA, the SuperLink's
    and the SuperNodes' private keys), removed when the run ends — also on failure — unless ``keep_workdir``.
    TLS and SuperNode authentication are on by default (``tls`` or generated); ``insecure=True`` turns both off
    and warns. This process is the operator's: it computes the plan
    (:func:`~peft_lalora.federated.server.plan.planned_config`) from the shared source; the ServerApp gets only the
    plan. Raises ``RuntimeError`` with the logs' tail if no result.
    """
    keep = workdir is not None or keep_workdir
    wd = private_dir(workdir) if workdir is not None else new_workdir()
    try:
        out = _run(cfg, wd, threads=threads, timeout=timeout, insecure=insecure, tls=tls, save_adapter=save_adapter)
    finally:
        if not keep:
            remove_workdir(wd)
    if not keep:
        out["state_path"] = out["workdir"] = None
    return out


def _run(
    cfg: FederationConfig,
    wd: Path,
    *,
    threads: int,
    timeout: float,
    insecure: bool,
    tls: TLSConfig | None,
    save_adapter: str | Path | None,
) -> dict[str, Any]:
    import torch

    from ..data.task import build_task
    from ..flower.app_config import RESULT_PATH_KEY, STATE_PATH_KEY, THREADS_KEY, write_flower_app
    from ..server.ledger import check_delta
    from ..server.plan import FederationPlan, partition_summary, planned_config
    from .launcher import LocalFederation

    task = build_task(cfg)
    cfg, partition = planned_config(cfg, task)
    check_delta(cfg.delta, FederationPlan.from_partition(partition).sizes)  # before any process starts
    result_path, state_path = (wd / "result.json").resolve(), (wd / "global_state.pt").resolve()
    run_config = {
        **cfg.to_dict(),
        RESULT_PATH_KEY: str(result_path),
        STATE_PATH_KEY: str(state_path),
        THREADS_KEY: int(threads),
    }
    app_dir = write_flower_app(wd / "app", run_config)
    fed = LocalFederation(
        cfg.num_clients,
        wd,
        extra_env={"OMP_NUM_THREADS": str(threads)} if threads > 0 else None,
        insecure=insecure,
        tls=tls,
    )
    with fed:
        completed = fed.run(app_dir, timeout=timeout)
        deadline = time.monotonic() + 30.0
        while not result_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    if not result_path.exists():
        tails = []
        for log in sorted(fed.log_dir.glob("*.log")):
            tails.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        raise RuntimeError(
            f"Flower run produced no result (flwr run exit code {completed.returncode}).\n" + "\n".join(tails)
        )
    out = json.loads(result_path.read_text())
    if save_adapter is not None:
        from ..client.save import save_adapter as save

        out["adapter"] = save(cfg, task, torch.load(state_path), save_adapter, out["privacy"])
    out["partition"] = partition_summary(cfg, FederationPlan.from_partition(partition), partition)
    out["state_path"] = str(state_path)
    out["workdir"] = str(wd)
    out["federation_id"] = fed.marker
    out["leftover_pids"] = fed.leftovers()  # [] unless teardown failed
    out["transport"] = {"tls": fed.tls is not None, "supernode_auth": fed.tls is not None}
    return out
