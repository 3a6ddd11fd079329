import pytest
import torch
from opacus_spectral.plugins.testing import check_denoiser
from opacus_spectral_doppler import PRESETS, DopplerDenoiser, step_response

import opacus_spectral
from opacus_spectral import NoisyGradient


def _rec(name, value, step):
    return NoisyGradient(name, "weight", torch.tensor([[float(value)]], dtype=torch.float64), 0.1, step)


def test_matches_difference_equation_by_hand_with_skipped_step():
    """a = [1, −0.9], b = [0.15, −0.05]; parameter q has no gradient at step 2 (alternation)."""
    d = DopplerDenoiser()
    g = {"p": [1.0, 2.0, -1.0, 0.5], "q": [4.0, -2.0, None, 3.0]}
    outs = {"p": [], "q": []}
    for step in range(4):
        recs = [_rec(n, g[n][step], step) for n in ("p", "q") if g[n][step] is not None]
        res = d(recs)
        for r, o in zip(recs, res, strict=True):
            outs[r.name].append(float(o))
    # by hand: c = [0.15, 0.10 + 0.135 = 0.235, 0.10 + 0.2115 = 0.3115, ...]
    c = [0.15, 0.235, 0.3115, 0.38035]
    assert step_response(*PRESETS["first_order"], 4) == pytest.approx(c)
    mp, mq = [], []
    x = g["p"]
    mp.append(0.15 * x[0])
    mp.append(0.15 * x[1] - 0.05 * x[0] + 0.9 * mp[0])
    mp.append(0.15 * x[2] - 0.05 * x[1] + 0.9 * mp[1])
    mp.append(0.15 * x[3] - 0.05 * x[2] + 0.9 * mp[2])
    assert outs["p"] == pytest.approx([m / ci for m, ci in zip(mp, c, strict=True)], rel=1e-12)
    y = [4.0, -2.0, 3.0]  # q's own steps 0, 1, 2 (step 2 of the run skipped)
    mq.append(0.15 * y[0])
    mq.append(0.15 * y[1] - 0.05 * y[0] + 0.9 * mq[0])
    mq.append(0.15 * y[2] - 0.05 * y[1] + 0.9 * mq[1])
    # q has 3 own steps, c has 4 entries: zip stops at the shorter on purpose
    assert outs["q"] == pytest.approx([m / ci for m, ci in zip(mq, c, strict=False)], rel=1e-12)


def test_constant_gradient_passes_unchanged_and_noise_is_reduced():
    for preset in PRESETS:
        d = DopplerDenoiser(preset)
        for t in range(5):
            (o,) = d([NoisyGradient("w", "weight", torch.full((3, 3), 2.0), 0.1, t)])
            assert torch.allclose(o, torch.full((3, 3), 2.0), rtol=1e-5)
    d = DopplerDenoiser()
    torch.manual_seed(0)
    outs = [d([NoisyGradient("w", "weight", torch.randn(200, 200), 1.0, t)])[0] for t in range(60)]
    assert float(outs[-1].std()) < 0.6  # white noise variance is reduced once the filter has warmed up


def test_checkpoint_resumes_and_conformance():
    check_denoiser(DopplerDenoiser, stateful=True, sigma_zero_identity=False)
    check_denoiser(lambda: DopplerDenoiser("second_order"), stateful=True, sigma_zero_identity=False)


def test_bad_coefficients():
    with pytest.raises(ValueError, match="DC gain"):
        DopplerDenoiser(a=[1.0, -0.5], b=[0.1])
    with pytest.raises(ValueError, match="preset"):
        DopplerDenoiser("third_order")
    d = DopplerDenoiser()
    with pytest.raises(ValueError, match="saved with"):
        d.load_state_dict(DopplerDenoiser("second_order").state_dict())


def test_found_by_name_and_composes_with_rmt():
    info = opacus_spectral.available_denoisers()["doppler"]
    assert info.distribution == "opacus-spectral-doppler"
    from opacus_spectral.plugins.registry import create_denoisers
    from opacus_spectral.step.parameters import ParamInfo
    from opacus_spectral.step.pipeline import PostNoisePipeline

    pipe = PostNoisePipeline(create_denoisers(["rmt", "doppler"]))
    torch.manual_seed(0)
    u, v = torch.randn(64, 1), torch.randn(1, 48)
    for _t in range(3):
        g = u @ v + 0.05 * torch.randn(64, 48)
        (out,) = pipe.run([g], [ParamInfo("w", "weight", None)], 0.05)
    assert [n for n in pipe.names] == ["rmt", "doppler"]
    assert pipe.diagnostics.last.denoisers["doppler"]["filtered"] == 1
    cos = torch.nn.functional.cosine_similarity(out.flatten(), (u @ v).flatten(), dim=0)
    assert cos > 0.95


def test_make_private_uses_doppler_by_name():
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=16)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    model, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        post_hooks=[("doppler", {"preset": "second_order"})],
    )
    for x, y in dl:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    (d,) = engine.post_hooks.denoisers
    assert isinstance(d, DopplerDenoiser) and d.b == PRESETS["second_order"][1]
    assert set(d.t.values()) == {engine.post_hooks.diagnostics.steps} and engine.post_hooks.diagnostics.steps >= 1


def test_declared_output_noise_matches_the_measured_std_on_white_noise():
    from opacus_spectral import NoisyGradient

    d = DopplerDenoiser()
    gen = torch.Generator().manual_seed(0)
    s = 0.3
    for t in range(12):
        rec = NoisyGradient("w", "weight", s * torch.randn(200, 200, generator=gen), s, t)
        out = d([rec])[0]
        (gain,) = d.output_noise([rec])
        assert float(out.std()) == pytest.approx(gain * s, rel=0.03), t
    assert gain < 0.5  # the filter averages the white noise down
    d([NoisyGradient("w", "weight", torch.randn(200, 200, generator=gen), 2 * s, 12)])  # the std changed:
    assert d.output_noise([None]) == ["unknown"]  # no exact gain any more
