"""Reading the user's table for ``task="text"``, with one-line errors that name the file, the line or record
and the column.

CSV/TSV and JSON Lines files are scanned before ``datasets`` loads them (pandas would silently fill a short
row with missing values, pyarrow a record without a field with ``null``): every record must have the header's
number of fields (CSV) or be a JSON object with the run's columns (JSONL), no column may be named twice (a CSV
header, a JSON object: pandas would silently read the first, ``json`` keep the last), quotes must close, text and
label cells must not be empty, and JSON labels must all be strings or all integers. After loading, every format
(``save_to_disk`` folders too) is checked for missing cells and float labels. Errors are
:class:`InputError` (a ``ValueError``): ``<file>:<line>: record <n>: <what>, column '<name>'``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["InputError", "check_loaded", "column_roles", "load_table", "model_folder_problem", "scan_table"]

_KINDS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}


class InputError(ValueError):
    """A problem with the user's data file, in one line naming the file, the line/record and the column."""


#: a Hugging Face hub id: ``name`` or ``namespace/name`` (letters, digits, ``-``, ``_``, ``.``; no leading ``.``/``-``)
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")


def model_folder_problem(model: str) -> str | None:
    """Why ``model`` names no model to load, or ``None``: an existing folder, or a hub id that is no path here
    (``name`` / ``namespace/name``: transformers looks it up), is left to transformers."""
    path = Path(model).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return "is a file, not a model folder (give the folder holding config.json and the weights)"
    if _HUB_ID.fullmatch(model) and ".." not in model and not model.endswith("."):
        return None
    return "no such folder (give the folder holding config.json and the weights, or a Hugging Face hub id)"


def load_table(path: str | Path) -> Any:
    """A ``datasets.Dataset`` (or ``DatasetDict``) from a CSV / JSON Lines file or a ``save_to_disk`` folder."""
    import datasets

    p = Path(path)
    if p.is_dir():
        return datasets.load_from_disk(str(p))
    kind = _kind(p)
    extra = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(kind, data_files=str(p), split="train", **extra)
    except Exception as err:  # noqa: BLE001 - the loader's errors are multi-line tracebacks of pandas/pyarrow
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(f"{p}: cannot be read as {kind}: {type(err).__name__}: {first}") from err


def _kind(p: Path) -> str:
    if not p.is_file():
        raise FileNotFoundError(f"no data file or saved dataset folder at {p}")
    kind = _KINDS.get(p.suffix.lower())
    if kind is None:
        raise InputError(f"{p}: expected .csv, .tsv, .json or .jsonl, or a folder written by datasets.save_to_disk")
    return kind


def column_roles(text: str, label: str, group: str = "") -> dict[str, str]:
    """``{role: column}`` for the run's columns; the text and label columns must differ."""
    if text == label:
        raise InputError(f"--text-column and --label-column are both {text!r}: the label must be its own column")
    return {"text": text, "label": label, **({"group": group} if group else {})}


def scan_table(path: str | Path, columns: Mapping[str, str]) -> None:
    """Check a CSV/TSV/JSONL file record by record before loading; ``columns`` maps a role (``text``,
    ``label``, ``group``) to its column name. Folders are checked after loading (:func:`check_loaded`)."""
    p = Path(path)
    if p.is_dir():
        return
    if _kind(p) == "csv":
        _scan_csv(p, "\t" if p.suffix.lower() == ".tsv" else ",", columns)
    else:
        _scan_json(p, columns)


@contextlib.contextmanager
def _no_field_limit() -> Iterator[None]:
    old = csv.field_size_limit(sys.maxsize)  # the default (131,072 chars) is no limit pandas has
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _scan_csv(p: Path, delim: str, columns: Mapping[str, str]) -> None:
    line, record, header = 1, 0, []
    try:
        with _no_field_limit(), p.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter=delim, strict=True)
            header = next(reader, [])
            if not header:
                raise InputError(f"{p}: empty file (expected a header row naming the columns)")
            _check_unique_header(p, header)
            where = {role: _header_index(p, header, role, col) for role, col in columns.items()}
            line = reader.line_num + 1
            for row in reader:
                if row:  # blank lines are skipped, as pandas does
                    record += 1
                    _check_csv_row(p, line, record, row, header, where)
                line = reader.line_num + 1
    except csv.Error as err:
        raise InputError(f"{p}:{line}: record {record + 1}: {err}{_quote_column(p, line, delim, header)}") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{p}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None


def _check_unique_header(p: Path, header: list[str]) -> None:
    first: dict[str, int] = {}
    for i, name in enumerate(header, 1):
        if name in first:
            raise InputError(
                f"{p}:1: column {name!r} is named twice in the header (fields {first[name]} and {i}); rename one "
                "(pandas would silently read only the first)"
            )
        first[name] = i


class _DuplicateField(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: a dict, or :class:`_DuplicateField` for a field named twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateField(k)
        out[k] = v
    return out


def _header_index(p: Path, header: list[str], role: str, col: str) -> int:
    if col not in header:
        raise InputError(f"{p}:1: column {col!r} (--{role}-column) not in the header {header}")
    return header.index(col)


def _check_csv_row(p: Path, line: int, record: int, row: list[str], header: list[str], where: dict) -> None:
    if len(row) < len(header):
        missing = ", ".join(repr(c) for c in header[len(row) :])
        raise InputError(
            f"{p}:{line}: record {record} has {len(row)} of the header's {len(header)} fields: "
            f"no cell for column(s) {missing}"
        )
    if len(row) > len(header):
        raise InputError(
            f"{p}:{line}: record {record} has {len(row)} fields, the header {len(header)}: field "
            f"{len(header) + 1} is past the last column {header[-1]!r} (unquoted delimiter?)"
        )
    for role, i in where.items():
        if role != "group" and not row[i].strip():
            raise InputError(f"{p}:{line}: record {record}: empty {role} cell, column {header[i]!r}")


def _quote_column(p: Path, line: int, delim: str, header: list[str]) -> str:
    """`` in column '<name>' (a quote opened there never closes)`` for the record starting at ``line``."""
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        text = "".join(row for n, row in enumerate(f, 1) if n >= line)
    field, quoted, opened, i = 0, False, None, 0
    while i < len(text):
        ch = text[i]
        if quoted and ch == '"' and text[i + 1 : i + 2] == '"':
            i += 1  # an escaped quote
        elif ch == '"':
            quoted, opened = not quoted, field if not quoted else opened
        elif not quoted and ch == delim:
            field += 1
        elif not quoted and ch == "\n":
            break
        i += 1
    if not quoted or opened is None:
        return ""
    name = repr(header[opened]) if opened < len(header) else f"field {opened + 1}"
    return f", column {name} (a quote opened there never closes)"


def _scan_json(p: Path, columns: Mapping[str, str]) -> None:
    first_kind: str | None = None
    record = 0
    with p.open(encoding="utf-8", errors="strict") as f:
        try:
            lines = enumerate(f, 1)
            for line, raw in lines:
                if not raw.strip():
                    continue
                record += 1
                first_kind = _check_json_record(p, line, record, raw, columns, first_kind)
        except UnicodeDecodeError as err:
            raise InputError(f"{p}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None


def _check_json_record(p: Path, line: int, record: int, raw: str, columns: Mapping[str, str], first: str | None) -> str:
    at = f"{p}:{line}: record {record}"
    try:
        rec = json.loads(raw, object_pairs_hook=_unique_object)
    except json.JSONDecodeError as err:
        raise InputError(
            f"{at}: invalid JSON ({err.msg} at character {err.colno}); expected one JSON object per line"
        ) from None
    except _DuplicateField as err:
        raise InputError(f"{at}: field {err.name!r} twice in one object (json would silently keep the last)") from None
    if not isinstance(rec, dict):
        raise InputError(f"{at}: a JSON {type(rec).__name__}, expected an object with the columns {dict(columns)}")
    for role, col in columns.items():
        if col not in rec:
            raise InputError(f"{at}: no {col!r} field ({role} column); its fields are {sorted(rec)[:8]}")
    text, label = rec[columns["text"]], rec[columns["label"]]
    if not isinstance(text, str) or not text.strip():
        what = "empty" if text in (None, "") or isinstance(text, str) else f"a {type(text).__name__}, not a string"
        raise InputError(f"{at}: {what} text cell, column {columns['text']!r}")
    kind = _label_kind(at, label, columns["label"])
    if first is not None and kind != first:
        raise InputError(f"{at}: label {label!r} is {kind} but record 1's is {first}, column {columns['label']!r}")
    return kind


def _label_kind(at: str, label: Any, col: str) -> str:
    if label is None or (isinstance(label, str) and not label.strip()):
        raise InputError(f"{at}: empty label cell, column {col!r}")
    if isinstance(label, str):
        return "a string"
    if isinstance(label, int) and not isinstance(label, bool):
        return "an integer"
    raise InputError(
        f"{at}: label {label!r} in column {col!r} is a {type(label).__name__}; labels must be integers or strings"
    )


def check_loaded(ds: Any, where: str, columns: Mapping[str, str]) -> None:
    """After loading (any format): no missing/empty text or label cell, no float labels. ``ds`` has the
    user's column names; ``where`` names the file (and split) in the message."""
    for role in ("text", "label"):
        col = columns[role]
        for i, v in enumerate(ds[col], 1):
            if v is None or (isinstance(v, str) and not v.strip()):
                raise InputError(
                    f"{where}: record {i}: empty or missing {role} cell, column {col!r} (pandas also "
                    "reads NA, N/A, null and nan cells as missing)"
                )
    dtype = str(getattr(ds.features[columns["label"]], "dtype", ""))
    if dtype.startswith("float"):
        values = ds[columns["label"]]
        i = next((n for n, v in enumerate(values, 1) if not float(v).is_integer()), 1)
        raise InputError(
            f"{where}: record {i}: label {values[i - 1]!r}, column {columns['label']!r} holds floats; "
            "labels must be integers or strings (write 1, not 1.0)"
        )
