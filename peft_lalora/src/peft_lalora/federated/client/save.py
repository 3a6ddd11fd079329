"""Where a run's outputs go: the result file and the trained adapter (``peft-lalora federate --out FILE
--save-adapter DIR``), both checked before the run starts (:func:`check_out_file`, :func:`check_target_dir`).

:func:`save_adapter` installs a federation's final global state (LoRA factors and the trainable head) into a
freshly built adapter model of the run and writes

* ``DIR``: the LALoRA adapter (``PeftModel.from_pretrained(base, DIR)`` after ``import peft_lalora``), and
* ``DIR/lora``: the same weights as a plain LoRA adapter (:func:`~peft_lalora.tuners.lalora.export.export_as_lora`;
  plain PEFT loads it, no ``peft_lalora`` needed) — identical logits either way.

``base`` is the run's base model: for ``task="text"``,
``AutoModelForSequenceClassification.from_pretrained(model, num_labels=...)``. The adapter is the output of the
DP federation (post-processing of the clients' noisy updates: no extra privacy cost).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..config import FederationConfig
    from ..data.task import Task

__all__ = ["LORA_SUBDIR", "check_out_file", "check_target_dir", "federation_record", "save_adapter"]

#: the plain-LoRA copy's sub-folder of ``--save-adapter DIR``
LORA_SUBDIR = "lora"


def check_target_dir(path: str | Path, flag: str = "--save-adapter") -> Path:
    """``path`` as a folder this process can write into (created); ``ValueError`` naming ``flag`` if not."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p}: is a file; give a folder for the adapter")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".lalora-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{flag} {p}: cannot write there ({err.strerror or err}); choose a writable folder") from None
    return p


def check_out_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a file this process can write (parent folders created); ``ValueError`` naming ``flag`` if
    it is a folder, lies under a file, or cannot be written — checked before a run, not after it."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {p}: is a folder; give a file name such as {p / 'results.json'}")
    under = next((a for a in p.parents if a.exists()), None)
    if under is not None and not under.is_dir():
        raise ValueError(f"{flag} {p}: {under} is a file, not a folder; choose another path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            with p.open("ab"):
                pass
        else:
            p.write_bytes(b"")
            p.unlink()
    except OSError as err:
        raise ValueError(f"{flag} {p}: cannot write there ({err.strerror or err}); choose a writable path") from None
    return p


def save_adapter(
    cfg: FederationConfig,
    task: Task,
    state: Mapping[str, torch.Tensor],
    directory: str | Path,
    privacy: Mapping[str, Any],
) -> dict:
    """Write ``state`` as a LALoRA adapter in ``directory`` and a plain LoRA copy in ``directory/lora``, each with
    the federation's privacy record (``privacy``: the ledger's report, :func:`federation_record`) in its
    ``privacy_record.json`` and, for the LALoRA adapter, in its config; returns ``{"adapter", "lora", "record"}``."""
    from opacus_spectral.accounting import load_privacy_record, write_privacy_record

    from ...tuners.lalora.export import export_as_lora
    from ..builders import make_peft_model
    from .adapter_state import load_adapter_state, trainable_parameters

    model: Any = make_peft_model(cfg, task)
    load_adapter_state(trainable_parameters(model), state)
    out = check_target_dir(directory)
    record = write_privacy_record(federation_record(privacy), out)
    load_privacy_record(model, out)  # the adapter's config carries it too (save_pretrained, push_to_hub)
    model.save_pretrained(str(out))
    lora = export_as_lora(out, out / LORA_SUBDIR)
    return {"adapter": str(out), "lora": str(lora), "record": record}


def federation_record(privacy: Mapping[str, Any]) -> Any:
    """The privacy record of a federation's output from the ledger's report: one run per client that was charged,
    each its own privacy unit (a record lies in one client's data), with the history behind the client's ε
    (Poisson-sampled Gaussian DP-SGD, the ledger's accountant and δ). ``worst_epsilon(δ)`` of it is the report's
    max ε."""
    from opacus_spectral.accounting import PrivacyRecord, PrivacyRun

    runs = []
    for unit, (_, info) in enumerate(sorted(privacy["clients"].items())):
        history = tuple((float(s), float(q), int(n)) for s, q, n in info["history"])
        if not history:
            continue  # never sampled: nothing of its data is in the adapter
        run = PrivacyRun(
            uuid.uuid4().hex, unit, history, "poisson", "gaussian", privacy["accountant"], privacy["delta"]
        )
        runs.append(run)
    if not runs:
        raise ValueError("--save-adapter: no client took a DP step, so there is no privacy record to save")
    return PrivacyRecord(tuple(runs))
