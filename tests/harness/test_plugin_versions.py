"""Every result file records the version of every installed opacus_spectral plugin, not only a fixed list."""

from __future__ import annotations

import importlib.metadata as md
from types import SimpleNamespace

import pytest
from dp_bench import meta


def _ep(name: str, dist: str | None, version: str = "1.0") -> SimpleNamespace:
    return SimpleNamespace(name=name, dist=None if dist is None else SimpleNamespace(name=dist, version=version))


def test_every_plugin_distribution_is_recorded_with_its_version() -> None:
    eps = [
        _ep("disk", "opacus_spectral_disk", "0.3.1"),
        _ep("doppler", "opacus-spectral-doppler", "0.1.0"),
        _ep("svht", "Opacus.Spectral.SVHT", "2.0"),
        _ep("disk2", "opacus_spectral_disk", "0.3.1"),
    ]
    assert meta.plugin_versions(eps) == {
        "opacus-spectral-disk": "0.3.1",
        "opacus-spectral-doppler": "0.1.0",
        "opacus-spectral-svht": "2.0",
    }


def test_an_entry_point_without_a_distribution_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no distribution"):
        meta.plugin_versions([_ep("orphan", None)])


def test_versions_include_the_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk plugin is not in PACKAGES; installed, it must still appear in versions()."""
    assert "opacus-spectral-disk" not in meta.PACKAGES
    real = md.entry_points

    def fake(**kw):  # type: ignore[no-untyped-def]
        if kw.get("group") == meta.PLUGIN_GROUP:
            return [*real(group=meta.PLUGIN_GROUP), _ep("disk", "opacus-spectral-disk", "9.9")]
        return real(**kw)

    monkeypatch.setattr(meta.md, "entry_points", fake)
    v = meta.versions()
    assert v["opacus-spectral-disk"] == "9.9"
    for ep in real(group=meta.PLUGIN_GROUP):  # what is really installed (the core's builtin entry point at least)
        assert v[ep.dist.name.replace("_", "-").lower()] == ep.dist.version
    assert v["torch"] == md.version("torch")
