"""The engine's batch-independence audit on the run's own batches (issue 49, item 4; DESIGN invariant 8): set-ups
that passed the old one-shot glimpse of the first 64 records (in eval mode, once) and then broke the bound are
stopped before the offending update, and harmless ones (a collator that sorts, position_ids from the loop) pass."""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus_spectral.doctor import batch_check as bc
from opacus_spectral.doctor.batch_independence import positions_from_mask
from opacus_spectral.errors import BatchDependenceError
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

N, BATCH = 96, 8


class BatchStats(nn.Module):
    """A hand-written batch norm: batch statistics in training, running ones in eval (what the old eval-mode glimpse
    could not see)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x - self.running
        mean = x.mean(0)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * mean)
        return x - mean


class Switch(nn.Module):
    """Mixes the batch when ``on`` (set by the loop after some steps) or for batches of more than ``rows`` rows."""

    def __init__(self, rows: int = 10**9) -> None:
        super().__init__()
        self.on, self.rows = False, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if (self.on or x.shape[0] > self.rows) else x


def _private(middle: nn.Module, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), middle, nn.Tanh(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 2, (N,), generator=g))
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        **kw,
    )
    return engine, model, gsm, opt, dl


def _steps(gsm, opt, dl, count, before_step=None):
    done = 0
    while done < count:
        for x, y in dl:
            if before_step is not None:
                before_step(done)
            opt.zero_grad()
            out = gsm(x)  # an empty Poisson batch too
            (nn.functional.cross_entropy(out, y) if len(x) else out.sum() * 0.0).backward()
            opt.step()
            done += 1
            if done == count:
                return done
    return done


def test_a_layer_mixing_the_batch_only_in_training_is_caught_at_the_first_step():
    """Before: 1.111·C with the check passing (it compared eval-mode outputs)."""
    engine, model, gsm, opt, dl = _private(BatchStats(16))
    before = [p.detach().clone() for p in model.parameters()]
    running = model[1].running.clone()
    with pytest.raises(BatchDependenceError, match="audit failed at DP training forward 1"):
        _steps(gsm, opt, dl, 3)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # before the update
    assert torch.equal(model[1].running, running)  # the audit's forwards restored the running statistics
    assert engine.batch_check.train_mode is True


def test_mixing_that_starts_after_step_3_is_caught_before_its_first_update():
    """Before: 1.730·C on DPTrainer GPT-2 LoRA, 1.214·C in the engine, with the one-shot check passed."""
    switch = Switch()
    engine, model, gsm, opt, dl = _private(switch)
    taken = []

    def before_step(i):
        taken.append(i)
        switch.on = i >= 4

    with pytest.raises(BatchDependenceError):
        _steps(gsm, opt, dl, 20, before_step)
    assert taken[-1] == 4  # the first mixing step is the one stopped (dense audits over the first 8)


def test_mixing_only_for_batches_of_more_than_four_rows_is_caught():
    """Before: the check's batch held at most 4 records, so a layer mixing larger batches passed (1.214·C)."""
    engine, model, gsm, opt, dl = _private(Switch(rows=4))
    with pytest.raises(BatchDependenceError):
        _steps(gsm, opt, dl, 8)


def test_a_correct_model_is_audited_densely_then_sparsely_and_trains_as_without_the_audit():
    engine, model, gsm, opt, dl = _private(nn.Identity())
    torch.manual_seed(7)
    _steps(gsm, opt, dl, 24)
    audit = engine.batch_check
    assert audit.audits >= bc.DENSE and audit.audits < audit.forwards and audit.outcome.independent
    assert audit.train_mode is True


def test_the_schedule_is_dense_early_and_sparse_later():
    audit = bc.BatchCheck.__new__(bc.BatchCheck)
    assert all(audit.scheduled(k) for k in range(bc.DENSE))
    later = sum(audit.scheduled(k) for k in range(bc.DENSE, 1000))  # expected Σ 4/(k+1) ≈ 18.8
    assert 4 <= later <= 45


# -- token sequences: collators ------------------------------------------------------------------------------------
LENGTHS = [3, 9, 5, 12, 4, 7, 10, 6] * 12


class Pooled(nn.Module):
    """Embeds tokens and their positions (0..T−1 unless ``position_ids`` are given: GPT-2's and BERT's default),
    averages over the real tokens (mask), classifies."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.pos = nn.Embedding(32, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, ids, mask, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1]).expand_as(ids)
        h = self.emb(ids) + self.pos(position_ids)
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.out((h * m).sum(1) / m.sum(1).clamp(min=1))


def _records():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, 50, (n,), generator=g), int(i % 2)) for i, n in enumerate(LENGTHS)]


def _pad(items, length=None, left=False):
    length = length or max(len(x) for x, _ in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for r, (x, _) in enumerate(items):
        x = x[:length]
        if left:
            ids[r, length - len(x) :], mask[r, length - len(x) :] = x, 1
        else:
            ids[r, : len(x)], mask[r, : len(x)] = x, 1
    return ids, mask, torch.tensor([y for _, y in items], dtype=torch.long)


def _token_run(collate, steps, *, positions=False):
    torch.manual_seed(0)
    model = Pooled()
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_records(), batch_size=BATCH, collate_fn=collate),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    done = 0
    while done < steps:
        for ids, mask, y in dl:
            opt.zero_grad()
            extra = {"position_ids": positions_from_mask(mask)} if positions else {}
            out = gsm(ids, mask, **extra)  # an empty Poisson batch too
            (nn.functional.cross_entropy(out, y) if len(y) else out.sum() * 0.0).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return engine


def test_a_collator_truncating_to_the_shortest_record_is_caught():
    """Before: only the longest record was ever removed, so truncation to the shortest passed (2.603·C in DPTrainer,
    1.663·C in the engine). The audit removes the shortest at its second audit."""
    if_empty = (torch.zeros(0, 1, dtype=torch.long),) * 2 + (torch.zeros(0, dtype=torch.long),)

    def truncating(items):
        return _pad(items, length=min(len(x) for x, _ in items)) if items else if_empty

    with pytest.raises(BatchDependenceError, match="shortest record was removed"):
        _token_run(truncating, 10)


def test_a_collator_sorting_the_batch_longest_first_passes():
    """Before: refused ("privacy guarantee is void") though its sensitivity is exactly 1·C: the rows of the
    re-collated batch are now matched to their records."""
    if_empty = (torch.zeros(0, 1, dtype=torch.long),) * 2 + (torch.zeros(0, dtype=torch.long),)

    def sorting(items):
        return _pad(sorted(items, key=lambda r: -len(r[0]))) if items else if_empty

    engine = _token_run(sorting, 12)
    assert engine.batch_check.audits >= bc.DENSE and engine.batch_check.outcome.independent


def test_position_ids_computed_by_the_loop_from_the_mask_are_audited_not_skipped():
    """Before: following the error's own advice (position_ids from the loop) turned the check into 'not checked'."""
    if_empty = (torch.zeros(0, 1, dtype=torch.long),) * 2 + (torch.zeros(0, dtype=torch.long),)

    def left(items):
        return _pad(items, left=True) if items else if_empty

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _token_run(left, 10, positions=True)
    assert not [w for w in caught if "not checked" in str(w.message)]
    assert engine.batch_check.audits >= bc.DENSE and engine.batch_check.outcome.independent
    with pytest.raises(BatchDependenceError, match="record was removed"):  # whichever audit sees the padding
        _token_run(left, 3, positions=False)  # left padding without the positions: caught
