"""The privacy-invariant matrix of the engine (DESIGN invariant 8; docs/engine.md, "Batch independence" and "Reduced
precision"): for grad-sample modes hooks / functorch / ghost / ew × float32 / bf16 autocast,

* removing a record moves the sum of clipped gradients by at most C, and by exactly that record's own clipped
  gradient (computed in a batch of its own): no other record's contribution changed;
* lengthening a record changes the sum by exactly its own change;
* every record's clipped contribution has norm ≤ C·(1 + 1e-6) (bf16 autocast: clipping in float32);

and the engine's batch-independence check catches the set-ups that break it (left padding with absolute positions, a
padded batch without attention mask) at the first training forward, while leaving a correct run bit-identical.

The model: token embeddings + learned absolute positions (``arange`` unless ``position_ids`` are given, like GPT-2),
a tanh layer and a masked mean-pool into a 5-class head; records of 3–11 tokens, padded by a collator of either side.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus_spectral.errors import BatchCheckWarning, BatchDependenceError
from torch import nn
from torch.utils.data import DataLoader

from opacus_spectral import PrivacyEngine

C = 1e-3  # every record is clipped (gradient norms are ~0.1–1)
VOCAB, CLASSES, MAX_T = 40, 5, 24
MODES = ["hooks", "functorch", "ghost", "ew"]
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
#: relative tolerance of "the others' contributions are unchanged" (different padding changes the summation order)
TOL = {"fp32": 1e-5, "bf16": 2e-2}


class TokenModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb, self.pos = nn.Embedding(VOCAB, 16), nn.Embedding(MAX_T, 16)
            self.hidden, self.head = nn.Linear(16, 16), nn.Linear(16, CLASSES)

    def forward(self, ids, mask=None, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)  # contiguous: Opacus ghost views it
        h = torch.tanh(self.hidden(self.emb(ids) + self.pos(position_ids)))
        weights = torch.ones_like(ids, dtype=h.dtype) if mask is None else mask.to(h.dtype)
        return self.head((h * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True).clamp(min=1))


def records(n: int = 6, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (i * 5) % 9 if i else 11  # record 0 is the longest
        out.append({"ids": torch.randint(1, VOCAB, (length,), generator=g), "label": i % CLASSES})
    return out


def collate(side: str = "right", with_mask: bool = True):
    def fn(items):
        t = max(len(x["ids"]) for x in items)
        ids = torch.zeros(len(items), t, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(items):
            cols = slice(t - len(x["ids"]), t) if side == "left" else slice(0, len(x["ids"]))
            ids[i, cols], mask[i, cols] = x["ids"], 1
        labels = torch.tensor([x["label"] for x in items])
        return (ids, mask, labels) if with_mask else (ids, labels)

    return fn


def private(mode: str, items: list[dict], noise_seed: int | None = None, **kw):
    """(the model, the engine, what make_private returned) for one batch of all ``items`` (sample rate 1)."""
    model = TokenModel()
    engine = PrivacyEngine(noise_seed=noise_seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(items, batch_size=len(items), collate_fn=kw.pop("collate_fn", collate()))
    extra = {"criterion": nn.CrossEntropyLoss(reduction="sum")} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=kw.pop("noise_multiplier", 0.0),
            max_grad_norm=C,
            allow_non_private=True,
            loss_reduction="sum",
            grad_sample_mode=mode,
            **extra,
            **kw,
        )
    return model, engine, out


def clipped_sum(mode: str, dtype: str, items: list[dict], side: str = "right") -> torch.Tensor:
    """The released gradient of one step on ``items`` with noise 0 and loss_reduction='sum': the clipped sum."""
    model, _, out = private(mode, items, doctor=False, batch_check=False)
    module, opt = out[0], out[1]
    ids, mask, labels = collate(side)(items)
    with torch.autocast("cpu", dtype=DTYPES[dtype] or torch.bfloat16, enabled=DTYPES[dtype] is not None):
        logits = module(ids, mask)
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss(reduction="sum")
    loss = criterion(logits.float(), labels)
    loss.backward()
    opt.step()
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


CELLS = [(m, d) for m in MODES for d in DTYPES if m in ("hooks", "functorch") or d == "fp32"]


@pytest.mark.parametrize(("mode", "dtype"), CELLS)
def test_removing_a_record_moves_the_clipped_sum_by_exactly_its_own_clipped_gradient(mode, dtype):
    items = records()
    diff = clipped_sum(mode, dtype, items) - clipped_sum(mode, dtype, items[1:])
    own = clipped_sum(mode, dtype, items[:1])
    assert diff.norm().item() <= C * (1 + 1e-6)
    torch.testing.assert_close(diff, own, rtol=0, atol=TOL[dtype] * C)


@pytest.mark.parametrize(("mode", "dtype"), CELLS)
def test_lengthening_a_record_changes_the_clipped_sum_by_its_own_change_only(mode, dtype):
    items = records()
    longer = [*items[:3], {**items[3], "ids": torch.cat([items[3]["ids"], items[0]["ids"][:5]])}, *items[4:]]
    diff = clipped_sum(mode, dtype, longer) - clipped_sum(mode, dtype, items)
    own = clipped_sum(mode, dtype, longer[3:4]) - clipped_sum(mode, dtype, items[3:4])
    assert diff.norm().item() <= 2 * C * (1 + 1e-6)
    torch.testing.assert_close(diff, own, rtol=0, atol=TOL[dtype] * C)


@pytest.mark.parametrize(("mode", "dtype"), CELLS)
def test_every_records_clipped_contribution_has_norm_at_most_C(mode, dtype):
    """bf16 autocast in hooks mode clipped per-sample gradients in bfloat16: 1.0076·C before the float32 clip."""
    for item in records():
        norm = clipped_sum(mode, dtype, [item]).norm().item()
        assert C * 0.999 <= norm <= C * (1 + 1e-6), (mode, dtype, norm / C)


@pytest.mark.parametrize("mode", ["ghost", "ew"])
def test_ghost_and_ew_under_autocast_are_refused_at_the_forward(mode):
    """Ghost clipping clipped to 1.011·C under bf16; ExpandedWeights failed with a raw dtype error."""
    _, _, out = private(mode, records(), doctor=False, batch_check=False)
    ids, mask, _ = collate()(records())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="grad_sample_mode='hooks'"):
        out[0](ids, mask)


def train_one_step(mode: str, items: list[dict], side: str, with_mask: bool = True, **kw) -> tuple:
    """One step of a user's loop over the DP loader: ``module(ids, mask)`` (or ``module(ids)``), per-example CE;
    returns the model and the engine."""
    model, engine, out = private(mode, items, collate_fn=collate(side, with_mask), **kw)
    module, opt, loader = out[0], out[1], out[-1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss(reduction="sum")
    for batch in loader:
        opt.zero_grad()
        crit(module(*batch[:-1]), batch[-1]).backward()
        opt.step()
        break
    return model, engine


@pytest.mark.parametrize("mode", MODES)
def test_left_padding_with_absolute_positions_breaks_the_bound_and_the_engine_refuses_it(mode):
    items = records()
    diff = clipped_sum(mode, "fp32", items, "left") - clipped_sum(mode, "fp32", items[1:], "left")
    own = clipped_sum(mode, "fp32", items[:1], "left")
    assert diff.norm().item() > C * (1 + 1e-3)  # the finding: the longest record's padding moved the others
    assert (diff - own).norm().item() > 0.1 * C
    with pytest.raises(BatchDependenceError, match="left padding"):
        train_one_step(mode, items, "left")


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_without_attention_mask_is_refused(side):
    with pytest.raises(BatchDependenceError, match="without attention_mask"):
        train_one_step("hooks", records(), side, with_mask=False)


def test_equal_length_records_without_a_mask_pass():
    items = [{**r, "ids": r["ids"][:3]} for r in records()]
    _, engine = train_one_step("hooks", items, "right", with_mask=False)
    assert engine.batch_check.outcome.independent


@pytest.mark.parametrize("mode", MODES)
def test_a_correct_set_up_passes_and_trains_bit_identically_with_and_without_the_check(mode):
    torch.manual_seed(3)
    checked, engine = train_one_step(mode, records(), "right", noise_seed=5, noise_multiplier=1.0)
    state = torch.random.get_rng_state()
    torch.manual_seed(3)
    unchecked, _ = train_one_step(mode, records(), "right", noise_seed=5, noise_multiplier=1.0, batch_check=False)
    assert engine.batch_check.outcome.independent and engine.batch_check.done
    assert torch.equal(torch.random.get_rng_state(), state)  # the check drew nothing from the global RNG
    for a, b in zip(checked.parameters(), unchecked.parameters(), strict=True):
        assert torch.equal(a, b)
    assert checked.training


def test_the_check_warns_when_it_cannot_read_the_set_up():
    model = TokenModel()
    loader = DataLoader(records(), batch_size=6, collate_fn=collate(), num_workers=1)
    with pytest.warns(BatchCheckWarning, match="worker processes"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
