"""Partitioning: disjoint, covering, reproducible, skewed as alpha says, group-pure."""

from __future__ import annotations

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from peft_lalora.federated.data.partition import (  # noqa: E402
    PartitionError,
    dirichlet_partition,
    group_partition,
    iid_partition,
    label_histograms,
    label_skew,
    partition_dataset,
)


def _dataset(n: int = 2000, classes: int = 10, groups: int = 40, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict(
        {
            "x": rng.normal(size=n).tolist(),
            "label": rng.integers(0, classes, size=n).tolist(),
            "movie": [f"m{g:02d}" for g in rng.integers(0, groups, size=n)],
        }
    )


def _check_exact_cover(part, n):
    allidx = np.concatenate(part.indices)
    assert len(allidx) == n, "indices must cover every row exactly once"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "partition must be disjoint and cover the data"


@pytest.mark.parametrize(
    "make",
    [
        lambda ds, s: dirichlet_partition(ds, 8, 0.3, seed=s),
        lambda ds, s: iid_partition(ds, 8, seed=s),
        lambda ds, s: group_partition(ds, "movie", 8, seed=s),
    ],
    ids=["dirichlet", "iid", "group"],
)
def test_disjoint_cover_reproducible(make):
    ds = _dataset()
    a, b, c = make(ds, 3), make(ds, 3), make(ds, 4)
    _check_exact_cover(a, ds.num_rows)
    assert a.num_clients == 8
    assert all(np.array_equal(x, y) for x, y in zip(a.indices, b.indices, strict=True)), "same seed, same split"
    assert any(not np.array_equal(x, y) for x, y in zip(a.indices, c.indices, strict=True)), "another seed must differ"
    # histograms match the rows they describe
    labels = np.asarray(ds["label"])
    for i, ix in enumerate(a.indices):
        assert a.label_histograms[i].sum() == len(ix)
        assert a.label_histograms[i][3] == int((labels[ix] == 3).sum())
    sub = a.client_dataset(ds, 2)
    assert sub["label"] == labels[a.indices[2]].tolist()


def test_skew_follows_alpha():
    ds = _dataset(n=4000)
    skews = {
        alpha: label_skew(dirichlet_partition(ds, 10, alpha, seed=1).label_histograms) for alpha in (0.05, 1.0, 1000.0)
    }
    assert skews[0.05] > skews[1.0] > skews[1000.0]
    assert skews[0.05] > 0.6  # near one-class clients
    assert skews[1000.0] < 0.08  # near IID: local label mix within a few % of the pooled one
    iid = label_skew(iid_partition(ds, 10, seed=1).label_histograms)
    assert iid < 0.1
    # small alpha: the typical client is dominated by its top class
    h = dirichlet_partition(ds, 10, 0.05, seed=1).label_histograms
    top_share = (h.max(axis=1) / np.maximum(h.sum(axis=1), 1)).mean()
    assert top_share > 0.6


def test_iid_sizes_balanced():
    part = iid_partition(_dataset(n=1003), 4, seed=0)
    assert sorted(part.sizes) == [250, 251, 251, 251]


def test_group_partition_keeps_groups_whole_and_balances():
    ds = _dataset(n=3000, groups=30)
    part = group_partition(ds, "movie", 6, seed=5)
    movies = np.asarray(ds["movie"])
    owners = {}
    for c, ix in enumerate(part.indices):
        for m in set(movies[ix].tolist()):
            assert m not in owners, f"group {m} split across clients {owners.get(m)} and {c}"
            owners[m] = c
        assert sorted(set(movies[ix].tolist())) == part.groups[c]
    assert len(owners) == 30
    # LPT packing: max load within the largest group size of the mean
    _, counts = np.unique(movies, return_counts=True)
    assert max(part.sizes) - 3000 / 6 <= counts.max()


def test_group_partition_one_client_per_group():
    ds = _dataset(n=500, groups=7)
    part = group_partition(ds, "movie", None)
    _check_exact_cover(part, 500)
    assert part.num_clients == 7
    movies = np.asarray(ds["movie"])
    for c, ix in enumerate(part.indices):
        assert set(movies[ix].tolist()) == set(part.groups[c]) and len(part.groups[c]) == 1


def test_label_histograms_exact():
    classes, hist = label_histograms(["b", "a", "b", "c"], [np.array([0, 1]), np.array([2, 3])])
    assert classes == ["a", "b", "c"]
    assert hist.tolist() == [[1, 1, 0], [0, 1, 1]]
    assert label_skew(np.array([[2, 0], [0, 2]])) == pytest.approx(0.5)
    assert label_skew(np.array([[1, 1], [2, 2]])) == pytest.approx(0.0)


def test_summary_is_json_ready():
    import json

    s = dirichlet_partition(_dataset(n=300), 3, 0.5, seed=0).summary()
    assert json.loads(json.dumps(s))["num_clients"] == 3
    assert sum(map(sum, s["label_histograms"])) == 300


def test_bad_arguments():
    ds = _dataset(n=50)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(ds, 3, 0.0)
    with pytest.raises(ValueError, match="num_clients"):
        iid_partition(ds, 0)
    with pytest.raises(PartitionError, match="num_clients=51: more clients than the 50 training rows"):
        iid_partition(ds, 51)
    with pytest.raises(ValueError, match="column"):
        group_partition(ds, "nope", 2)
    with pytest.raises(PartitionError, match="distinct"):
        group_partition(ds, "movie", 41)
    with pytest.raises(ValueError, match="scheme"):
        partition_dataset(ds, 2, scheme="pathological")
