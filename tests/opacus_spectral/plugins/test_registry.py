"""The plugin registry: distributions found through entry points, broken plugins skipped with one warning,
the user's order kept, unknown names listed, role plugins consulted."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from opacus_spectral.errors import DenoiserBuildError
from opacus_spectral.plugins import ParameterRole
from opacus_spectral.plugins.registry import Registry, create_denoisers
from opacus_spectral.step.parameters import describe_parameters
from opacus_spectral.step.pipeline import PostNoisePipeline
from torch import nn

GOOD = """
import torch
from opacus_spectral import Denoiser, ParameterRole, hookimpl

class Double(Denoiser):
    name = "double"
    def __call__(self, grads):
        for g in grads:
            g.tensor.mul_(2)

class AddConst(Denoiser):
    name = "add_const"
    def __init__(self, value=1.0):
        super().__init__()
        self.value = value
    def __call__(self, grads):
        return [g.tensor + self.value for g in grads]

@hookimpl
def opacus_spectral_denoisers():
    return {"double": Double, "add_const": AddConst}

@hookimpl
def opacus_spectral_parameter_roles(module):
    return {n: ParameterRole("special", layer="L") for n, _ in module.named_parameters() if n.endswith("0.weight")}
"""

PLUGINS = {
    # distribution name: (module name, module source)
    "good-plugin": ("good_denoiser_plugin", GOOD),
    "broken-plugin": ("broken_denoiser_plugin", "raise ImportError('missing dependency xyz')\n"),
    "badsig-plugin": (
        "badsig_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_denoisers(unknown_arg):\n    return {}\n",
    ),
    "raising-plugin": (
        "raising_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\n"
        "def opacus_spectral_denoisers():\n    raise RuntimeError('kaput')\n",
    ),
    "dup-plugin": (
        "dup_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_denoisers():\n"
        "    return {'rmt': lambda **kw: (lambda grads: None)}\n",
    ),
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Installs the plugin distributions above into a fresh site directory (dist-info + entry points)."""
    for dist, (mod, src) in PLUGINS.items():
        (tmp_path / f"{mod}.py").write_text(src)
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[opacus_spectral]\n{dist.split('-')[0]} = {mod}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_installed_plugin_is_found_and_broken_ones_skipped(site):
    reg = Registry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = reg.denoisers()
    assert table["double"].distribution == "good-plugin"
    assert table["add_const"].plugin == "good"
    assert table["rmt"].distribution == "opacus-spectral"  # built-ins arrive the same way
    assert table["lowpass"].distribution == "opacus-spectral"
    errors = {(e.distribution, e.stage) for e in reg.errors()}
    assert ("broken-plugin", "import") in errors
    assert ("badsig-plugin", "register") in errors
    assert ("raising-plugin", "denoisers") in errors
    assert ("dup-plugin", "denoisers") in errors  # "rmt" already taken: the first-loaded one is kept
    assert table["rmt"].plugin == "builtin"
    ours = [str(w.message) for w in caught if "skipping plugin" in str(w.message)]
    assert len(ours) == 4  # one warning per broken plugin
    assert any("missing dependency xyz" in m for m in ours)


def test_order_is_the_users_not_pluggys(site):
    reg = Registry()
    g = torch.full((2, 2), 1.0)
    for hooks, expected in (
        [["double", ("add_const", {"value": 1.0})], 3.0],
        [[("add_const", {"value": 1.0}), "double"], 4.0],
    ):
        pipe = PostNoisePipeline(create_denoisers(hooks, reg))
        from opacus_spectral.step.parameters import ParamInfo

        out = pipe.run([g.clone()], [ParamInfo("w", "weight", None)], sigma=0.1)
        assert torch.equal(out[0], torch.full((2, 2), expected))


def test_unknown_name_mentions_broken_plugins(site):
    reg = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ValueError,
            match=r"unknown denoiser 'no_such_denoiser'; available: add_const, .*double, ema, lowpass, rmt"
            r".*failed to load: badsig, broken, dup, raising",
        ):
            reg.create("no_such_denoiser")


def test_a_misspelt_name_or_keyword_gets_the_closest_valid_one():
    reg = Registry()
    with pytest.raises(ValueError, match=r"unknown denoiser 'lowpas'; available: .*lowpass.*Did you mean 'lowpass'\?"):
        reg.create("lowpas")
    with pytest.raises(
        DenoiserBuildError, match=r"no keyword 'kernal'; did you mean 'kernel'\? Its keywords: .*"
    ) as err:
        reg.create(("lowpass", {"kernal": "binomial5"}))
    assert all(k in str(err.value) for k in ("kernel_width", "role_axes", "weight_axis"))
    # rmt takes its settings' fields as keywords too: they are listed with its own
    with pytest.raises(DenoiserBuildError, match=r"no keyword 'gat'; did you mean 'gate'\?") as err:
        reg.create(("rmt_paper", {"gat": "kappa"}))
    assert all(k in str(err.value) for k in ("false_alarm", "max_batch", "norm_correction", "settings"))


def test_a_plugin_factorys_own_signature_names_its_keywords(site):
    reg = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DenoiserBuildError, match=r"'add_const'.*no keyword 'valeu'; did you mean 'value'\? Its"):
            reg.create(("add_const", {"valeu": 2.0}))
        assert reg.create(("add_const", {"value": 2.0})).value == 2.0


def test_role_plugin_is_consulted(site):
    reg = Registry()
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        infos = describe_parameters(list(model.parameters()), model, reg)
    by_name = {i.name: i for i in infos.values()}
    assert by_name["0.weight"].role == "special" and by_name["0.weight"].layer == "L"
    assert by_name["1.weight"].role == "weight" and by_name["1.bias"].role == "bias"


def test_runtime_registration_and_embedding_role():
    reg = Registry(entry_points=lambda: [])

    class Plugin:
        from opacus_spectral import hookimpl

        @hookimpl
        def opacus_spectral_denoisers(self):
            return {"noop": lambda: lambda grads: None}

    assert reg.register(Plugin(), name="rt")
    assert list(reg.denoisers()) == ["noop"]
    emb = nn.Embedding(10, 4)
    info = describe_parameters([emb.weight], emb, reg)[id(emb.weight)]
    assert info == type(info)("weight", "embedding", None)
    assert ParameterRole("lora_A") == ("lora_A", None)


# --------------------------------------------------------------------------------- hostile plugins
HOSTILE = {
    "exiting-plugin": ("exiting_denoiser_plugin", "import sys\nsys.exit('plugin says bye')\n"),
    "badrole-plugin": (
        "badrole_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_parameter_roles(module):\n"
        "    return {n: ('lora_A', 'L', 'extra', 4) for n, _ in module.named_parameters()}\n",
    ),
    "nonstrrole-plugin": (
        "nonstrrole_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_parameter_roles(module):\n"
        "    return {n: 7 for n, _ in module.named_parameters()}\n",
    ),
    "exitrole-plugin": (
        "exitrole_denoiser_plugin",
        "import sys\nfrom opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_parameter_roles(module):\n"
        "    sys.exit(1)\n",
    ),
    "typo-plugin": (
        "typo_denoiser_plugin",
        "from opacus_spectral import hookimpl\n@hookimpl\ndef opacus_spectral_denoiser():\n"
        "    return {'typo': lambda: (lambda grads: None)}\n",
    ),
}


@pytest.fixture
def hostile_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for dist, (mod, src) in HOSTILE.items():
        (tmp_path / f"{mod}.py").write_text(src)
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[opacus_spectral]\n{dist.split('-')[0]} = {mod}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_hostile_plugins_never_break_the_host(hostile_site):
    from engine_helpers import loader, mlp

    from opacus_spectral import PrivacyEngine

    reg = Registry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = reg.denoisers()  # sys.exit() at import does not end the process
        model = mlp(hidden=8, d_out=4)
        engine = PrivacyEngine(accountant="rdp", registry=reg)
        _, dp_opt, _ = engine.make_private(  # role plugins answering garbage or exiting: still works
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(16, 8, d_out=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            post_hooks=["rmt"],
        )
    assert {"rmt", "lowpass"} <= set(table) and "typo" not in table
    errors = {(e.distribution, e.stage): e.error for e in reg.errors()}
    assert "SystemExit" in errors[("exiting-plugin", "import")]
    assert "roles" in {s for d, s in errors if d == "badrole-plugin"}
    assert "roles" in {s for d, s in errors if d == "nonstrrole-plugin"}
    assert "SystemExit" in errors[("exitrole-plugin", "roles")]
    typo = errors[("typo-plugin", "register")]
    assert "opacus_spectral_denoiser" in typo and "unknown hook" in typo
    infos = engine.post_hooks._infos.values()
    assert {i.role for i in infos} == {"weight", "bias"}  # garbage roles were dropped, built-ins kept
    assert any("typo" in str(w.message) for w in caught)
