"""The libraries' test support (``text_support``, ``fed_tiny``) is the harness's tiny task, bit for bit: the same
synthetic data (every column, features and format), the same tiny BERT weights and config, the same argument
errors, and a federation on ``task="fed_tiny:tiny"`` ends at the same global adapter as on ``dp_bench.task:tiny``.
So the libraries' tests can drop the harness import without a number changing. (A harness test: it imports
``dp_bench``.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("datasets")
dp_data = pytest.importorskip("dp_bench.data")

import text_support  # noqa: E402

pytestmark = pytest.mark.slow

TASK_CASES = [
    dict(n=1, seq_len=4),
    dict(n=37, seq_len=16, seed=0),
    dict(n=64, seq_len=16, seed=3, num_labels=2),
    dict(n=50, seq_len=8, seed=11, num_labels=5),
    dict(n=20, seq_len=12, seed=7, num_labels=3, vocab_size=30, min_len=1, triggers_per_example=1),
    dict(n=9, seq_len=6, seed=2, min_len=6, triggers_per_example=6),
    dict(n=5, seq_len=4, seed=4, min_len=0, triggers_per_example=1),  # empty rows: the trigger lands in padding
]


def _assert_same_dataset(ours, theirs) -> None:
    assert ours.features == theirs.features and ours.format == theirs.format and len(ours) == len(theirs)
    a, b = ours[:], theirs[:]
    assert list(a) == list(b)
    for col in a:
        assert a[col].dtype == b[col].dtype == torch.int64, col
        assert torch.equal(a[col], b[col]), col


def _assert_same_state(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("case", TASK_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_synthetic_text_task_is_the_harness_task(case: dict) -> None:
    n, seq_len = case["n"], case["seq_len"]
    rest = {k: v for k, v in case.items() if k not in ("n", "seq_len")}
    ours = text_support.synthetic_text_task(n, seq_len, **rest)
    _assert_same_dataset(ours, dp_data.synthetic_text_task(n, seq_len, **rest))
    rows = ours[:]
    assert int(rows["attention_mask"].sum(1).min()) >= case.get("min_len", seq_len // 2)
    assert torch.equal(rows["input_ids"] == 0, rows["attention_mask"] == 0)  # padding exactly where masked


def test_a_different_seed_gives_different_data() -> None:
    a, b = (text_support.synthetic_text_task(32, 16, seed=s)[:] for s in (0, 1))
    assert not torch.equal(a["input_ids"], b["input_ids"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=0),
        dict(n=4, seq_len=0),
        dict(n=4, seq_len=1),  # min_len 0 < 2 triggers
        dict(n=4, seq_len=8, min_len=9),
        dict(n=4, seq_len=8, triggers_per_example=0),
        dict(n=4, seq_len=8, num_labels=4, vocab_size=5),
    ],
)
def test_argument_errors_are_the_harness_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError) as theirs:
        dp_data.synthetic_text_task(**kwargs)
    with pytest.raises(ValueError) as ours:
        text_support.synthetic_text_task(**kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(seed=1), dict(num_labels=3, seed=5), dict(num_labels=2, seed=0, vocab_size=50), dict(seed=2)],
)
def test_tiny_bert_has_the_harness_weights_and_leaves_the_rng_alone(kwargs: dict) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    ours = text_support.tiny_bert(**kwargs)
    assert torch.equal(torch.random.get_rng_state(), before)
    theirs = dp_data.tiny_bert(**kwargs)
    assert ours.training and theirs.training and type(ours) is type(theirs)
    assert ours.config.to_dict() == theirs.config.to_dict()
    _assert_same_state(ours.state_dict(), theirs.state_dict())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


def test_tiny_bert_seeds_differ() -> None:
    a, b = text_support.tiny_bert(seed=0).state_dict(), text_support.tiny_bert(seed=1).state_dict()
    assert not torch.equal(a["classifier.weight"], b["classifier.weight"])


@pytest.mark.parametrize("args", [(), (3,), (2, 50, 64)])
def test_tiny_bert_config_is_the_harness_config(args: tuple) -> None:
    assert text_support.tiny_bert_config(*args).to_dict() == dp_data.tiny_bert_config(*args).to_dict()


SMALL = dict(num_clients=2, n_train=32, n_test=16, seed=3)


@pytest.mark.parametrize("sizes", [dict(), dict(n_train=40, n_test=12, seq_len=8, num_labels=3, seed=1)])
def test_fed_tiny_builds_the_harness_task(sizes: dict) -> None:
    from peft_lalora.federated import FederationConfig, build_task

    cfg = FederationConfig(**{**SMALL, **sizes, "task": "fed_tiny:tiny"})
    ours = build_task(cfg)
    theirs = build_task(FederationConfig(**{**SMALL, **sizes, "task": "dp_bench.task:tiny"}))
    assert not ours.loaded("train") and not ours.loaded("test")  # loaders: the Flower server reads no client data
    for attr in ("name", "num_labels", "columns", "group_column", "test_from_train", "input_names"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert {k: v for k, v in ours.key.items() if k != "task"} == {k: v for k, v in theirs.key.items() if k != "task"}
    for split in ("train", "test"):
        _assert_same_dataset(getattr(ours, split), getattr(theirs, split))
        for a, b in zip(ours.tensors(split, [0, 2]).tensors, theirs.tensors(split, [0, 2]).tensors, strict=True):
            assert torch.equal(a, b)
    _assert_same_state(ours.model().state_dict(), theirs.model().state_dict())


def test_fed_tiny_refuses_task_options() -> None:
    from peft_lalora.federated import FederationConfig, build_task

    assert build_task(FederationConfig(**{**SMALL, "task": "fed_tiny:tiny", "task_options": "{}"})).num_labels == 2
    with pytest.raises(ValueError, match="fed_tiny:tiny takes no task_options"):
        build_task(FederationConfig(**{**SMALL, "task": "fed_tiny:tiny", "task_options": '{"frozen_layers": 1}'}))


@pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")
def test_a_federation_on_fed_tiny_ends_at_the_harness_adapter() -> None:
    """One round, two clients, LA-LoRA with the binomial filter and calibrated noise (seeded: reproducible_noise)."""
    pytest.importorskip("opacus_spectral")
    pytest.importorskip("flwr_datasets")
    from peft_lalora.federated import FederationConfig, run_simulation

    torch.set_num_threads(1)
    run = dict(SMALL, algo="la-lora", filter="binomial5", alpha=1.0, rounds=1, local_steps=2, batch_size=8)
    run.update(epsilon=5.0, reproducible_noise=True)
    ours = run_simulation(FederationConfig(**run, task="fed_tiny:tiny"), progress=False)
    theirs = run_simulation(FederationConfig(**run, task="dp_bench.task:tiny"), progress=False)
    _assert_same_state(ours.state, theirs.state)
    assert ours.accuracy == theirs.accuracy
    assert ours.privacy["clients"] == theirs.privacy["clients"]
    trained_b = [k for k in ours.state if "lora_B" in k and bool(ours.state[k].any())]
    assert trained_b, "the round trained nothing (LoRA B starts at zero)"
