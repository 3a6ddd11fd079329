"""`peft-lalora federate` CLI: flags generated from FederationConfig, algorithm -> alternation mapping, a 2-round
smoke run on the harness's tiny task, and a run on a user's own model folder and CSV / JSONL / saved dataset."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from fed_support import user_model_and_data  # noqa: E402
from peft_lalora.cli import build_parser, config_from_args, main  # noqa: E402
from peft_lalora.federated.builders import client_config  # noqa: E402

pytestmark = pytest.mark.slow

TINY = ["--task", "fed_tiny:tiny"]


@pytest.mark.parametrize(
    ("algo", "mode"), [("dp-lora", "none"), ("ffa-lora", "freeze_a"), ("rolora", "round"), ("la-lora", "step")]
)
def test_algorithms_are_lalora_config_modes(algo, mode):
    from peft_lalora.federated.builders import make_peft_config

    from peft_lalora import LALoraConfig

    cfg = config_from_args(build_parser().parse_args(["federate", "--algo", algo]))
    pc = make_peft_config(cfg)
    assert isinstance(pc, LALoraConfig) and pc.alternation == mode


def test_filters_map_to_post_hooks():
    cfg = config_from_args(build_parser().parse_args(["federate", "--filter", "binomial5"]))
    assert client_config(cfg).post_hooks == [("lowpass", {"kernel": "binomial5"})]
    cfg = config_from_args(build_parser().parse_args(["federate", "--filter", "none"]))
    assert client_config(cfg).post_hooks == []


def test_reproducible_noise_is_an_explicit_opt_in():
    assert config_from_args(build_parser().parse_args(["federate"])).reproducible_noise is False
    cfg = config_from_args(build_parser().parse_args(["federate", "--reproducible-noise"]))
    assert cfg.reproducible_noise is True and client_config(cfg).reproducible_noise is True


def test_federate_smoke_two_rounds(tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = main(
        [
            "federate",
            "--algo",
            "la-lora",
            "--filter",
            "binomial5",
            "--num-clients",
            "3",
            "--alpha",
            "0.5",
            "--epsilon",
            "2",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--seed",
            "1",
            *TINY,
            "--n-train",
            "96",
            "--n-test",
            "32",
            "--batch-size",
            "8",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["accuracy"]) == 3 and all(0 <= a <= 1 for a in res["accuracy"])
    assert set(res["epsilon"]) == {"0", "1", "2"}
    assert all(0 < e <= 2.0 + 0.02 for e in res["epsilon"].values())
    assert res["max_epsilon"] == max(res["epsilon"].values())
    assert res["config"]["algo"] == "la-lora" and res["config"]["filter"] == "binomial5"
    assert res["config"]["num_clients"] == 3 and res["config"]["alpha"] == 0.5
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    # no per-client label counts and no noise-free training loss unless the operator opts in (test_fed_privacy.py)
    assert sum(res["partition"]["sizes"]) == 96 and "label_histograms" not in res["partition"]
    assert all(r["train_loss"] is None for r in res["rounds"])
    assert res["noise"]["reproducible"] is False and res["config"]["reproducible_noise"] is False
    assert res["failed_rounds"] == []
    assert "max ε" in capsys.readouterr().out


def test_bad_arguments_exit_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["federate", "--algo", "lora"])
    rc = main(["federate", *TINY, "--fraction", "0", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "fraction" in capsys.readouterr().err
    rc = main(["federate", "--out", str(tmp_path / "x.json")])  # task=text without --model/--data
    assert rc == 2 and "needs model=" in capsys.readouterr().err


def test_every_config_field_is_a_flag_with_its_default():
    import dataclasses

    from peft_lalora.cli import CLI_DEFAULTS
    from peft_lalora.federated.config import FederationConfig

    args = build_parser().parse_args(["federate"])  # the library's defaults except CLI_DEFAULTS (docs/results.md §9)
    assert config_from_args(args) == FederationConfig(**{k: v for k, (v, _) in CLI_DEFAULTS.items()})
    for f in dataclasses.fields(FederationConfig):
        assert hasattr(args, f.name), f.name
    cfg = config_from_args(build_parser().parse_args(["federate", "--no-weighted", "--num-clients", "5"]))
    assert cfg.weighted is False and cfg.num_clients == 5


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "saved"])
def test_federate_a_users_model_and_data(tmp_path, fmt):
    from peft_lalora.federated.builders import build_partition
    from peft_lalora.federated.config import FederationConfig
    from peft_lalora.federated.data.task import build_task

    model_dir, data = user_model_and_data(tmp_path, fmt)
    user = [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--text-column",
        "review",
        "--label-column",
        "sentiment",
        "--group-column",
        "film",
        "--seq-len",
        "8",
    ]
    args = build_parser().parse_args(["federate", *user, "--partition", "group", "--num-clients", "3"])
    cfg = config_from_args(args)
    task = build_task(cfg)
    assert task.num_labels == 2 and task.columns == ("input_ids", "attention_mask", "token_type_ids", "label")
    n_train, n_test = len(task.train), len(task.test)
    assert n_train + n_test == 60 and n_test == (15 if fmt == "saved" else 12)  # saved: its own test split
    assert sorted(set(task.train["label"])) == [0, 1]  # "neg" -> 0, "pos" -> 1 (sorted names)
    part = build_partition(cfg, task)
    films = [set(task.train.with_format(None).select(ix)["film"]) for ix in part.indices]
    assert all(not (a & b) for i, a in enumerate(films) for b in films[i + 1 :])  # every film on one client
    out = tmp_path / "res.json"
    rc = main(
        [
            "federate",
            *user,
            "--num-clients",
            "2",
            "--alpha",
            "1",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--batch-size",
            "8",
            "--epsilon",
            "3",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["model"] == str(model_dir) and len(res["accuracy"]) == 3
    assert 0 < res["max_epsilon"] <= 3.0 + 0.03
    assert FederationConfig.from_dict(res["config"]).data == str(data)


def test_server_side_bounds_and_insecure_flag_reach_the_runner(tmp_path, monkeypatch):
    args = build_parser().parse_args(
        [
            "federate",
            "--max-update-norm",
            "2.5",
            "--update-norm-policy",
            "reject",
            "--aggregation",
            "trimmed_mean",
            "--trim-fraction",
            "0.25",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.max_update_norm, cfg.update_norm_policy, cfg.aggregation, cfg.trim_fraction) == (
        2.5,
        "reject",
        "trimmed_mean",
        0.25,
    )
    seen = {}

    def fake_run_flower(cfg, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    from peft_lalora.federated.launcher import run as flower_run

    monkeypatch.setattr(flower_run, "run_flower", fake_run_flower)
    assert main(["federate", "--runner", "flower", "--out", str(tmp_path / "x.json")]) == 2
    assert seen["insecure"] is False  # secure (TLS + SuperNode auth) unless asked
    main(["federate", "--runner", "flower", "--insecure", "--out", str(tmp_path / "x.json")])
    assert seen["insecure"] is True
