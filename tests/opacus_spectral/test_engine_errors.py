"""Errors and warnings a newcomer meets at ``make_private``: a keyword the engine does not use is refused (Opacus'
``**kwargs`` swallowed it), BatchNorm points to the fix, and upstream warnings that do not apply to this engine are not
shown — scoped to the call that emits them, never a global filter (``docs/engine.md``, "Warnings")."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import loader, mlp
from opacus.validators.errors import UnsupportedModuleError
from torch import nn

from opacus_spectral import PrivacyEngine

KW = dict(noise_multiplier=1.0, max_grad_norm=1.0)


def _parts(model: nn.Module | None = None) -> dict:
    model = model or mlp(d_in=4, hidden=8, d_out=2)
    return dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader(32, 8, 4, 2))


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.parametrize("method", ["make_private", "make_private_with_epsilon"])
def test_a_keyword_the_engine_does_not_use_is_refused_with_where_it_belongs(method):
    engine = PrivacyEngine(accountant="rdp")
    budget = (
        KW if method == "make_private" else dict(target_epsilon=2.0, target_delta=1e-3, epochs=1, max_grad_norm=1.0)
    )
    with pytest.raises(TypeError, match=r"'noise_seed'.*PrivacyEngine\(noise_seed=\.\.\.\)"):
        getattr(engine, method)(**_parts(), **budget, noise_seed=0)  # trained with OS-entropy noise before
    with pytest.raises(TypeError, match=r"'clippng'.*did you mean 'clipping'"):
        getattr(engine, method)(**_parts(), **budget, clippng="per_layer")
    assert engine.accountant.history == [] and engine.doctor is None  # refused before anything was built


def test_the_keywords_opacus_passes_on_are_still_accepted():
    """AdaClip's settings travel through Opacus' ``**kwargs`` to its optimizer: accepted where that class uses them."""
    engine = PrivacyEngine(accountant="rdp")
    adaclip = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1)
    _, opt, _ = engine.make_private(**_parts(), **KW, clipping="adaptive", unclipped_num_std=1.0, **adaclip)
    assert opt.target_unclipped_quantile == 0.5
    with pytest.raises(TypeError, match="'target_unclipped_quantile'"):  # flat clipping never reads it
        PrivacyEngine().make_private(**_parts(), **KW, target_unclipped_quantile=0.5)


def test_batchnorm_names_the_module_and_points_to_the_validator_fix():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(UnsupportedModuleError) as err:
        PrivacyEngine().make_private(**_parts(model), **KW)
    text = str(err.value)
    assert "'1' (BatchNorm1d)" in text and "opacus.validators.ModuleValidator.fix(model)" in text
    assert "before building the optimizer" in text


def test_upstream_warnings_that_do_not_apply_are_not_shown_and_no_filter_is_left_behind():
    filters = list(warnings.filters)
    assert _caught(PrivacyEngine) == []  # Opacus: "Secure RNG turned off" — the noise comes from OS entropy here
    assert _caught(lambda: PrivacyEngine(accountant="gdp")) == []  # ours says it once, at make_private
    engine = PrivacyEngine()  # prv: its RDP bound only sizes PRV's grid ("Optimal order is the largest alpha")
    shown = _caught(
        lambda: engine.make_private_with_epsilon(
            **_parts(), target_epsilon=0.5, target_delta=1e-3, epochs=3, max_grad_norm=1.0
        )
    )
    shown += _caught(lambda: engine.get_epsilon(1e-3))
    assert shown == []
    assert warnings.filters == filters


def test_the_rdp_accountants_own_bound_still_warns():
    """accountant='rdp': the alpha grid's edge does loosen the ε it reports, so Opacus' warning stays."""
    engine = PrivacyEngine(accountant="rdp")
    shown = _caught(
        lambda: engine.make_private_with_epsilon(
            **_parts(), target_epsilon=50, target_delta=1e-2, epochs=1, max_grad_norm=1
        )
    )
    assert any("Optimal order is the smallest alpha" in s for s in shown)
