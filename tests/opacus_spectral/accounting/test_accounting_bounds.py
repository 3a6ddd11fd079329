"""ε is an upper bound or an error (issue 39, findings 2-3): gdp is never calibrated to and is labelled an
approximation where it is reported; δ ≥ 1/N is refused; no ε is negative.

Before: ``make_private_with_epsilon`` and ``DPTrainer`` calibrated to gdp silently, δ = 1/N and above were accepted
(ε came out negative: -0.506 in DPTrainer at δ = 0.05), and ``get_epsilon`` returned the RDP accountant's negative
numbers as they were.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import loader, mlp
from opacus_spectral.accounting.calibration import epsilon_from_history
from opacus_spectral.errors import ApproximateEpsilonWarning
from opacus_spectral.hf.dp_trainer import DPTrainer
from trainer_support import adamw, args, dataset, lalora_model

from opacus_spectral import PrivacyEngine

N = 64  # the engine_helpers loader's records


def _private(engine: PrivacyEngine, n: int = N):
    model = mlp(hidden=16, d_out=4)
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0)
    return engine, common, loader(n, 16, d_out=4)


# --- gdp ------------------------------------------------------------------------------------------------------


def test_make_private_with_epsilon_refuses_gdp() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="gdp")
    engine, common, dl = _private(engine)
    with pytest.raises(ValueError, match="make_private_with_epsilon cannot use the gdp accountant.*approximation"):
        engine.make_private_with_epsilon(**common, data_loader=dl, target_epsilon=2.0, target_delta=1e-5, epochs=1)
    assert engine.accountant.history == []


def test_gdp_kept_for_reporting_warns_where_it_is_used() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="gdp")
    engine, common, dl = _private(engine)
    with pytest.warns(ApproximateEpsilonWarning, match="approximation, not an upper bound"):
        engine.make_private(**common, data_loader=dl, noise_multiplier=1.0)
    engine.accountant.history = [(1.0, 0.25, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a bound now: no warning at get_epsilon
        assert engine.get_epsilon(1e-5) == epsilon_from_history([(1.0, 0.25, 4)], 1e-5, "prv")
    # gdp alone would read only the last entry (and said 0.909 where PRV says 3.239): PRV's bound over all of them
    engine.accountant.history = [(1.0, 0.25, 4), (2.0, 0.25, 1)]
    assert engine.get_epsilon(1e-5) == epsilon_from_history([(1.0, 0.25, 4), (2.0, 0.25, 1)], 1e-5, "prv")


def _trainer(tmp_path, **kw) -> DPTrainer:
    model = lalora_model()
    dp = {"target_epsilon": None, "target_delta": 1e-5, "accountant": "rdp", **kw}
    return DPTrainer(
        model=model, args=args(tmp_path, max_steps=1, **dp), train_dataset=dataset(), optimizers=(adamw(model), None)
    )


def test_dptrainer_refuses_to_calibrate_to_gdp_and_labels_its_log(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = _trainer(tmp_path, accountant="gdp", target_epsilon=2.0)
    with pytest.raises(ValueError, match="target_epsilon .* cannot use the gdp accountant"):
        t.train()
    assert t.state.global_step == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = _trainer(tmp_path, accountant="gdp", noise_multiplier=1.0)
    with pytest.warns(ApproximateEpsilonWarning):
        t.train()
    logged = [r for r in t.state.log_history if "epsilon" in r]
    assert logged and all("epsilon_approximate" not in r for r in logged)  # the ε logged is PRV's bound
    assert logged[-1]["epsilon"] == pytest.approx(t.privacy_engine.get_epsilon(1e-5))


# --- δ < 1/N, ε >= 0 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1 / N, 0.05])
def test_make_private_with_epsilon_refuses_delta_of_one_over_n_or_more(delta: float) -> None:
    engine, common, dl = _private(PrivacyEngine(accountant="rdp"))
    with pytest.raises(
        ValueError, match=r"target_delta=.* is not below 1/N = 0.0156 for the N = 64 records.*1/\(10 N\)"
    ):
        engine.make_private_with_epsilon(**common, data_loader=dl, target_epsilon=2.0, target_delta=delta, epochs=1)


def test_get_epsilon_refuses_delta_of_one_over_n_once_the_dataset_is_known() -> None:
    engine, common, dl = _private(PrivacyEngine(accountant="rdp"))
    engine.make_private(**common, data_loader=dl, noise_multiplier=1.0)
    engine.accountant.history = [(1.0, 0.25, 4)]
    assert engine.get_epsilon(1e-5) > 0
    with pytest.raises(ValueError, match="is not below 1/N"):
        engine.get_epsilon(1 / N)


def test_dptrainer_refuses_delta_of_one_over_n(tmp_path) -> None:
    with pytest.raises(ValueError, match="target_delta=0.05 is not below 1/N = 0.0156 for the N = 64 records"):
        _trainer(tmp_path, target_epsilon=3.0, target_delta=0.05)


def test_no_negative_epsilon() -> None:
    """RDP's conversion gives ε = -0.051 for one step of σ = 2 at q = 0.01 and δ = 0.05: that is (0, δ)-DP."""
    from opacus.accountants import RDPAccountant

    raw = RDPAccountant()
    raw.history = [(2.0, 0.01, 1)]
    assert raw.get_epsilon(0.05) == pytest.approx(-0.051, abs=1e-3)
    assert epsilon_from_history([(2.0, 0.01, 1)], 0.05, "rdp") == 0.0
    engine, common, dl = _private(PrivacyEngine(accountant="rdp"), n=10)  # 1/N = 0.1 > δ
    engine.make_private(**common, data_loader=dl, noise_multiplier=2.0)
    engine.accountant.history = [(2.0, 0.01, 1)]
    assert engine.get_epsilon(0.05) == 0.0


def test_an_empty_history_spends_nothing() -> None:
    """Opacus' PRV accountant raises on an empty history; no step has spent anything."""
    engine, common, dl = _private(PrivacyEngine(accountant="prv"))
    assert engine.get_epsilon(1e-5) == 0.0
    engine.make_private(**common, data_loader=dl, noise_multiplier=1.0)
    assert engine.get_epsilon(1e-5) == 0.0
