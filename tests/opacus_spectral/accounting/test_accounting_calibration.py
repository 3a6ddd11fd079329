"""Accounting calls that fail fast, and calibrations only to upper bounds (issue 39, findings 1-2).

Before: ``noise_multiplier_for(target_epsilon=1000)`` with PRV never returned (Opacus' bisection chases an ε the
accountant cannot reach), a tolerance <= 0 never ended the search, ``epsilon_from_history`` hung on σ = inf and
raised a raw ``ZeroDivisionError`` at σ = 1e-300, and ``accountant="gdp"`` (Opacus' CLT approximation) calibrated a
σ whose history PRV bounds at nearly three times the target. The calls that used to hang run in a thread joined
with a deadline, so this module fails (instead of hanging) on code that hangs.
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import pytest
from opacus.accountants.utils import get_noise_multiplier
from opacus_spectral.accounting import calibration as nm
from opacus_spectral.errors import LargeNoiseWarning

DEADLINE_S = 120  # all cases together; after the fix they take about a second
F, E = nm.noise_multiplier_for, nm.epsilon_from_history
CASES = {
    "target epsilon 1000": lambda: F(target_epsilon=1000, target_delta=1e-5, sample_rate=1.0, steps=1),
    "tolerance 0": lambda: F(target_epsilon=3, target_delta=1e-5, sample_rate=0.1, steps=20, epsilon_tolerance=0),
    "tolerance -0.01": lambda: F(
        target_epsilon=3, target_delta=1e-5, sample_rate=0.1, steps=20, epsilon_tolerance=-0.01
    ),
    "sigma inf": lambda: E([(math.inf, 0.01, 40)], 1e-5),
    "sigma inf beside a finite one": lambda: E([(1.0, 0.01, 40), (math.inf, 0.01, 5)], 1e-5),
    "sigma 1e-300 prv": lambda: E([(1e-300, 0.01, 40)], 1e-5),
    "sigma 1e-300 rdp": lambda: E([(1e-300, 0.01, 40)], 1e-5, "rdp"),
    "sigma 1e-3 prv": lambda: E([(1e-3, 0.01, 40)], 1e-5),  # PRV's grid: 9e10 points (memory)
    "sigma 0.02 prv": lambda: E([(0.02, 0.01, 40)], 1e-5),  # PRV: a RuntimeError after about a minute
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[str]]:
    """Each case's [outcome, text], run in a daemon thread joined for at most DEADLINE_S: a case that did not
    finish by then is absent (the thread of a hung call dies with the test process)."""
    done: dict[str, list[str]] = {}

    def run() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, call in CASES.items():
                try:
                    done[name] = ["ok", repr(call())]
                except Exception as err:  # noqa: BLE001 - the kind of error is what is checked
                    done[name] = [type(err).__name__, str(err)]

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(DEADLINE_S)
    return dict(done)


def _outcome(outcomes: dict[str, list[str]], case: str) -> list[str]:
    if case not in outcomes:
        pytest.fail(f"{case}: did not return within {DEADLINE_S} s (a hang)")
    return outcomes[case]


def test_a_target_beyond_the_calibrations_range_is_refused(outcomes) -> None:
    kind, text = _outcome(outcomes, "target epsilon 1000")
    assert kind == "ValueError"
    assert "outside the calibration's range" in text and "0.1" in text and "noise_multiplier" in text


@pytest.mark.parametrize("case", ["tolerance 0", "tolerance -0.01"])
def test_a_tolerance_that_cannot_end_the_search_is_refused(outcomes, case) -> None:
    kind, text = _outcome(outcomes, case)
    assert kind == "ValueError" and "epsilon_tolerance must be a finite number > 0" in text


def test_infinite_noise_spends_nothing(outcomes) -> None:
    assert _outcome(outcomes, "sigma inf") == ["ok", "0.0"]
    alone = nm.epsilon_from_history([(1.0, 0.01, 40)], 1e-5)
    assert _outcome(outcomes, "sigma inf beside a finite one") == ["ok", repr(alone)]


@pytest.mark.parametrize("case", ["sigma 1e-300 prv", "sigma 1e-300 rdp"])
def test_vanishing_noise_is_infinite_epsilon_not_an_error(outcomes, case) -> None:
    assert _outcome(outcomes, case) == ["ok", "inf"]


def test_small_noise_beyond_prvs_grid_gets_the_rdp_bound(outcomes) -> None:
    """σ too small for PRV's discretization: the RDP bound (also an upper bound), never a finite under-estimate."""
    for case, sigma in (("sigma 1e-3 prv", 1e-3), ("sigma 0.02 prv", 0.02)):
        kind, value = _outcome(outcomes, case)
        assert kind == "ok" and float(value) == nm.epsilon_from_history([(sigma, 0.01, 40)], 1e-5, "rdp")
    # ε never falls as σ falls: from PRV's range into RDP's and on to ∞
    eps = [nm.epsilon_from_history([(s, 0.01, 40)], 1e-5) for s in (1.0, 0.5, 0.3)]
    eps += [float(_outcome(outcomes, c)[1]) for c in ("sigma 0.02 prv", "sigma 1e-3 prv", "sigma 1e-300 prv")]
    assert eps == sorted(eps) and eps[-1] == math.inf


def test_the_smallest_noise_the_search_returns_is_its_floor() -> None:
    """A target ε just reachable above σ = 0.1 is calibrated; ε(σ=0.1) itself is the range's end."""
    top = nm.epsilon_from_history([(nm.SIGMA_MIN, 1.0, 1)], 1e-5)
    assert top == pytest.approx(91.83, abs=0.01)  # one full-batch step at σ = 0.1
    sigma = nm.noise_multiplier_for(target_epsilon=top * 0.9, target_delta=1e-5, sample_rate=1.0, steps=1)
    assert nm.SIGMA_MIN < sigma < 0.2
    assert nm.epsilon_from_history([(sigma, 1.0, 1)], 1e-5) <= top * 0.9


# --- gdp: an approximation, never a calibration target ------------------------------------------------------


def test_gdp_calibrates_a_sigma_whose_true_epsilon_is_far_above_the_target() -> None:
    """Why gdp is refused for calibration: Opacus' gdp σ for ε = 2 (q = 0.01, 40 steps) is 0.491; PRV bounds that
    history at 5.67 and RDP at 7.14."""
    sigma = get_noise_multiplier(target_epsilon=2, target_delta=1e-5, sample_rate=0.01, steps=40, accountant="gdp")
    assert sigma == pytest.approx(0.491, abs=1e-3)
    assert nm.epsilon_from_history([(sigma, 0.01, 40)], 1e-5, "prv") == pytest.approx(5.67, abs=0.01)
    assert nm.epsilon_from_history([(sigma, 0.01, 40)], 1e-5, "rdp") == pytest.approx(7.14, abs=0.01)


def test_noise_multiplier_for_refuses_gdp() -> None:
    with pytest.raises(ValueError, match="approximation, not an upper bound.*'prv'"):
        nm.noise_multiplier_for(target_epsilon=2, target_delta=1e-5, sample_rate=0.01, steps=40, accountant="gdp")


# --- the ends of the range: an absurd σ warns, a target beyond it says what it found ------------------------------


def test_a_calibrated_sigma_above_100_warns_what_the_noise_does() -> None:
    """ε = 0.01 in one full-batch step needs σ = 2,560: noise std σ·C/B per coordinate swamps any batch below σ."""
    with pytest.warns(LargeNoiseWarning, match=r"σ = 2560 .*above 100.*σ·C/B.*2,560 records") as caught:
        sigma = nm.noise_multiplier_for(target_epsilon=0.01, target_delta=1e-5, sample_rate=1.0, steps=1)
    assert sigma == 2560.0 and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeNoiseWarning)
        assert nm.noise_multiplier_for(target_epsilon=3, target_delta=1e-5, sample_rate=0.1, steps=20) < nm.SIGMA_LARGE


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_a_target_below_the_accountants_floor_reports_a_sigma_inside_the_range(accountant) -> None:
    """Before: "searched in [0.1, 1e+06], and σ = 1.311e+06 spends ε = 0.00999 ...: the budget is too small" — a σ
    outside the range it named, and a reason that was not the one (ε had stopped falling with σ)."""
    with pytest.raises(ValueError, match="outside the calibration's range") as err:
        nm.noise_multiplier_for(
            target_epsilon=1e-4, target_delta=1e-5, sample_rate=0.01, steps=100, accountant=accountant
        )
    text = str(err.value)
    sigmas = [float(x) for x in re.findall(r"σ = ([0-9.e+-]+) spends", text)]
    assert sigmas and all(nm.SIGMA_MIN <= x <= nm.MAX_SIGMA for x in sigmas) and nm.MAX_SIGMA in sigmas
    assert "floor" in text and "too small for this many steps" not in text
