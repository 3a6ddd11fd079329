"""The harness's federated tasks through the library's builders: the real-data task partitions by group."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr_datasets")


def test_minilm_rt_task_partitions_by_movie():
    """The real-data task (packaged Rotten Tomatoes + MiniLM tokenizer): every movie on one client."""
    from dp_bench.data import DataUnavailableError
    from peft_lalora.federated.builders import build_partition, build_task
    from peft_lalora.federated.config import FederationConfig

    cfg = FederationConfig(
        task="dp_bench.task:minilm_rt", partition="group", num_clients=4, n_train=300, n_test=20, seq_len=32
    )
    try:
        task = build_task(cfg)
    except DataUnavailableError as err:
        pytest.skip(str(err))
    part = build_partition(cfg, task)
    cover = np.sort(np.concatenate(part.indices))
    assert np.array_equal(cover, np.arange(300)), "every row on exactly one client"
    movies = np.asarray(task.train.with_format(None)["movie_name"])
    seen: set[str] = set()
    for ix in part.indices:
        mine = set(movies[ix].tolist())
        assert not (mine & seen)
        seen |= mine
    assert task.train.with_format(None)["input_ids"][0].__len__() == 32
    assert task.columns[-1] == "label" and task.num_labels == 2
