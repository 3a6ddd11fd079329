"""FedAvg of LoRA A, B and head: exact weighted means, validation with reasons, no in-place writes."""

from __future__ import annotations

import math

import pytest
import torch
from peft_lalora.federated.server.aggregate import AggregationError, factor_of, fedavg

A = "base_model.model.enc.q.lora_A.weight"
B = "base_model.model.enc.q.lora_B.weight"
H = "base_model.model.classifier.modules_to_save.weight"


def _state(a, b, h):
    return {
        A: torch.tensor(a, dtype=torch.float32),
        B: torch.tensor(b, dtype=torch.float32),
        H: torch.tensor(h, dtype=torch.float32),
    }


S1 = _state([[1.0, 2.0]], [[0.0], [4.0]], [[1.0, 1.0]])
S2 = _state([[3.0, 6.0]], [[2.0], [0.0]], [[5.0, -3.0]])
S3 = _state([[5.0, 10.0]], [[4.0], [8.0]], [[0.0, 2.0]])


def test_uniform_mean_of_each_factor_and_head():
    res = fedavg([S1, S2, S3])
    assert res.state[A].tolist() == [[3.0, 6.0]]
    assert res.state[B].tolist() == [[2.0], [4.0]]
    assert res.state[H].tolist() == [[2.0, 0.0]]
    assert res.accepted == [0, 1, 2] and res.rejected == []
    assert res.factors == {"A": 1, "B": 1, "other": 1}


def test_weighted_by_examples():
    res = fedavg([S1, S2], weights=[1, 3])
    assert res.state[A].tolist() == [[2.5, 5.0]]
    assert res.state[B].tolist() == [[1.5], [1.0]]
    assert res.state[H].tolist() == [[4.0, -2.0]]
    assert res.weights == [0.25, 0.75]


def test_factors_averaged_separately_not_their_product():
    res = fedavg([S1, S2])
    # FedAvg of factors: mean(B) @ mean(A) differs from mean(B @ A); we must return the former.
    prod_of_means = res.state[B] @ res.state[A]
    mean_of_prods = (S1[B] @ S1[A] + S2[B] @ S2[A]) / 2
    assert torch.equal(prod_of_means, torch.tensor([[2.0, 4.0], [4.0, 8.0]]))
    assert not torch.equal(prod_of_means, mean_of_prods)


def test_server_learning_rate():
    g = _state([[1.0, 1.0]], [[1.0], [1.0]], [[1.0, 1.0]])
    res = fedavg([S1, S2], global_state=g, server_lr=0.5)
    # g + 0.5*(avg - g); avg A = [2, 4] -> [1.5, 2.5]
    assert res.state[A].tolist() == [[1.5, 2.5]]
    assert res.state[B].tolist() == [[1.0], [1.5]]
    assert res.state[H].tolist() == [[2.0, 0.0]]
    with pytest.raises(ValueError, match="global_state"):
        fedavg([S1, S2], server_lr=0.5)


def test_rejects_nan_wrong_shape_missing_key_with_reasons_and_continues():
    nan = {k: v.clone() for k, v in S2.items()}
    nan[B][1, 0] = math.nan
    shape = {k: v.clone() for k, v in S2.items()}
    shape[A] = torch.zeros(2, 2)
    missing = {k: v.clone() for k, v in S2.items() if k != H}
    dtype = {k: v.clone() for k, v in S2.items()}
    dtype[H] = dtype[H].double()
    res = fedavg([S1, nan, shape, missing, dtype, S3], weights=[1, 1, 1, 1, 1, 3], client_ids=list("abcdef"))
    reasons = {r.client: r.reason for r in res.rejected}
    assert set(reasons) == {"b", "c", "d", "e"}
    assert "non-finite" in reasons["b"] and B in reasons["b"]
    assert "shape mismatch" in reasons["c"] and A in reasons["c"]
    assert "missing keys" in reasons["d"] and H in reasons["d"]
    assert "dtype mismatch" in reasons["e"]
    assert res.accepted == [0, 5]
    assert res.state[A].tolist() == [[4.0, 8.0]]  # (1*[1,2] + 3*[5,10]) / 4


def test_numpy_weights_accepted():
    np = pytest.importorskip("numpy")
    res = fedavg([S1, S2], weights=np.array([1, 3], dtype=np.int64))
    assert res.state[A].tolist() == [[2.5, 5.0]] and res.rejected == []


def test_bad_weight_and_extra_key_rejected():
    extra = dict(S2)
    extra["x.lora_A.weight"] = torch.zeros(1)
    res = fedavg([S1, S2, extra, S3], weights=[1, 0, 1, 1])
    reasons = {r.index: r.reason for r in res.rejected}
    assert "weight" in reasons[1]
    assert "unexpected keys" in reasons[2]
    assert res.state[A].tolist() == [[3.0, 6.0]]


def test_reference_is_global_state_when_given():
    g = {k: v.double() for k, v in S1.items()}
    with pytest.raises(AggregationError, match="dtype mismatch") as err:
        fedavg([S1, S2], global_state=g)
    assert len(err.value.rejected) == 2


def test_below_min_clients_raises_clear_error():
    nan = {k: v.clone() for k, v in S2.items()}
    nan[A][0, 0] = math.inf
    with pytest.raises(AggregationError, match=r"only 1 valid update\(s\) of 2, need min_clients=2") as err:
        fedavg([S1, nan], min_clients=2)
    assert err.value.rejected[0].index == 1
    assert fedavg([S1, nan], min_clients=1).accepted == [0]


def test_never_writes_into_client_tensors_and_returns_fresh_tensors():
    before = [{k: v.clone() for k, v in s.items()} for s in (S1, S2)]
    res = fedavg([S1, S2])
    for s, b in zip((S1, S2), before, strict=True):
        assert all(torch.equal(s[k], b[k]) for k in s)
    single = fedavg([S1])
    for k in S1:
        assert torch.equal(single.state[k], S1[k])
        assert single.state[k].data_ptr() != S1[k].data_ptr()
    res.state[A].add_(100.0)
    assert S1[A].tolist() == [[1.0, 2.0]] and S2[A].tolist() == [[3.0, 6.0]]


def test_dtype_preserved_bf16():
    s1 = {k: v.bfloat16() for k, v in S1.items()}
    s2 = {k: v.bfloat16() for k, v in S2.items()}
    res = fedavg([s1, s2])
    assert res.state[A].dtype == torch.bfloat16
    assert res.state[A].float().tolist() == [[2.0, 4.0]]


def test_argument_errors():
    with pytest.raises(ValueError, match="weights"):
        fedavg([S1, S2], weights=[1.0])
    with pytest.raises(ValueError, match="min_clients"):
        fedavg([S1], min_clients=0)
    with pytest.raises(ValueError, match="server_lr"):
        fedavg([S1], server_lr=float("nan"))
    with pytest.raises(ValueError, match="non-floating"):
        fedavg([{"n": torch.tensor([1])}])
    with pytest.raises(AggregationError):
        fedavg(["not a state"])  # type: ignore[list-item]


def test_factor_of():
    assert factor_of(A) == "A" and factor_of(B) == "B" and factor_of(H) == "other"
    assert factor_of("m.q.lora_A.default.weight") == "A"
