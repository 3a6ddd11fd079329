"""`peft-lalora federate --save-adapter DIR` hands the trained adapter back: DIR loads with
``PeftModel.from_pretrained`` (after ``import peft_lalora``) and DIR/lora is a plain-PEFT LoRA copy, both with
the logits of the federation's final global adapter — for the in-process runner and the Flower runner."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft import PeftModel  # noqa: E402
from peft_lalora.cli import main  # noqa: E402
from peft_lalora.federated.builders import make_peft_model  # noqa: E402
from peft_lalora.federated.client.adapter_state import load_adapter_state, trainable_parameters  # noqa: E402
from peft_lalora.federated.config import FederationConfig  # noqa: E402
from peft_lalora.federated.data.task import build_task  # noqa: E402
from peft_lalora.federated.simulation import run_simulation  # noqa: E402

import peft_lalora  # noqa: E402,F401 - registers the LALORA PEFT type

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning"),
]


def _logits(model, task, n: int = 8) -> torch.Tensor:
    batch = task.tensors("test", list(range(n))).tensors
    model.eval()
    with torch.no_grad():
        return model(**dict(zip(task.input_names, batch[:-1], strict=True))).logits


def _reference(cfg: FederationConfig, task, state) -> torch.nn.Module:
    model = make_peft_model(cfg, task)
    load_adapter_state(trainable_parameters(model), state)
    return model


def _assert_reloads(cfg, task, state, adapter_dir, base_factory, atol=0.0):
    ref = _logits(_reference(cfg, task, state), task)
    untrained = _logits(make_peft_model(cfg, task), task)
    assert not torch.allclose(ref, untrained), "the run did not change the adapter: the test would prove nothing"
    lalora = PeftModel.from_pretrained(base_factory(), str(adapter_dir))
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["peft_type"] == "LALORA"
    torch.testing.assert_close(_logits(lalora, task), ref, rtol=0, atol=atol)
    lora = PeftModel.from_pretrained(base_factory(), str(adapter_dir / "lora"))
    assert json.loads((adapter_dir / "lora" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    torch.testing.assert_close(_logits(lora, task), ref, rtol=0, atol=atol)


def _assert_record(privacy: dict, adapter_dir) -> None:
    """The federation's ε travels with both saved adapters (issue 49): ``privacy_record.json`` in DIR and DIR/lora,
    and in the LALoRA adapter's config; one privacy unit per client, its worst ε the ledger's max ε."""
    from opacus_spectral.accounting import read_privacy_record

    delta, accountant = privacy["delta"], privacy["accountant"]
    for folder in (adapter_dir, adapter_dir / "lora"):
        record = read_privacy_record(folder)
        assert len({r.unit for r in record.runs}) == len(record.runs) == len(privacy["clients"]) >= 2
        assert record.worst_epsilon(delta, accountant) == pytest.approx(privacy["max_epsilon"], rel=1e-9)
        assert record.worst_epsilon(delta, accountant) < record.epsilon(delta, accountant)  # composing all: looser
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["privacy_record"]["runs"] == json.loads((adapter_dir / "privacy_record.json").read_text())["runs"]


def test_simulation_saves_an_adapter_with_identical_logits(tmp_path):
    from fed_support import user_model_and_data
    from transformers import AutoModelForSequenceClassification

    model_dir, data = user_model_and_data(tmp_path, "csv")
    user = [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--text-column",
        "review",
        "--label-column",
        "sentiment",
        "--seq-len",
        "8",
        "--num-clients",
        "2",
        "--alpha",
        "1",
        "--rounds",
        "1",
        "--local-steps",
        "2",
        "--batch-size",
        "8",
        "--epsilon",
        "3",
        "--reproducible-noise",
        "--seed",
        "2",
    ]
    adapter = tmp_path / "adapter"
    rc = main(["federate", *user, "--no-progress", "--out", str(tmp_path / "r.json"), "--save-adapter", str(adapter)])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    record = str(adapter / "privacy_record.json")
    assert res["adapter"] == {"adapter": str(adapter), "lora": str(adapter / "lora"), "record": record}
    _assert_record(res["privacy"], adapter)
    cfg = FederationConfig.from_dict(res["config"])
    task = build_task(cfg)
    state = run_simulation(cfg, progress=False, task=task).state  # the same run again (reproducible noise)

    def base():
        return AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)

    _assert_reloads(cfg, task, state, adapter, base)


def test_flower_runner_forwards_save_adapter_and_keep_workdir(tmp_path, monkeypatch):
    from peft_lalora.federated.launcher import run as flower_run

    seen = {}

    def fake_run_flower(cfg, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(flower_run, "run_flower", fake_run_flower)
    argv = ["federate", "--task", "fed_tiny:tiny", "--runner", "flower", "--out", str(tmp_path / "x.json")]
    assert main([*argv, "--save-adapter", str(tmp_path / "a"), "--keep-workdir"]) == 2
    assert seen["save_adapter"] == tmp_path / "a" and seen["keep_workdir"] is True
    assert main(argv) == 2
    assert seen["save_adapter"] is None and seen["keep_workdir"] is False


@pytest.mark.flower
def test_flower_run_saves_the_adapter_and_removes_its_private_workdir(tmp_path, monkeypatch):
    """One small real federation (test_fed_runners.CFG, one round): the adapter is saved, the temp folder with
    the CA and node keys is gone afterwards, and no process is left."""
    pytest.importorskip("flwr")
    from fed_support import CFG, marked_processes
    from peft_lalora.federated.launcher import run as flower_run
    from peft_lalora.federated.launcher import run_flower

    made = []
    real_new = flower_run.new_workdir
    monkeypatch.setattr(flower_run, "new_workdir", lambda: made.append(real_new()) or made[-1])
    torch.set_num_threads(1)
    cfg = FederationConfig(**{**CFG, "rounds": 1})
    t0 = time.perf_counter()
    out = run_flower(cfg, threads=1, timeout=600, save_adapter=tmp_path / "adapter")
    print(f"flower run with --save-adapter: {time.perf_counter() - t0:.1f}s")
    assert len(made) == 1 and not made[0].exists()
    assert out["workdir"] is None and out["state_path"] is None
    assert out["leftover_pids"] == [] and marked_processes(out["federation_id"]) == []
    task = build_task(cfg)
    sim = run_simulation(cfg, progress=False, task=task)  # Flower's global adapter is this one (test_fed_deploy)
    _assert_reloads(cfg, task, sim.state, tmp_path / "adapter", task.model, atol=1e-5)
    _assert_record(out["privacy"], tmp_path / "adapter")
