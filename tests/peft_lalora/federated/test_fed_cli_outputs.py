"""`peft-lalora federate` before it trains: a bad ``--out`` or ``--save-adapter`` fails at once (not after the
run), and the defaults are what docs/results.md §9 measured best, with the evidence cited in ``--help``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.cli import CLI_DEFAULTS, build_parser, config_from_args, main  # noqa: E402

TINY = ["federate", "--task", "fed_tiny:tiny", "--no-progress"]


@pytest.fixture
def no_training(monkeypatch):
    """Any attempt to build the task or run a federation fails the test."""
    from peft_lalora.federated import simulation
    from peft_lalora.federated.data import task
    from peft_lalora.federated.launcher import run as flower_run

    def started(*a, **k):
        raise AssertionError("training started before the output paths were checked")

    for mod, name in ((task, "build_task"), (simulation, "run_simulation"), (flower_run, "run_flower")):
        monkeypatch.setattr(mod, name, started)


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through any mode bits: use a read-only file system
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no read-only folder to test with")
        return Path("/sys/kernel/lalora-results.json")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    return ro / "results.json"


@pytest.mark.parametrize("runner", ["simulation", "flower"])
@pytest.mark.parametrize("case", ["a folder", "under a file", "unwritable"])
def test_bad_out_fails_before_training(case, runner, tmp_path, capsys, no_training):
    (tmp_path / "file.txt").write_text("x")
    out = {"a folder": tmp_path, "under a file": tmp_path / "file.txt" / "r.json", "unwritable": _unwritable(tmp_path)}
    expected = {
        "a folder": "is a folder",
        "under a file": f"{tmp_path / 'file.txt'} is a file, not a folder",
        "unwritable": "cannot write",
    }
    assert main([*TINY, "--runner", runner, "--out", str(out[case])]) == 2
    err = capsys.readouterr().err
    assert f"--out {out[case]}: {expected[case]}" in err and "Traceback" not in err


def test_bad_save_adapter_fails_before_training(tmp_path, capsys, no_training):
    (tmp_path / "file.txt").write_text("x")
    rc = main([*TINY, "--out", str(tmp_path / "r.json"), "--save-adapter", str(tmp_path / "file.txt")])
    assert rc == 2 and f"--save-adapter {tmp_path / 'file.txt'}: is a file" in capsys.readouterr().err
    target = _unwritable(tmp_path).parent / "adapter"
    assert main([*TINY, "--out", str(tmp_path / "r.json"), "--save-adapter", str(target)]) == 2
    assert f"--save-adapter {target}: cannot write" in capsys.readouterr().err


def test_defaults_are_section_9s_best_and_help_cites_it(capsys):
    cfg = config_from_args(build_parser().parse_args(["federate"]))
    assert (cfg.algo, cfg.optimizer, cfg.lr) == ("ffa-lora", "sgd", 1.0)
    assert set(CLI_DEFAULTS) == {"algo", "optimizer", "lr"}
    with pytest.raises(SystemExit):
        main(["federate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("docs/results.md §9") >= 4  # the description and each of the three flags
    assert "the library's is 'la-lora'" in text and "the library's is 'adamw'" in text
    # an explicit flag still wins
    cfg = config_from_args(build_parser().parse_args(["federate", "--algo", "la-lora", "--optimizer", "adamw"]))
    assert (cfg.algo, cfg.optimizer) == ("la-lora", "adamw")


def test_a_result_written_when_a_crash_cuts_the_write_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """``--out`` and the Flower server's result file are written through a temporary file and a rename: a crash in
    the middle of the write (simulated: half the text, then an error) leaves the earlier result, never half a JSON."""
    from peft_lalora.federated.server.rounds import write_json

    path = write_json(tmp_path / "r.json", {"round": 1})
    real = Path.write_text

    def crash(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", crash)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"round": 2, "accuracy": [0.5] * 100})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"round": 1}
