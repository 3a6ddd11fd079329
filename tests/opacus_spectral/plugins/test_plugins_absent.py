"""In the main test environment the example plugins are not installed: their names are unknown, clearly."""

import importlib.util

import pytest

import opacus_spectral


@pytest.mark.parametrize(("name", "module"), [("doppler", "opacus_spectral_doppler"), ("svht", "opacus_spectral_svht")])
def test_uninstalled_plugin_name_is_unknown(name, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here (the 'plugins' tox env checks the installed case)")
    assert name not in opacus_spectral.available_denoisers()
    with pytest.raises(ValueError, match=rf"unknown denoiser '{name}'; available: .*rmt"):
        opacus_spectral.plugins.get_registry().create(name)
