"""A result's ``config`` records the settings its run read: a setting only another bed reads is None (the §10 grid
JSONs recorded MiniLM's ``trainable: lora:qv:8, top_layers: 1`` for SmolLM2 LoRA r = 32 on all 30 layers), and a
stored record is corrected the same way when it is loaded, so a grid resumes across the change."""

from __future__ import annotations

from dp_bench.commands import grid
from dp_bench.config import as_json, parse_config, recorded_config


def config(*argv: str) -> grid.Config:
    return parse_config(grid.Config, list(argv), prog="dp-bench grid", description="")


def test_a_setting_the_bed_does_not_read_is_recorded_as_none() -> None:
    lm = as_json(config("--model", "smollm2", "--grad-sample-mode", "hooks"))
    assert lm["trainable"] is None and lm["top_layers"] is None and lm["val_size"] is None
    assert (lm["block_size"], lm["val_blocks"], lm["test_blocks"]) == (32, 256, 512)
    text = as_json(config("--model", "minilm", "--trainable", "lora:qkv:16", "--top-layers", "2"))
    assert (text["trainable"], text["top_layers"], text["val_size"]) == ("lora:qkv:16", 2, 5000)
    assert text["block_size"] is None and as_json(config())["trainable"] is None  # the MLP trains its own weights


def test_a_stored_record_is_corrected_and_still_resumes() -> None:
    now = as_json(config("--model", "smollm2", "--grad-sample-mode", "hooks"))
    before = {**now, "trainable": "lora:qv:8", "top_layers": 1, "val_size": 5000}  # what the old harness wrote
    assert not grid.resumable(before, now)
    fixed = recorded_config(before, grid.Config)
    assert fixed == now and grid.resumable(fixed, now)
    assert grid.REPORT.upgrade({"config": before})["config"] == now
