"""The Flower runner's work folder holds the CA, the SuperLink's TLS key and every SuperNode's private key:
its folders are owner-only (0700), key files 0600, and a folder the runner made is removed at the end — also when
the run fails — unless the user keeps it (``keep_workdir`` / ``--keep-workdir``). No process is started here."""

from __future__ import annotations

import stat

import pytest

pytest.importorskip("cryptography")
pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.launcher import LocalFederation, run_flower  # noqa: E402
from peft_lalora.federated.launcher import run as flower_run  # noqa: E402
from peft_lalora.federated.launcher.workdir import new_workdir, private_dir  # noqa: E402

SMALL = dict(task="fed_tiny:tiny", num_clients=2, n_train=32, n_test=16, alpha=1.0)


class Stop(Exception):
    pass


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _stop_at_first_process(monkeypatch, seen: dict) -> None:
    """LocalFederation.spawn raises before any process starts, after start() made its folders and keys."""

    def spawn(self, name, argv):
        seen["fed"] = self
        raise Stop

    monkeypatch.setattr(LocalFederation, "spawn", spawn)


def _record_workdirs(monkeypatch) -> list:
    made: list = []
    monkeypatch.setattr(flower_run, "new_workdir", lambda: made.append(new_workdir()) or made[-1])
    return made


def test_private_dir_narrows_an_existing_folder(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert _mode(private_dir(loose)) == 0o700 and _mode(private_dir(tmp_path / "a" / "b")) == 0o700
    fresh = new_workdir()
    assert _mode(fresh) == 0o700
    fresh.rmdir()


def test_federation_folders_are_owner_only_and_keys_0600(tmp_path, monkeypatch):
    seen: dict = {}
    _stop_at_first_process(monkeypatch, seen)
    fed = LocalFederation(2, tmp_path / "w")
    with pytest.raises(Stop):
        fed.start()
    for sub in ("flwr_home", "logs", "credentials"):
        assert _mode(tmp_path / "w" / sub) == 0o700, sub
    assert _mode(fed.tls.server_key) == 0o600
    from peft_lalora.federated.launcher.node_keys import generate_node_keys

    keys = generate_node_keys(fed.credentials_dir, "supernode-0")
    assert _mode(keys.private_key) == 0o600 and _mode(fed.credentials_dir) == 0o700


def test_run_flower_removes_its_workdir_with_the_keys_even_on_failure(monkeypatch):
    seen: dict = {}
    _stop_at_first_process(monkeypatch, seen)
    made = _record_workdirs(monkeypatch)
    with pytest.raises(Stop):
        run_flower(FederationConfig(**SMALL))
    fed = seen["fed"]
    assert made == [fed.workdir] and fed.tls is not None
    assert not fed.workdir.exists() and not fed.tls.server_key.exists()


def test_keep_workdir_keeps_it_private(monkeypatch):
    seen: dict = {}
    _stop_at_first_process(monkeypatch, seen)
    made = _record_workdirs(monkeypatch)
    with pytest.raises(Stop):
        run_flower(FederationConfig(**SMALL), keep_workdir=True)
    wd = made[0]
    try:
        assert wd.is_dir() and _mode(wd) == 0o700
        for sub in ("flwr_home", "logs", "credentials"):
            assert _mode(wd / sub) == 0o700, sub
        assert _mode(wd / "credentials" / "server.key") == 0o600
    finally:
        import shutil

        shutil.rmtree(wd)


def test_a_callers_workdir_is_kept(tmp_path, monkeypatch):
    seen: dict = {}
    _stop_at_first_process(monkeypatch, seen)
    with pytest.raises(Stop):
        run_flower(FederationConfig(**SMALL), workdir=tmp_path / "mine")
    assert (tmp_path / "mine" / "credentials" / "server.key").is_file() and _mode(tmp_path / "mine") == 0o700
