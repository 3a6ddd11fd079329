"""Cyclic Poisson sampling and the BandMF mechanism on their own (opacus_spectral.mechanisms): each record is sampled
only at the steps of its group and at rate p, the partition is a function of its seed alone, the mechanism's
accounting is DP-SGD with (σ, b·q) charged every b steps, and its declared noise std is the released one."""

from __future__ import annotations

import math

import pytest
import torch
from opacus_spectral.mechanisms.bandmf import BandMFMechanism
from opacus_spectral.mechanisms.base import GaussianMechanism
from opacus_spectral.mechanisms.cyclic import CyclicPoissonSampler, group_labels, partition
from opacus_spectral.mechanisms.realization import realize
from opacus_spectral.mechanisms.strategy import Accounting


def test_each_record_is_sampled_only_at_its_groups_steps_and_at_rate_p():
    n, groups, p, steps = 60, 3, 0.4, 600
    sampler = CyclicPoissonSampler(
        num_samples=n,
        groups=groups,
        sample_rate=p,
        steps_per_epoch=steps,
        partition_seed=5,
        generator=torch.Generator().manual_seed(1),
    )
    group_of = {int(i): g for g, part in enumerate(partition(n, groups, 5)) for i in part}
    counts = torch.zeros(n)
    for t, batch in enumerate(sampler):
        assert all(group_of[i] == t % groups for i in batch)
        counts[batch] += 1
    per_record = counts / (steps / groups)  # each record's group came up steps / groups times
    assert abs(float(per_record.mean()) - p) < 0.02  # 60 × 200 Bernoulli draws: std of the mean ≈ 0.0045
    assert sorted(torch.cat(partition(n, groups, 5)).tolist()) == list(range(n))  # each record in exactly one group


def test_each_records_group_is_independent_of_the_others_and_of_n():
    """Add/remove adjacency: adding a record regroups no other (an equal split of a permutation of N would), and the
    groups are i.i.d. uniform: 4 groups of 200,000 records, each count within 5 s.d. of 50,000 (s.d. 194), and the
    pair (group of i, group of i + 1) uniform on the 16 pairs (chi-square, 15 degrees of freedom, below its 0.999
    quantile 37.7)."""
    n, b = 200_000, 4
    labels = group_labels(n + 1, b, seed=3)
    assert torch.equal(labels[:n], group_labels(n, b, seed=3))  # across the chunks of 65,536 records
    assert torch.equal(labels[: n // 2], group_labels(n // 2, b, seed=3))
    counts = torch.bincount(labels[:n], minlength=b).double()
    assert torch.all((counts - n / b).abs() < 5 * math.sqrt(n * (1 / b) * (1 - 1 / b)))
    pairs = torch.bincount(labels[:-1] * b + labels[1:], minlength=b * b).double()
    expected = n / (b * b)
    assert float(((pairs - expected) ** 2 / expected).sum()) < 37.7
    parts = partition(n, b, seed=3)
    assert all(torch.equal(part, torch.nonzero(labels[:n] == g).flatten()) for g, part in enumerate(parts))
    assert not torch.equal(group_labels(n, b, seed=4), labels[:n])


def test_the_partition_is_a_function_of_its_seed_and_a_resume_continues_the_cycle():
    a = partition(50, 4, seed=9)
    assert all(torch.equal(x, y) for x, y in zip(a, partition(50, 4, seed=9), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, partition(50, 4, seed=10), strict=True))
    sampler = CyclicPoissonSampler(num_samples=50, groups=4, sample_rate=1.0, steps_per_epoch=3, partition_seed=9)
    sampler.step = 6  # a run resumed after 6 steps: the next group is 6 mod 4 = 2
    assert [sorted(b) for b in sampler] == [sorted(a[g].tolist()) for g in (2, 3, 0)]


def test_bandmf_accounting_is_dp_sgd_with_b_times_the_rate_every_b_steps():
    acc = realize(BandMFMechanism(bands=4), steps=10, sample_rate=0.05, dataset_size=1000).accounting(1.3, 0.05)
    assert acc == Accounting(1.3, 0.2, 4)
    assert sum(acc.charge(t) for t in range(10)) == math.ceil(10 / 4)
    gaussian = realize(GaussianMechanism(), steps=None, sample_rate=0.05, dataset_size=1000)
    assert gaussian.accounting(1.3, 0.05) == Accounting(1.3, 0.05, 1)


def test_bandmf_refuses_what_it_cannot_account():
    with pytest.raises(ValueError, match="exceeds the run's 3 steps"):
        realize(BandMFMechanism(bands=4), steps=3, sample_rate=0.01, dataset_size=100)
    with pytest.raises(ValueError, match="exceeds 1"):
        realize(BandMFMechanism(bands=8), steps=100, sample_rate=0.25, dataset_size=100)
    with pytest.raises(ValueError, match="needs the run's length"):
        realize(BandMFMechanism(bands=2), steps=None, sample_rate=0.01, dataset_size=100)
    with pytest.raises(ValueError, match="bands must be"):
        BandMFMechanism(bands=0)


def test_the_declared_std_is_the_released_noise_std_at_every_step_and_restarts_on_reset():
    mech = realize(BandMFMechanism(bands=3), steps=6, sample_rate=0.01, dataset_size=1000)
    g = torch.Generator().manual_seed(0)
    for _restart in range(2):
        for _ in range(6):
            declared = mech.std_factor()
            x = mech.noise("w", torch.randn(200_000, generator=g, dtype=torch.float64))
            mech.end_step()
            assert float(x.std()) == pytest.approx(declared, rel=0.01)
        assert mech.std_factor() == pytest.approx(declared, rel=1e-3)  # beyond T: the rows converge
        assert mech.buffer_bytes() == (3 - 1) * 200_000 * 8  # b − 1 float64 buffers of the one tensor
        mech.reset()
        assert mech.std_factor() == pytest.approx(1 / mech.coefficients[0])
    one = realize(BandMFMechanism(bands=1), steps=5, sample_rate=0.01, dataset_size=1000)
    z = torch.randn(4)
    assert one.noise("w", z) is z and one.std_factor() == 1.0
