"""`peft-lalora federate` errors a newcomer can act on: a missing model folder is named, a partition that cannot be
made turns into advice naming ``--num-clients`` / ``--alpha``, every flag has a help text, and parsing the flags
imports none of the federation's heavy parts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

pytest.importorskip("flwr_datasets")

from peft_lalora.cli import build_parser, main  # noqa: E402

TINY = ["federate", "--task", "fed_tiny:tiny", "--no-progress", "--rounds", "1"]


@pytest.mark.parametrize("spelled", ["./typo", "{tmp}/typo", "typo/sub/dir"])
def test_a_missing_model_folder_is_named(spelled, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.csv").write_text("text,label\ngood film,1\nbad film,0\n")
    model = spelled.format(tmp=tmp_path)
    rc = main(["federate", "--model", model, "--data", "data.csv", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--model {model}: no such folder" in err, err
    assert "Repo id" not in err  # before: huggingface_hub's "Repo id must use alphanumeric chars"


def test_a_model_path_to_a_file_is_named(tmp_path, capsys):
    (tmp_path / "model.bin").write_bytes(b"")
    rc = main(["federate", "--model", str(tmp_path / "model.bin"), "--data", "x.csv", "--out", str(tmp_path / "r")])
    assert rc == 2 and "is a file, not a model folder" in capsys.readouterr().err


def test_a_dirichlet_split_that_cannot_be_made_is_advice_on_the_flags(tmp_path, capsys):
    rc = main([*TINY, "--num-clients", "30", "--alpha", "0.01", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--num-clients 30" in err and "--alpha 0.01" in err and "raise --alpha" in err, err
    assert "--min-partition-size" in err and "UserWarning" not in err  # one line, not flwr-datasets' retries
    assert not (tmp_path / "r.json").exists()


def test_more_clients_than_rows_is_advice_on_the_flags(tmp_path, capsys):
    rc = main([*TINY, "--num-clients", "600", "--partition", "iid", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--num-clients 600" in err and "512 training rows" in err and "lower --num-clients" in err


def test_every_flag_has_a_help_text() -> None:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    federate = sub.choices["federate"]
    missing = [a.option_strings[0] for a in federate._actions if a.option_strings and not (a.help or "").strip()]
    assert not missing  # before: --runner, --no-progress


def test_parsing_the_flags_imports_none_of_the_federation() -> None:
    """``federate --help`` builds the parser from ``FederationConfig``: that must not import torch-backed modules
    beyond what ``import peft_lalora`` itself already imported (before: the aggregation, through
    ``peft_lalora.federated``)."""
    code = (
        "import sys, peft_lalora\n"
        "before = set(sys.modules)\n"
        "from peft_lalora.cli import build_parser\n"
        "build_parser().format_help()\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [m for m in new if m.split(".")[0] in ("torch", "opacus", "flwr", "datasets", "transformers", "numpy")]
    assert not heavy and "peft_lalora.federated.server.aggregate" not in new, new
