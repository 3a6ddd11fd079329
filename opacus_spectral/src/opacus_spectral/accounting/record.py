"""The privacy record a DP-trained model carries: the accountant history of every DP run its weights went through
(``docs/engine.md``, "The privacy record").

A record is a list of *runs*; each run holds its accountant history ``[(σ, q, steps), ...]`` (Opacus' format), its
sampler (``"poisson"``; ``"shuffle"`` for a loader without Poisson sampling), its noise mechanism (``"gaussian"``),
the accountant that reported it, the δ it was reported at, the dataset size N, a random id and a privacy *unit*
(runs on data the user stated to be a different privacy unit get a new one). σ, q, the step count and N are treated
as public, as Opacus does; nothing else derived from the data is kept.

In memory, ``make_private`` leaves on the user's (unwrapped) model a ledger bound to the engine's accountant; a new
engine (or ``DPTrainer``) given that model composes with it: its accountant starts with the earlier history, so
``get_epsilon``, the logs and the budget include it, and it says so once (:class:`ComposedPrivacyWarning`).
``new_privacy_unit=True`` is the user's statement that the new data share no record with the earlier runs' data:
the accountant then starts from 0 (the earlier runs stay in the record, under their unit). On disk the record is
``privacy_record.json`` beside the adapter (:func:`save_privacy_record`, :func:`load_privacy_record`; ``DPTrainer``
writes it with the adapter), validated strictly when read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ComposedPrivacyWarning
from ..step.parameters import unwrap
from .bounds import refuse_gdp
from .calibration import epsilon_from_history, noise_multiplier_for
from .sampling import sampler_kind

__all__ = [
    "RECORD_FILE",
    "ComposedPrivacyWarning",
    "PrivacyRecord",
    "PrivacyRun",
    "load_privacy_record",
    "noise_multiplier_after",
    "privacy_record_of",
    "read_privacy_record",
    "save_privacy_record",
    "write_privacy_record",
]

RECORD_FILE = "privacy_record.json"
FORMAT, VERSION = "opacus_spectral.accounting.record", 1
SAMPLERS = ("poisson", "shuffle", "cyclic_poisson")
ACCOUNTANTS = ("prv", "rdp", "gdp")
MODEL_ATTR = "_opacus_spectral_privacy_record"  #: the ledger on the user's model
ENGINE_ATTR = "_opacus_spectral_privacy_ledger"  #: the ledger of the engine's last make_private
MAX_BYTES = 16 * 2**20
_RUN_KEYS = ("id", "unit", "history", "sampler", "mechanism", "accountant", "delta", "dataset_size")

Entry = tuple[float, float, int]


@dataclass(frozen=True)
class PrivacyRun:
    """One DP run: its accountant history and how it was sampled, noised and reported."""

    id: str
    unit: int
    history: tuple[Entry, ...]
    sampler: str = "poisson"
    mechanism: str = "gaussian"
    accountant: str = "prv"
    delta: float | None = None
    dataset_size: int | None = None

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _RUN_KEYS}
        out["history"] = [list(e) for e in self.history]
        return out


@dataclass(frozen=True)
class PrivacyRecord:
    """The runs a model's weights went through, oldest first."""

    runs: tuple[PrivacyRun, ...]

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.runs)

    def history(self, unit: int | None = None) -> list[Entry]:
        """The runs' histories, concatenated (``unit``: that privacy unit's runs only)."""
        return [e for r in self.runs if unit is None or r.unit == unit for e in r.history]

    def epsilon(self, delta: float, accountant: str = "prv", unit: int | None = None) -> float:
        """ε at ``delta`` of the composed history (``unit=None``: every run, an upper bound for any unit)."""
        return epsilon_from_history(self.history(unit), delta, accountant)

    def worst_epsilon(self, delta: float, accountant: str = "prv") -> float:
        """The largest ε at ``delta`` over the privacy units: what any one record is protected by (a record lies in
        one unit — e.g. one federated client's data)."""
        return max(self.epsilon(delta, accountant, unit) for unit in sorted({r.unit for r in self.runs}))

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT, "version": VERSION, "runs": [r.to_dict() for r in self.runs]}
        return {**body, "sha256": _digest(body)}


@dataclass
class _LiveRun:
    """The run of an engine's accountant: its history after the prefix it was started with."""

    id: str
    unit: int
    accountant: Any
    prefix: tuple[Entry, ...]
    sampler: str
    dataset_size: int | None
    delta: float | None = None
    mechanism: str = "gaussian"

    def snapshot(self) -> PrivacyRun | None:
        history = [tuple(e) for e in self.accountant.history]
        try:
            own = run_history(history, self.prefix)
        except ValueError:  # replaced (a loaded checkpoint without the prefix): count all of it, never less
            own = [(float(s), float(q), int(n)) for s, q, n in history]
        if not own:
            return None
        name = self.accountant.mechanism()
        return PrivacyRun(
            self.id, self.unit, tuple(own), self.sampler, self.mechanism, name, self.delta, self.dataset_size
        )


@dataclass
class _Ledger:
    """What a model (and the engine that trains it) carries: earlier runs, and the live one."""

    runs: list[PrivacyRun] = field(default_factory=list)
    live: _LiveRun | None = None

    def record(self) -> PrivacyRecord:
        now = self.live.snapshot() if self.live is not None else None
        return PrivacyRecord(tuple(self.runs) + ((now,) if now is not None else ()))


# -- histories -----------------------------------------------------------------------------------------------
def run_history(history: Sequence[Sequence[Any]], prefix: Sequence[Sequence[Any]]) -> list[Entry]:
    """``history`` without the ``prefix`` it started with (Opacus merges a step of the same σ and q into the last
    entry, so the prefix's last entry may have grown). ``ValueError`` when it does not start with ``prefix``."""
    hist = [(float(s), float(q), int(n)) for s, q, n in history]
    pre = [(float(s), float(q), int(n)) for s, q, n in prefix]
    if not pre:
        return hist
    k = len(pre) - 1
    last, cut = pre[-1], hist[k] if len(hist) > k else None
    if hist[:k] != pre[:k] or cut is None or cut[:2] != last[:2] or cut[2] < last[2]:
        raise ValueError(
            f"the accountant history ({_steps(hist)} steps) does not start with the {_steps(pre)} steps of the privacy "
            "record it was composed with"
        )
    rest = [(cut[0], cut[1], cut[2] - last[2])] if cut[2] > last[2] else []
    return rest + hist[k + 1 :]


def _steps(history: Iterable[Sequence[Any]]) -> int:
    return sum(int(e[2]) for e in history)


# -- in memory -----------------------------------------------------------------------------------------------
def _ledger(obj: Any) -> _Ledger | None:
    found = getattr(obj, ENGINE_ATTR, None) if hasattr(obj, ENGINE_ATTR) else None
    return found if found is not None else _model_ledger(unwrap(obj))


# -- in the model's configs -----------------------------------------------------------------------------------
#: where a record travels without this library in the loop: the attribute of the model's Hugging Face config
#: (``config.json``: ``save_pretrained``, ``push_to_hub``, ``from_pretrained``, ``merge_and_unload``) and the field
#: of a LALoRA adapter's config (``adapter_config.json``: ``PeftModel.save_pretrained`` / ``from_pretrained``)
CONFIG_ATTR, ADAPTER_FIELD = "opacus_spectral_privacy_record", "privacy_record"


class LiveRecord:
    """A model's record as its configs hold it: whenever a config is serialized (``to_dict`` deep-copies it) it
    becomes the record's JSON at that moment, so a save never writes a stale ε."""

    def __init__(self, ledger: _Ledger) -> None:
        self.ledger = ledger

    def __deepcopy__(self, memo: Any) -> dict[str, Any] | None:
        record = self.ledger.record()
        return record.to_json() if record.runs else None

    def __repr__(self) -> str:
        return f"LiveRecord({len(self.ledger.record().runs)} runs)"


def _carriers(model: Any) -> list[tuple[Any, str]]:
    """``(config, attribute)`` of every config that carries ``model``'s record: its (base) model's Hugging Face config
    and each adapter config with a :data:`ADAPTER_FIELD` field (LALoRA's)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = []
    config = getattr(base, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)) and not isinstance(config, dict):
        found.append((config, CONFIG_ATTR))
    peft_configs = getattr(model, "peft_config", None)
    for adapter in peft_configs.values() if isinstance(peft_configs, dict) else ():
        if hasattr(adapter, ADAPTER_FIELD):
            found.append((adapter, ADAPTER_FIELD))
    return found


def _bind(model: Any, ledger: _Ledger) -> None:
    """Make ``model``'s configs carry ``ledger``'s record (:class:`LiveRecord`)."""
    setattr(model, MODEL_ATTR, ledger)
    for config, attr in _carriers(model):
        setattr(config, attr, LiveRecord(ledger))


def _model_ledger(model: Any) -> _Ledger | None:
    """The ledger ``model`` carries: its own, a live one its configs share (a merged model's), or the runs its configs
    were loaded with (``from_pretrained`` of a saved model or adapter) — attached on the way."""
    ledger = getattr(model, MODEL_ATTR, None)
    if ledger is not None:
        return ledger
    runs: list[PrivacyRun] = []
    for config, attr in _carriers(model):
        held = getattr(config, attr, None)
        if isinstance(held, LiveRecord):
            _bind(model, held.ledger)
            return held.ledger
        if held is not None:
            runs = merge_runs(runs, parse_record(held).runs)
    if not runs:
        return None
    ledger = _Ledger(runs)
    _bind(model, ledger)
    return ledger


def privacy_record_of(model_or_engine: Any) -> PrivacyRecord | None:
    """The record a model (or an engine's last ``make_private``) carries now; ``None`` when none or empty."""
    ledger = _ledger(model_or_engine)
    record = ledger.record() if ledger is not None else None
    return record if record is not None and record.runs else None


def prior_history(engine: Any, module: Any, *, new_privacy_unit: bool = False) -> list[Entry]:
    """The history ``engine.make_private(module=module, ...)`` will start its accountant with."""
    ledger = _model_ledger(unwrap(module))
    if new_privacy_unit or ledger is None or (ledger.live is not None and ledger.live.accountant is engine.accountant):
        return []
    return ledger.record().history()


def compose_privacy_record(
    engine: Any,
    *,
    module: Any = None,
    new_privacy_unit: bool = False,
    data_loader: Any = None,
    poisson_sampling: bool = True,
    noise: Any = None,
    **_: Any,
) -> None:
    """``make_private``'s part: start the engine's accountant with the record ``module`` carries (or not, for a new
    privacy unit), and bind the model's record to that accountant. ``noise``: the run's noise mechanism other than
    the default (its ``name`` and ``sampler`` are recorded)."""
    if module is None:
        return
    model = unwrap(module)
    old = _model_ledger(model)
    if old is not None and old.live is not None and old.live.accountant is engine.accountant:
        if new_privacy_unit and engine.accountant.history:
            raise ValueError(
                "new_privacy_unit=True needs a new PrivacyEngine: this engine's accountant already holds the model's "
                "earlier steps"
            )
        return  # the same engine again: its accountant already holds everything
    runs = list(old.record().runs) if old is not None else []
    prefix = () if new_privacy_unit else tuple(e for r in runs for e in r.history)
    if prefix and engine.accountant.mechanism() == "gdp":
        raise ValueError(
            "the model carries a privacy record, and the gdp accountant cannot compose it (it reads only the last "
            "(σ, q) of its history): use accountant='prv' or 'rdp', or pass new_privacy_unit=True if the new data "
            "are a different privacy unit"
        )
    units = [r.unit for r in runs]
    unit = (max(units) + 1 if new_privacy_unit else max(units)) if units else 0
    size = len(data_loader.dataset) if hasattr(getattr(data_loader, "dataset", None), "__len__") else None
    poisson = poisson_sampling or data_loader is None or sampler_kind(data_loader) == "poisson"
    sampler = "poisson" if poisson else "shuffle"  # as the engine accounts it (.shuffled_sampling)
    if noise is not None:  # a noise mechanism samples its own way (docs/mechanisms.md)
        sampler = noise.sampler
    if prefix:
        _warn_composed(runs, engine.accountant.mechanism())
        engine.accountant.history = list(prefix) + list(engine.accountant.history)
    mechanism = "gaussian" if noise is None else noise.name
    ledger = _Ledger(runs, _LiveRun(uuid.uuid4().hex, unit, engine.accountant, prefix, sampler, size, None, mechanism))
    _bind(model, ledger)
    setattr(engine, ENGINE_ATTR, ledger)


def _warn_composed(runs: Sequence[PrivacyRun], accountant: str) -> None:
    steps = sum(r.steps for r in runs)
    deltas = [r.delta for r in runs if r.delta is not None]
    spent = ""
    if deltas:
        eps = epsilon_from_history([e for r in runs for e in r.history], deltas[-1], accountant)
        spent = f", epsilon = {eps:.4g} at delta = {deltas[-1]:.3g} ({accountant})"
    warnings.warn(
        f"this model carries a privacy record: {len(runs)} earlier DP run(s), {steps} steps{spent}. This engine's "
        "accountant starts from that history, so the epsilon reported from now on includes it. If the new training "
        "data are a different privacy unit (no record in common with the earlier runs' data), pass "
        "new_privacy_unit=True.",
        ComposedPrivacyWarning,
        stacklevel=4,
    )


def composed_history(engine: Any) -> list[Entry]:
    """The history the engine's accountant was started with by its last ``make_private`` (the model's record):
    a checkpoint of that run holds it before the run's own steps (:func:`run_history` strips it)."""
    ledger = getattr(engine, ENGINE_ATTR, None)
    return list(ledger.live.prefix) if ledger is not None and ledger.live is not None else []


def composed_steps(engine: Any) -> int:
    """Steps of :func:`composed_history`."""
    return _steps(composed_history(engine))


def set_run_delta(engine: Any, delta: float) -> None:
    """The δ the engine's run reports ε at (kept in the record)."""
    ledger = getattr(engine, ENGINE_ATTR, None)
    if ledger is not None and ledger.live is not None:
        ledger.live.delta = float(delta)


# -- DPTrainer checkpoints ---------------------------------------------------------------------------------
STATE_KEY = "privacy_record"  #: the key of :func:`resume_state` in DPTrainer's DP state


def resume_state(engine: Any) -> dict[str, Any] | None:
    """What a DPTrainer checkpoint keeps of the record: the earlier runs, the history the run was composed with
    (its accountant's history starts with it), the run's id and unit."""
    ledger = getattr(engine, ENGINE_ATTR, None)
    if ledger is None or ledger.live is None:
        return None
    live = ledger.live
    return {
        "runs": [r.to_dict() for r in ledger.runs],
        "prefix": [list(e) for e in live.prefix],
        "run_id": live.id,
        "unit": live.unit,
    }


def resumed_prefix(state: Any) -> list[Entry]:
    """The composed history of a checkpoint's :func:`resume_state` (``None``: none), validated."""
    if state is None:
        return []
    if not isinstance(state, dict) or set(state) != {"runs", "prefix", "run_id", "unit"}:
        raise ValueError(f"the DP state's {STATE_KEY} must hold exactly runs, prefix, run_id, unit")
    if not isinstance(state["prefix"], list) or not isinstance(state["runs"], list):
        raise ValueError(f"the DP state's {STATE_KEY} prefix and runs must be lists")
    if not (_is_int(state["unit"]) and state["unit"] >= 0 and isinstance(state["run_id"], str)):
        raise ValueError(f"the DP state's {STATE_KEY} unit must be an integer >= 0 and run_id a string")
    return [_entry(list(e), f"the DP state's {STATE_KEY} prefix entry {i}") for i, e in enumerate(state["prefix"])]


def trainer_prior(engine: Any, model: Any, new_privacy_unit: bool, resume: Any = None) -> list[Entry]:
    """The history a DPTrainer run composes with: a resumed checkpoint's (``resume``: its ``ResumeEvidence``), else
    the model's record's."""
    state = resume.dp.get(STATE_KEY) if resume is not None else None
    if state is not None:
        return resumed_prefix(state)
    return prior_history(engine, model, new_privacy_unit=new_privacy_unit)


def restore_record(engine: Any, state: Any) -> None:
    """After a resumed checkpoint's accountant state is loaded: continue the checkpoint's run, refusing a model whose
    record holds runs the checkpoint's run did not know (their steps would drop out of the accountant)."""
    ledger = getattr(engine, ENGINE_ATTR, None)
    if ledger is None or ledger.live is None:
        return
    prefix = resumed_prefix(state)
    saved = [parse_run(r, i) for i, r in enumerate(state["runs"])] if state is not None else []
    known = {r.id: r for r in saved}
    own = state["run_id"] if state is not None else None  # the checkpoint's run itself (e.g. the same model object)
    missing = [r for r in ledger.runs if r.id != own and not (r.id in known and _covers(known[r.id], r))]
    if missing and (ledger.live.prefix or state is None or prefix):
        raise ValueError(
            f"cannot resume: the model carries a privacy record ({sum(r.steps for r in missing)} DP steps) that the "
            "checkpoint's run did not compose with. Resume with the model that run started from (or a fresh one)."
        )
    ledger.runs = merge_runs(saved, [r for r in ledger.runs if r.id != own])
    ledger.live.prefix = tuple(prefix)
    if state is not None:
        ledger.live.id, ledger.live.unit = str(state["run_id"]), int(state["unit"])


# -- files ---------------------------------------------------------------------------------------------------
def save_privacy_record(model_or_engine: Any, folder: str | os.PathLike[str], *, delta: float | None = None) -> str:
    """Write the record a model (or an engine's last ``make_private``) carries to ``folder/privacy_record.json``
    (beside the adapter); ``delta``: the δ of runs that have none yet (a hand-written loop's). Returns the path."""
    ledger = _ledger(model_or_engine)
    if delta is not None:
        _check_delta(delta, "delta")
        if ledger is not None and ledger.live is not None and ledger.live.delta is None:
            ledger.live.delta = float(delta)
    record = privacy_record_of(model_or_engine)
    if record is None:
        raise ValueError(
            "nothing to save: this model carries no privacy record (no DP step was taken through make_private, and "
            "none was loaded with load_privacy_record)"
        )
    runs = tuple(r if r.delta is not None else replace(r, delta=delta) for r in record.runs)
    return write_privacy_record(PrivacyRecord(runs), folder)


def write_privacy_record(record: PrivacyRecord, folder: str | os.PathLike[str]) -> str:
    """Write ``record`` to ``folder/privacy_record.json`` atomically (every run needs its δ). Returns the path."""
    if any(r.delta is None for r in record.runs):
        raise ValueError("save_privacy_record needs delta=: the δ at which you report this run's epsilon")
    body = record.to_json()
    parse_record(body)  # what is written reads back
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RECORD_FILE)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def read_privacy_record(folder: str | os.PathLike[str]) -> PrivacyRecord:
    """The record in ``folder/privacy_record.json``, validated; ``ValueError`` naming what is wrong."""
    path = os.path.join(folder, RECORD_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {RECORD_FILE} in the folder given: if the adapter there was DP-trained, the privacy it spent is "
            "unknown. Save it with DPTrainer.save_model or opacus_spectral.save_privacy_record."
        )
    if os.path.getsize(path) > MAX_BYTES:
        raise ValueError(f"{RECORD_FILE} is larger than {MAX_BYTES} bytes: not a privacy record")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{RECORD_FILE} is not a valid privacy record ({err})") from err
    return parse_record(data)


def load_privacy_record(model: Any, folder: str | os.PathLike[str]) -> PrivacyRecord:
    """Read ``folder``'s record and attach it to ``model`` (merged with any record the model carries, run by run),
    so that the next ``make_private`` / ``DPTrainer`` on it composes with it. Returns the model's record."""
    loaded = read_privacy_record(folder)
    model = unwrap(model)
    ledger = _model_ledger(model)
    if ledger is None:
        _bind(model, _Ledger(list(loaded.runs)))
        return loaded
    if ledger.live is not None:
        known = {r.id: r for r in ledger.record().runs}
        if all(r.id in known and _covers(known[r.id], r) for r in loaded.runs):
            return ledger.record()
        raise ValueError(
            "this model is already bound to a PrivacyEngine's accountant, which would not count the loaded runs: "
            "load the privacy record before make_private / DPTrainer"
        )
    ledger.runs = merge_runs(ledger.runs, loaded.runs)
    return ledger.record()


def merge_runs(ours: Sequence[PrivacyRun], theirs: Sequence[PrivacyRun]) -> list[PrivacyRun]:
    """The union by run id; a run in both keeps its longer history (one must extend the other)."""
    out = {r.id: r for r in ours}
    for r in theirs:
        mine = out.get(r.id)
        if mine is None or _covers(r, mine):
            out[r.id] = r
        elif not _covers(mine, r):
            raise ValueError(f"two versions of privacy run {r.id[:8]} disagree (neither extends the other)")
    return list(out.values())


def _covers(longer: PrivacyRun, shorter: PrivacyRun) -> bool:
    try:
        run_history(longer.history, shorter.history)
    except ValueError:
        return False
    return True


# -- validation ----------------------------------------------------------------------------------------------
def parse_record(data: Any) -> PrivacyRecord:
    """A record from its JSON form, strictly: known keys only, every field checked, the digest matching."""
    if not isinstance(data, dict) or set(data) != {"format", "version", "runs", "sha256"}:
        raise ValueError(f"{RECORD_FILE} must hold exactly the keys format, version, runs, sha256")
    if data["format"] != FORMAT or data["version"] != VERSION:
        raise ValueError(
            f"{RECORD_FILE} is format {data['format']!r} version {data['version']!r}; this version reads {FORMAT!r} "
            f"version {VERSION}"
        )
    body = {k: data[k] for k in ("format", "version", "runs")}
    if data["sha256"] != _digest(body):
        raise ValueError(
            f"{RECORD_FILE} was edited after it was written (its sha256 does not match its content): refusing a "
            "record that could under-report epsilon"
        )
    if not isinstance(data["runs"], list) or not data["runs"]:
        raise ValueError(f"{RECORD_FILE} lists no DP run: a record is only written after DP steps")
    runs = tuple(parse_run(r, i) for i, r in enumerate(data["runs"]))
    if len({r.id for r in runs}) != len(runs):
        raise ValueError(f"{RECORD_FILE} lists a run id twice")
    return PrivacyRecord(runs)


def parse_run(data: Any, i: int = 0) -> PrivacyRun:
    """One run from its dict form, every field checked (``ValueError`` naming the field)."""
    where = f"{RECORD_FILE} run {i}"
    if not isinstance(data, dict) or set(data) != set(_RUN_KEYS):
        raise ValueError(f"{where} must hold exactly the keys {', '.join(_RUN_KEYS)}")
    rid, unit = data["id"], data["unit"]
    if not (isinstance(rid, str) and len(rid) == 32 and all(c in "0123456789abcdef" for c in rid)):
        raise ValueError(f"{where}: id must be 32 lowercase hex digits")
    if not _is_int(unit) or unit < 0:
        raise ValueError(f"{where}: unit must be an integer >= 0")
    for key, allowed in (("sampler", SAMPLERS), ("accountant", ACCOUNTANTS)):
        if data[key] not in allowed:
            raise ValueError(f"{where}: {key} must be one of {allowed}, got {data[key]!r}")
    mechanism = data["mechanism"]  # any registered mechanism's name: the ε follows from the history, not from it
    if not (isinstance(mechanism, str) and mechanism.isidentifier() and len(mechanism) <= 64):
        raise ValueError(f"{where}: mechanism must be a mechanism's name (an identifier), got {mechanism!r}")
    if data["delta"] is not None:
        _check_delta(data["delta"], f"{where}: delta")
    size = data["dataset_size"]
    if size is not None and (not _is_int(size) or size < 1):
        raise ValueError(f"{where}: dataset_size must be an integer >= 1 or null")
    history = data["history"]
    if not isinstance(history, list) or not history:
        raise ValueError(f"{where}: history must be a non-empty list of [noise_multiplier, sample_rate, steps]")
    entries = tuple(_entry(e, f"{where} history entry {j}") for j, e in enumerate(history))
    fields = {k: data[k] for k in ("sampler", "mechanism", "accountant", "delta", "dataset_size")}
    return PrivacyRun(rid, unit, entries, **fields)


def _entry(e: Any, where: str) -> Entry:
    ok = isinstance(e, list) and len(e) == 3 and all(_is_number(v) for v in e[:2]) and _is_int(e[2])
    if not ok or not (math.isfinite(e[0]) and e[0] >= 0 and 0 < e[1] <= 1 and e[2] >= 1):
        raise ValueError(f"{where} must be [noise_multiplier >= 0, 0 < sample_rate <= 1, steps >= 1], got {e!r}")
    return float(e[0]), float(e[1]), int(e[2])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_delta(delta: Any, name: str) -> None:
    if not (_is_number(delta) and 0 < delta < 1):
        raise ValueError(f"{name} must be a number in (0, 1), got {delta!r}")


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a privacy record may hold")


# -- calibration ---------------------------------------------------------------------------------------------
def noise_multiplier_after(
    prior: Sequence[Sequence[Any]],
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """The smallest σ (to within ``epsilon_tolerance`` in ε) such that ``prior`` followed by ``steps`` steps at rate q
    spends ε ≤ ``target_epsilon`` at ``target_delta``; without a prior,
    :func:`~opacus_spectral.accounting.calibration.noise_multiplier_for` (Opacus' search), whose arguments it also
    refuses.

    Raises:
        ValueError: bad arguments, a prior that already spends the target, or a target no σ in [0.01, 1e6] meets.
    """
    prior = [tuple(e) for e in prior]
    if not prior:
        return noise_multiplier_for(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=epsilon_tolerance,
        )
    _check_calibration(target_epsilon, target_delta, sample_rate, steps, epsilon_tolerance)
    refuse_gdp(accountant, "target_epsilon (a calibration of the noise multiplier)")
    spent = epsilon_from_history(prior, target_delta, accountant)
    if spent >= target_epsilon:
        raise ValueError(
            f"the model's privacy record already spends epsilon = {spent:.4g} at delta = {target_delta}: no noise "
            f"multiplier keeps this run within target_epsilon = {target_epsilon} (pass new_privacy_unit=True if the "
            "new data are a different privacy unit)"
        )

    def excess(sigma: float) -> float:  # decreasing in σ, towards spent - target < 0
        history = [*prior, (sigma, sample_rate, int(steps))]
        return epsilon_from_history(history, target_delta, accountant) - target_epsilon

    lo, hi = _bracket(excess, target_epsilon, spent)
    return _illinois(excess, lo, hi, epsilon_tolerance)


def _check_calibration(target_epsilon: Any, target_delta: Any, sample_rate: Any, steps: Any, tolerance: Any) -> None:
    checks = (
        (_is_number(target_epsilon) and math.isfinite(target_epsilon) and target_epsilon > 0, "target_epsilon", "> 0"),
        (_is_number(target_delta) and 0 < target_delta < 1, "target_delta", "in (0, 1)"),
        (_is_number(sample_rate) and 0 < sample_rate <= 1, "sample_rate", "in (0, 1]"),
        (_is_int(steps) and steps >= 1, "steps", "an integer >= 1"),
        (_is_number(tolerance) and math.isfinite(tolerance) and tolerance > 0, "epsilon_tolerance", "> 0"),
    )
    for ok, name, what in checks:
        if not ok:
            value = {"target_epsilon": target_epsilon, "target_delta": target_delta, "sample_rate": sample_rate}
            value.update(steps=steps, epsilon_tolerance=tolerance)
            raise ValueError(f"{name} must be a finite number {what}, got {value[name]!r}")


def _bracket(excess: Any, target: float, spent: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(σ, excess) pairs lo < hi with excess(lo) > 0 >= excess(hi), doubling or halving from σ = 1."""
    hi, e_hi = 1.0, excess(1.0)
    lo, e_lo = hi, e_hi
    while e_hi > 0:
        lo, e_lo, hi = hi, e_hi, hi * 2
        if hi > 1e6:
            raise ValueError(
                f"target_epsilon = {target} is within the calibration's reach only for a noise multiplier above 1e6 "
                f"(the model's privacy record already spends {spent:.4g}): choose a larger target"
            )
        e_hi = excess(hi)
    while e_lo <= 0:
        hi, e_hi, lo = lo, e_lo, lo / 2
        if lo < 0.01:
            raise ValueError(f"target_epsilon = {target} needs a noise multiplier below 0.01: choose a smaller target")
        e_lo = excess(lo)
    return (lo, e_lo), (hi, e_hi)


def _illinois(excess: Any, lo: tuple[float, float], hi: tuple[float, float], tolerance: float) -> float:
    """Regula falsi with the Illinois weighting on a bracket; returns σ with -tolerance < excess(σ) <= 0."""
    (a, fa), (b, fb) = lo, hi
    true_fb, kept = fb, 0
    for _ in range(100):
        if -true_fb < tolerance:
            break
        m = (a * fb - b * fa) / (fb - fa)
        m = m if a < m < b else (a + b) / 2
        fm = excess(m)
        if fm > 0:
            a, fa = m, fm
            fb, kept = (fb / 2 if kept == 1 else fb), 1  # b kept twice: halve its weight
        else:
            b, fb, true_fb = m, fm, fm
            fa, kept = (fa / 2 if kept == -1 else fa), -1
    return b
