"""The federated task of the libraries' tests: ``task="fed_tiny:tiny"`` (``tests/`` on ``sys.path``).

The tiny random BERT on the synthetic trigger-token task (:mod:`text_support`): the same
:class:`~peft_lalora.federated.data.task.Task` as the harness's ``dp_bench.task:tiny`` without ``task_options``
(same name, splits, columns and base model; pinned by ``test_support_equivalence.py``), without importing the
harness. It takes no ``task_options``: the harness's options (frozen layers, validation splits, a fixed head) are
tested with the harness.

A Flower deployment rebuilds the task in every SuperNode and in the ServerApp: those processes inherit the
environment, so ``PYTHONPATH`` must name this folder there (pytest's ``pythonpath`` setting changes only
``sys.path`` of the pytest process).
"""

from __future__ import annotations

import json
from typing import Any

from peft_lalora.federated.data.task import Task
from text_support import synthetic_text_task, tiny_bert

__all__ = ["COLUMNS", "TEST_SEED_OFFSET", "tiny"]

COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "label")
#: the test split's seed is the run's seed plus this (disjoint from the training draw)
TEST_SEED_OFFSET = 10_007


def tiny(settings: Any) -> Task:
    """Task factory: ``n_train`` (0 = 512) training and ``n_test`` (0 = 256) test sequences of ``seq_len`` (0 = 16)
    tokens with ``num_labels`` (0 = 2) classes, seeded by ``seed``; the base model is ``tiny_bert(num_labels, seed)``.

    ``settings``: the run's task settings (``TaskSettings``, or a ``FederationConfig``): only those five fields and
    ``task_options`` (must be empty: ``""`` or ``"{}"``) are read.
    """
    if settings.task_options and json.loads(settings.task_options):
        raise ValueError(f"fed_tiny:tiny takes no task_options, got {settings.task_options!r}")
    labels, seq_len, seed = settings.num_labels or 2, settings.seq_len or 16, settings.seed
    n_train, n_test = settings.n_train or 512, settings.n_test or 256

    def train() -> Any:
        return synthetic_text_task(n_train, seq_len=seq_len, seed=seed, num_labels=labels)

    def test() -> Any:
        return synthetic_text_task(n_test, seq_len=seq_len, seed=seed + TEST_SEED_OFFSET, num_labels=labels)

    def model() -> Any:
        return tiny_bert(num_labels=labels, seed=seed)

    return Task("tiny[test]", train, test, labels, COLUMNS, model_factory=model)
