"""`peft-lalora federate` CLI: algorithm -> alternation mapping and a 2-round smoke run on --model tiny."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.cli import config_from_args, build_parser, main  # noqa: E402


@pytest.mark.parametrize(
    ("algo", "mode"), [("dp-lora", "none"), ("ffa-lora", "freeze_a"), ("rolora", "round"), ("la-lora", "step")]
)
def test_algorithms_are_lalora_config_modes(algo, mode):
    from peft_lalora.federated.federation import make_peft_config

    from peft_lalora import LALoraConfig

    cfg = config_from_args(build_parser().parse_args(["federate", "--algo", algo]))
    pc = make_peft_config(cfg)
    assert isinstance(pc, LALoraConfig) and pc.alternation == mode


def test_filters_map_to_post_hooks():
    cfg = config_from_args(build_parser().parse_args(["federate", "--filter", "binomial5"]))
    assert cfg.client_config().post_hooks == [("lowpass", {"kernel": "binomial5"})]
    cfg = config_from_args(build_parser().parse_args(["federate", "--filter", "none"]))
    assert cfg.client_config().post_hooks == []


def test_reproducible_noise_is_an_explicit_opt_in():
    assert config_from_args(build_parser().parse_args(["federate"])).reproducible_noise is False
    cfg = config_from_args(build_parser().parse_args(["federate", "--reproducible-noise"]))
    assert cfg.reproducible_noise is True and cfg.client_config().reproducible_noise is True


def test_federate_smoke_two_rounds(tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = main(
        [
            "federate",
            "--algo",
            "la-lora",
            "--filter",
            "binomial5",
            "--clients",
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
            "--model",
            "tiny",
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
    assert sum(map(sum, res["partition"]["label_histograms"])) == 96
    assert res["noise"]["reproducible"] is False and res["config"]["reproducible_noise"] is False
    assert res["failed_rounds"] == []
    assert "max ε" in capsys.readouterr().out


def test_bad_arguments_exit_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["federate", "--algo", "lora"])
    rc = main(["federate", "--fraction", "0", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "fraction" in capsys.readouterr().err


def test_server_side_bounds_and_insecure_flag_reach_the_runner(tmp_path, monkeypatch):
    args = build_parser().parse_args(
        ["federate", "--max-update-norm", "2.5", "--update-norm-policy", "reject", "--aggregation", "trimmed_mean",
         "--trim-fraction", "0.25"]  # fmt: skip
    )
    cfg = config_from_args(args)
    assert (cfg.max_update_norm, cfg.update_norm_policy, cfg.aggregation, cfg.trim_fraction) == (
        2.5, "reject", "trimmed_mean", 0.25,
    )  # fmt: skip
    seen = {}

    def fake_run_flower(cfg, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    from peft_lalora.federated import launcher

    monkeypatch.setattr(launcher, "run_flower", fake_run_flower)
    assert main(["federate", "--runner", "flower", "--out", str(tmp_path / "x.json")]) == 2
    assert seen["insecure"] is False  # secure (TLS + SuperNode auth) unless asked
    main(["federate", "--runner", "flower", "--insecure", "--out", str(tmp_path / "x.json")])
    assert seen["insecure"] is True
