"""Frozen-bottom federation (the harness's tasks with ``task_options='{"frozen_layers": k}'``): the split is
exact, only the top layers train, a prebuilt task is reused read-only, and bad values fail clearly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from dp_bench.data import tiny_bert  # noqa: E402
from dp_bench.frozen import BertTop, bert_attention_mask, encode_bottom, split_error  # noqa: E402
from peft_lalora.cli import main  # noqa: E402
from peft_lalora.federated import FederationConfig, run_simulation  # noqa: E402
from peft_lalora.federated.builders import build_evaluator, build_task  # noqa: E402
from peft_lalora.federated.client.dp_client import NamedInputsLoss  # noqa: E402

pytestmark = pytest.mark.slow

FROZEN1 = '{"frozen_layers": 1}'
CFG = dict(
    task="dp_bench.task:tiny",
    algo="la-lora",
    filter="none",
    num_clients=3,
    alpha=0.5,
    rounds=2,
    local_steps=2,
    batch_size=8,
    epsilon=2.0,
    n_train=96,
    n_test=48,
    seed=3,
    reproducible_noise=True,
)


def _ids(n: int = 6, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (n, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[:, seq - 5 :] = 0  # padding must be masked identically in both halves
    mask[0, 3:] = 0
    return ids, mask


def test_split_is_exact_and_restores_training_mode():
    model = tiny_bert(seed=1)  # train mode
    ids, mask = _ids()
    assert split_error(model, 1, ids, mask) < 1e-6
    assert model.training
    # a wrong split (top fed the embeddings instead of layer-0 output) is far off: the check can fail
    top = BertTop(model, 1).eval()
    h0 = model.bert.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))
    wrong = top(inputs_embeds=h0, attention_mask=mask).logits
    ref = model.eval()(input_ids=ids, attention_mask=mask).logits
    assert float((wrong - ref).abs().max()) > 1e-3


def test_bad_split_arguments():
    model = tiny_bert()
    ids, mask = _ids()
    for k in (0, 2, -1, 1.5):
        with pytest.raises(ValueError, match="frozen layers"):
            encode_bottom(model, k, ids, mask)
    with pytest.raises(ValueError, match="inputs_embeds"):
        BertTop(model, 1)(input_ids=ids, attention_mask=mask)
    with pytest.raises(TypeError, match="BertForSequenceClassification"):
        BertTop(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="frozen_layers must be >= 0"):
        build_task(FederationConfig(**{**CFG, "task_options": '{"frozen_layers": -1}'}))
    with pytest.raises(ValueError, match="unknown task_options"):
        build_task(FederationConfig(**{**CFG, "task_options": '{"frozen": 1}'}))
    with pytest.raises(ValueError, match="JSON object"):
        FederationConfig(**{**CFG, "task_options": "frozen_layers=1"})


def test_frozen_task_evaluates_exactly_like_the_full_model():
    full = build_task(FederationConfig(**CFG))
    cfg = FederationConfig(**{**CFG, "task_options": FROZEN1})
    frozen = build_task(cfg)
    assert frozen.columns == ("inputs_embeds", "attention_mask", "label")
    assert frozen.hidden["train"].shape == (96, 16, 32) and frozen.hidden["test"].shape == (48, 16, 32)
    ev_full, ev_frozen = build_evaluator(FederationConfig(**CFG), full), build_evaluator(cfg, frozen)
    # the initial adapters agree (LoRA B = 0, same seeded head), so the metrics must agree exactly
    a, b = ev_full(ev_full.initial_state()), ev_frozen(ev_frozen.initial_state())
    assert a["accuracy"] == b["accuracy"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    # the client data are the partition's rows of the cache
    ds = frozen.tensors("train", [5, 1])
    assert torch.equal(ds.tensors[0], frozen.hidden["train"][[5, 1]])
    with pytest.raises(ValueError, match="split must be"):
        frozen.tensors("validation")


def test_frozen_federation_trains_only_the_top_and_reuses_a_task_read_only():
    cfg = FederationConfig(**{**CFG, "task_options": FROZEN1})
    task = build_task(cfg)
    before = {k: v.clone() for k, v in task.hidden.items()}
    r1 = run_simulation(cfg, progress=False, task=task)
    r2 = run_simulation(dataclasses.replace(cfg, algo="dp-lora"), progress=False, task=task)
    r3 = run_simulation(cfg, progress=False)  # builds its own task
    assert all(torch.equal(before[k], task.hidden[k]) for k in before)
    lora = [k for k in r1.state if "lora_" in k]
    assert lora and all(k.startswith("base_model.model.layers.0.") for k in lora)  # only layer 1 of 2 adapts
    assert any("classifier" in k for k in r1.state)
    assert all(torch.equal(r1.state[k], r3.state[k]) for k in r1.state)  # reuse == fresh build (seeded noise)
    assert not all(torch.equal(r1.state[k], r2.state[k]) for k in r1.state)
    assert len(r1.accuracy) == 3 and 0 < r1.privacy["max_epsilon"] <= 2.0 + 0.02
    for c in r1.privacy["clients"].values():  # one calibrated σ and one q per client, recorded in the report
        assert len(c["noise_multipliers"]) == 1 and c["noise_multipliers"][0] > 0
        assert len(c["sample_rates"]) == 1 and 0 < c["sample_rates"][0] <= 1
    with pytest.raises(ValueError, match="task was built for"):
        run_simulation(dataclasses.replace(cfg, seed=4), progress=False, task=task)
    with pytest.raises(ValueError, match="task was built for"):
        run_simulation(dataclasses.replace(cfg, task_options=""), progress=False, task=task)


def test_named_inputs_loss_checks_arity():
    loss = NamedInputsLoss(("inputs_embeds", "attention_mask"))
    with pytest.raises(ValueError, match="expected 2 inputs"):
        loss(torch.nn.Identity(), [torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)])


def test_cli_task_options_reach_the_task_factory(tmp_path, capsys):
    tiny = ["federate", "--task", "dp_bench.task:tiny", "--rounds", "1", "--num-clients", "2", "--n-train", "32"]
    rc = main([*tiny, "--task-options", '{"pooling": "mean"}', "--out", str(tmp_path / "y.json")])
    assert rc == 2 and "frozen_layers >= 1" in capsys.readouterr().err
    rc = main([*tiny, "--task-options", '{"frozen_layers": 2}', "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "frozen layers must be an integer in [1, 1]" in capsys.readouterr().err


def test_mean_pooling_head_and_its_guard():
    model = tiny_bert(seed=2).eval()
    ids, mask = _ids()
    h = encode_bottom(model, 1, ids, mask)
    top = BertTop(model, 1, pooling="mean").eval()
    assert top.pooler is None
    last = model.bert.encoder.layer[1](h, _mask(model, h, mask))
    last = last[0] if isinstance(last, tuple) else last
    w = mask.unsqueeze(-1).float()
    expected = model.classifier((last * w).sum(1) / w.sum(1))
    assert torch.allclose(top(inputs_embeds=h, attention_mask=mask).logits, expected, atol=1e-6)
    with pytest.raises(ValueError, match="pooling"):
        BertTop(model, 1, pooling="max")
    with pytest.raises(ValueError, match="frozen_layers >= 1"):
        build_task(FederationConfig(**{**CFG, "task_options": '{"pooling": "mean"}'}))
    task = build_task(FederationConfig(**{**CFG, "task_options": '{"pooling": "mean", "frozen_layers": 1}'}))
    assert task.model().pooling == "mean"


def _mask(model, h, mask):
    return bert_attention_mask(model.config, h, mask)
