"""Length-sorted physical batches for the frozen-text bed (``dp-bench grid --model minilm --physical-batch``):
trimming all-padding columns leaves the logits unchanged, the sorted sampler keeps every Poisson batch's examples,
and a DP run split into sorted, trimmed physical batches trains the same weights as one whole batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("opacus_spectral")
pytest.importorskip("peft")

from dp_bench.adapters import Trainable, build_top  # noqa: E402
from dp_bench.data import tiny_bert  # noqa: E402
from dp_bench.frozen import BertTop, encode_bottom, trim_padding  # noqa: E402
from dp_bench.task import FROZEN_INPUTS, FrozenTextTask  # noqa: E402
from dp_bench.train import LengthSortedBatches, run_dp  # noqa: E402


def _data(n: int = 48, seq: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (n, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (n,), generator=g)
    lengths[0] = seq  # one full-length row, as in a real batch of many
    mask = (torch.arange(seq) < lengths[:, None]).long()
    labels = torch.randint(0, 2, (n,), generator=g)
    return ids, mask, labels


def test_trim_drops_only_columns_that_are_padding_in_every_row_and_keeps_the_logits() -> None:
    h = torch.randn(3, 6, 4)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]])  # one left-padded row
    th, tm = trim_padding(h, mask)
    assert tm.shape == (3, 4) and torch.equal(tm, mask[:, :4]) and torch.equal(th, h[:, :4])
    full = torch.ones(2, 5, dtype=torch.long)
    assert trim_padding(h[:2, :5], full)[1] is full  # nothing to drop: the same tensors back
    model = tiny_bert(seed=1).eval()
    ids, mask, _ = _data(8, 20)
    mask[:, 12:] = 0  # every row padded past 12: the trimmed batch is 8 columns shorter
    hidden = encode_bottom(model, 1, ids, mask)
    for pooling in ("cls", "mean"):
        ref = BertTop(model, 1, pooling=pooling).eval()(inputs_embeds=hidden, attention_mask=mask).logits
        got = (
            BertTop(model, 1, pooling=pooling, trim_padding=True)
            .eval()(inputs_embeds=hidden, attention_mask=mask)
            .logits
        )
        assert torch.allclose(got, ref, atol=1e-5), pooling


def test_length_sorted_batches_keep_each_batch_and_sort_it() -> None:
    lengths = [5, 1, 4, 1, 3]
    batches = [[0, 1, 2], [], [4, 3, 1, 0]]
    out = list(LengthSortedBatches(batches, lengths))
    assert out == [[1, 2, 0], [], [1, 3, 4, 0]]  # ties by index, empty batches kept
    assert len(LengthSortedBatches(batches, lengths)) == 3


def test_dp_run_in_sorted_trimmed_physical_batches_trains_the_same_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import dp_bench.frozen as frozen

    widths: list[int] = []

    def spy(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = trim_padding(hidden, mask)
        widths.append(out[1].shape[1])
        return out

    monkeypatch.setattr(frozen, "trim_padding", spy)  # what BertTop.forward calls
    base = tiny_bert(seed=2)
    ids, mask, labels = _data(64, 20)
    hidden = encode_bottom(base, 1, ids, mask)
    train = torch.utils.data.TensorDataset(hidden, mask, labels)
    task = FrozenTextTask(base, 1, train, train)

    def trained(split: bool) -> tuple[list[torch.Tensor], list[float]]:
        model = build_top(task, Trainable.parse("lora:qv:4"), seed=0, trim_padding=split)
        for m in model.modules():  # dropout off: the two runs then differ only by float rounding
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model.config.attention_probs_dropout_prob = 0.0
        for m in model.modules():
            if hasattr(m, "dropout_prob"):
                m.dropout_prob = 0.0
        r = run_dp(
            model,
            train,
            train,
            input_names=FROZEN_INPUTS,
            post_hooks=[],
            noise_multiplier=1.0,
            batch_size=32,
            steps=4,
            seed=0,
            lr=0.5,
            optimizer="sgd",
            physical_batch=8 if split else 32,
            eval_at=(4,),
            oracle=False,
            per_param=False,
            grad_sample_mode="hooks",
            sort_by=mask.sum(1).tolist() if split else None,
        )
        return [p.detach().clone() for p in model.parameters() if p.requires_grad], [e["loss"] for e in r["per_step"]]

    whole, _ = trained(False)
    assert not widths  # the whole-batch run never trims
    split, _ = trained(True)
    assert widths and min(widths) < 20  # the sorted physical batches really ran shorter than the padded 20
    start = build_top(task, Trainable.parse("lora:qv:4"), seed=0)
    moved = [p.detach() for p in start.parameters() if p.requires_grad]
    assert max(float((a - b).abs().max()) for a, b in zip(whole, moved, strict=True)) > 1e-3  # it trained
    for a, b in zip(whole, split, strict=True):  # same Poisson batches, clipped sums and noise draws
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
