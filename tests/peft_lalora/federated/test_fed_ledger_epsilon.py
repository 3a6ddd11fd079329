"""One ``epsilon_from_history``: the ledger's is opacus-spectral's when it is installed (default PRV, as the engine;
``gdp`` still refused for a federation), and a minimal fallback on a fresh Opacus accountant when it is not."""

from __future__ import annotations

import math
import sys

import pytest

pytest.importorskip("opacus")
from peft_lalora.federated.server import ledger  # noqa: E402

DELTA = 1e-5
HISTORIES = ([(1.1, 0.05, 40)], [(1.0, 0.1, 3), (2.0, 0.2, 5)], [(0.7, 0.01, 100)])


def test_the_default_accountant_is_prv_as_the_engine() -> None:
    from opacus_spectral.accounting import epsilon_from_history as library

    for history in HISTORIES:
        assert ledger.epsilon_from_history(history, DELTA) == library(history, DELTA, "prv")
        assert ledger.epsilon_from_history(history, DELTA, "rdp") == library(history, DELTA, "rdp")


def test_the_library_reads_infinite_and_zero_noise() -> None:
    """What the library defines and the ledger's own copy did not: infinite noise releases nothing, none has no
    finite guarantee."""
    pytest.importorskip("opacus_spectral")
    assert ledger.epsilon_from_history([(math.inf, 0.1, 3)], DELTA) == 0.0
    assert ledger.epsilon_from_history([(0.0, 0.1, 3)], DELTA, "rdp") == math.inf


def test_without_opacus_spectral_a_fresh_accountant_gives_the_same_epsilon(monkeypatch: pytest.MonkeyPatch) -> None:
    from opacus_spectral.accounting import epsilon_from_history as library

    expected = {(i, a): library(h, DELTA, a) for i, h in enumerate(HISTORIES) for a in ("prv", "rdp")}
    monkeypatch.setitem(sys.modules, "opacus_spectral.accounting", None)  # the import fails, as when not installed
    with pytest.raises(ImportError):
        from opacus_spectral.accounting import epsilon_from_history  # noqa: F401
    for (i, accountant), eps in expected.items():
        assert ledger.epsilon_from_history(HISTORIES[i], DELTA, accountant) == pytest.approx(eps, rel=1e-9)
    assert ledger.epsilon_from_history([], DELTA) == 0.0
    assert ledger.epsilon_from_history([(2.0, 0.01, 1)], 0.05, "rdp") == 0.0  # (0, δ)-DP, never negative
    with pytest.raises(ValueError, match="delta"):
        ledger.epsilon_from_history(HISTORIES[0], 0.0)
    with pytest.raises(ValueError, match="approximation, not an upper bound"):
        ledger.epsilon_from_history(HISTORIES[0], DELTA, "gdp")
