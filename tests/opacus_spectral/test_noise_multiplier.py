"""``noise_multiplier_for``: Opacus' calibration, validated once, searched once per distinct argument tuple."""

from __future__ import annotations

import opacus.accountants.utils as opacus_utils
import pytest

from opacus_spectral import noise_multiplier as nm

noise_multiplier_for = nm.noise_multiplier_for

CASE = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1, steps=20)
COARSE = dict(accountant="rdp", epsilon_tolerance=0.5)  # a short bisection: these tests count searches


@pytest.fixture
def counted(monkeypatch) -> list[dict]:
    """Every call that reaches Opacus' search, with a cold cache (and the cache left cold afterwards)."""
    calls: list[dict] = []
    search = opacus_utils.get_noise_multiplier

    def counting(**kwargs):
        calls.append(kwargs)
        return search(**kwargs)

    monkeypatch.setattr(opacus_utils, "get_noise_multiplier", counting)
    nm._search.cache_clear()
    yield calls
    nm._search.cache_clear()


def test_is_opacus_calibration() -> None:
    ours = noise_multiplier_for(**CASE, accountant="rdp")
    assert ours == opacus_utils.get_noise_multiplier(**CASE, accountant="rdp", epsilon_tolerance=0.01)


def test_the_search_runs_once_per_distinct_arguments(counted: list[dict]) -> None:
    first = noise_multiplier_for(**CASE, **COARSE)
    # the same budget spelled with ints is the same calibration
    again = noise_multiplier_for(**{**CASE, "target_epsilon": 3}, **COARSE)
    assert again == first and len(counted) == 1
    assert counted[0] == dict(**CASE, **COARSE)
    for change in (dict(steps=21), dict(sample_rate=0.11), dict(target_delta=1e-6), dict(target_epsilon=3.5)):
        noise_multiplier_for(**{**CASE, **change}, **COARSE)
    noise_multiplier_for(**CASE, accountant="rdp", epsilon_tolerance=0.6)
    assert len(counted) == 6


@pytest.mark.parametrize(
    "change",
    [
        dict(target_epsilon=0),
        dict(target_epsilon=float("inf")),
        dict(target_epsilon="3"),
        dict(target_delta=0),
        dict(target_delta=1),
        dict(sample_rate=0),
        dict(sample_rate=1.5),
        dict(steps=0),
        dict(steps=2.5),
        dict(steps=True),
    ],
)
def test_bad_arguments_are_refused_before_any_search(counted: list[dict], change: dict) -> None:
    with pytest.raises(ValueError):
        noise_multiplier_for(**{**CASE, **change})
    assert counted == []
