"""``noise_multiplier_for``: Opacus' calibration, validated once, searched once per distinct argument tuple; and
``epsilon_from_history``, its inverse, evaluated once per distinct history."""

from __future__ import annotations

import opacus.accountants.utils as opacus_utils
import pytest
from opacus_spectral.accounting import calibration as nm
from opacus_spectral.errors import ApproximateEpsilonWarning

noise_multiplier_for = nm.noise_multiplier_for

CASE = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1, steps=20)
COARSE = dict(accountant="rdp", epsilon_tolerance=0.5)  # a short bisection: these tests count searches


@pytest.fixture
def searches():
    """The number of searches run since the fixture started, with a cold cache (and the cache left cold afterwards)."""
    nm._search.cache_clear()
    yield lambda: nm._search.cache_info().misses
    nm._search.cache_clear()


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_is_opacus_calibration(accountant: str) -> None:
    """The same search as Opacus' get_noise_multiplier, so the same σ (bounded: test_accounting_calibration.py)."""
    ours = noise_multiplier_for(**CASE, accountant=accountant)
    assert ours == opacus_utils.get_noise_multiplier(**CASE, accountant=accountant, epsilon_tolerance=0.01)


def test_the_search_runs_once_per_distinct_arguments(searches) -> None:
    first = noise_multiplier_for(**CASE, **COARSE)
    # the same budget spelled with ints is the same calibration
    again = noise_multiplier_for(**{**CASE, "target_epsilon": 3}, **COARSE)
    assert again == first and searches() == 1
    for change in (dict(steps=21), dict(sample_rate=0.11), dict(target_delta=1e-6), dict(target_epsilon=3.5)):
        noise_multiplier_for(**{**CASE, **change}, **COARSE)
    noise_multiplier_for(**CASE, accountant="rdp", epsilon_tolerance=0.6)
    assert searches() == 6


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
        dict(epsilon_tolerance=0.0),
        dict(epsilon_tolerance=-0.01),
        dict(epsilon_tolerance=float("nan")),
        dict(accountant="gdp"),
        dict(accountant="moments"),
    ],
)
def test_bad_arguments_are_refused_before_any_search(searches, change: dict) -> None:
    with pytest.raises(ValueError):
        noise_multiplier_for(**{**CASE, **change})
    assert searches() == 0


# --- epsilon_from_history: the inverse, one accountant evaluation per distinct history -------------------------

HISTORY = [(1.1, 0.01, 40), (0.9, 0.02, 10)]


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_epsilon_is_a_fresh_opacus_accountants(accountant: str) -> None:
    from opacus.accountants import create_accountant

    history = HISTORY if accountant != "gdp" else HISTORY[:1]  # gdp reads one (σ, q): below
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    if accountant == "gdp":
        with pytest.warns(ApproximateEpsilonWarning, match="approximation, not an upper bound"):
            ours = nm.epsilon_from_history(history, 1e-5, accountant)
    else:
        ours = nm.epsilon_from_history(history, 1e-5, accountant)
    assert ours == float(acc.get_epsilon(1e-5))  # bit for bit


def test_a_gdp_history_of_several_settings_is_refused() -> None:
    """Opacus' gdp accountant reads only the last entry: the first 40 steps would vanish from ε."""
    from opacus.accountants import create_accountant

    both, last = create_accountant(mechanism="gdp"), create_accountant(mechanism="gdp")
    both.history, last.history = list(HISTORY), list(HISTORY[1:])
    assert both.get_epsilon(1e-5) == last.get_epsilon(1e-5)  # upstream: the 40 steps at σ = 1.1 spend nothing
    with pytest.raises(ValueError, match="reads only the last"):
        nm.epsilon_from_history(HISTORY, 1e-5, "gdp")


def test_epsilon_is_evaluated_once_per_distinct_history(monkeypatch) -> None:
    from opacus.accountants import RDPAccountant

    calls: list[list] = []
    original = RDPAccountant.get_epsilon

    def counting(self, delta, **kwargs):
        calls.append(list(self.history))
        return original(self, delta, **kwargs)

    monkeypatch.setattr(RDPAccountant, "get_epsilon", counting)
    nm._epsilon.cache_clear()
    try:
        first = nm.epsilon_from_history([(1, 0.01, 40)], 1e-5, "rdp")
        assert nm.epsilon_from_history([(1.0, 0.01, 40.0)], 1e-5, "rdp") == first  # the same history spelled otherwise
        assert len(calls) == 1 and calls[0] == [(1.0, 0.01, 40)]
        nm.epsilon_from_history([(1.0, 0.01, 41)], 1e-5, "rdp")
        nm.epsilon_from_history([(1.0, 0.01, 40)], 1e-6, "rdp")
        assert len(calls) == 3
        assert nm.epsilon_from_history([(1.0, 0.01, 41)], 1e-5, "rdp") > first  # more steps spend more
    finally:
        nm._epsilon.cache_clear()


def test_epsilon_of_nothing_and_of_a_step_without_noise() -> None:
    assert nm.epsilon_from_history([], 1e-5) == 0.0
    assert nm.epsilon_from_history([(1.0, 0.01, 5), (0.0, 0.01, 1)], 1e-5) == float("inf")


@pytest.mark.parametrize(
    "history, delta, accountant",
    [
        (HISTORY, 0.0, "prv"),
        (HISTORY, 1.0, "prv"),
        (HISTORY, 1e-5, "moments"),
        ([(-1.0, 0.01, 5)], 1e-5, "prv"),
        ([(float("nan"), 0.01, 5)], 1e-5, "prv"),
        ([(1.0, 0.0, 5)], 1e-5, "prv"),
        ([(1.0, 1.5, 5)], 1e-5, "prv"),
        ([(1.0, 0.01, 0)], 1e-5, "prv"),
        ([(1.0, 0.01, 2.5)], 1e-5, "prv"),  # not truncated to 2 steps (that would under-count ε)
        ([(1.0, 0.01, float("inf"))], 1e-5, "prv"),
    ],
)
def test_bad_histories_are_refused(history, delta, accountant) -> None:
    with pytest.raises(ValueError):
        nm.epsilon_from_history(history, delta, accountant)
