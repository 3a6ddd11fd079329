import math

import numpy as np
import pytest
import torch
from opacus_spectral.plugins.testing import check_denoiser
from opacus_spectral_svht import SVHTDenoiser, svht, threshold_coefficient

import opacus_spectral


def test_coefficient_matches_gavish_donoho():
    assert threshold_coefficient(1.0) == pytest.approx(4 / math.sqrt(3), rel=1e-12)  # the paper's title
    # β = 1/2 by hand: sqrt(3 + 4 / (1.5 + sqrt(8.25))) = 1.97860
    assert threshold_coefficient(0.5) == pytest.approx(1.97860, abs=1e-5)
    with pytest.raises(ValueError):
        threshold_coefficient(0.0)


@pytest.mark.parametrize(("m", "n", "rank"), [(60, 60, 3), (40, 100, 2), (120, 30, 4), (8, 200, 1)])
def test_matches_gd_threshold_on_spiked_matrices(m, n, rank):
    rng = np.random.default_rng(m * n)
    s = 0.1
    u, v = rng.standard_normal((m, rank)), rng.standard_normal((rank, n))
    x = u @ v / math.sqrt(max(m, n)) * 4 * s * math.sqrt(max(m, n)) ** 0.5
    y = x + s * rng.standard_normal((m, n))
    # independent numpy implementation of the rule
    beta = min(m, n) / max(m, n)
    lam = math.sqrt(2 * (beta + 1) + 8 * beta / (beta + 1 + math.sqrt(beta**2 + 14 * beta + 1)))
    uu, ss, vv = np.linalg.svd(y, full_matrices=False)
    keep = ss > lam * math.sqrt(max(m, n)) * s
    expected = (uu[:, keep] * ss[keep]) @ vv[keep]
    got = svht(torch.from_numpy(y), s).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
    assert 0 < keep.sum() <= rank + 1  # the spikes survive, the bulk does not


def test_conformance():
    check_denoiser(SVHTDenoiser)


def test_found_by_name_through_the_installed_entry_point():
    info = opacus_spectral.available_denoisers()["svht"]
    assert info.distribution == "opacus-spectral-svht"
    assert isinstance(opacus_spectral.plugins.get_registry().create("svht"), SVHTDenoiser)


def test_an_undeclared_callable_before_svht_warns_that_it_switches_svht_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 3))
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        post_hooks=[lambda grads: None, "svht"],
        poisson_sampling=False,
    )
    x, y = next(iter(dl))
    torch.nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.warns(RuntimeWarning, match="svht"):
        opt.step()
