"""DPTrainer × task (causal LM, token classification, sequence classification) × left / right padding: removing the
longest record moves the sum of clipped gradients by at most C — by exactly that record's own clipped gradient — with
sample rate 1, noise 0 and C = 1e-3 (every record clipped). Before the batch check, left padding on models with
learned absolute positions (GPT-2, BERT) moved it by 3.5·C (docs/trainer.md, "Batch independence"). The set-up:
tests/support/padding_support.py; the two-process cell: tests/opacus_spectral/hf/test_trainer_ddp.py.
"""

from __future__ import annotations

import pytest
import torch
from causal_lm_support import tokenizer
from opacus_spectral.errors import BatchDependenceError
from padding_support import LENGTHS, C, clipped_sum, data
from transformers import DataCollatorForLanguageModeling

pytestmark = pytest.mark.slow

CELLS = [
    ("causal_lm", "left"),
    ("causal_lm", "right"),
    ("token_classification", "left"),
    ("sequence_classification", "right"),
]


@pytest.mark.parametrize(("task", "side"), CELLS)
def test_removing_the_longest_record_moves_the_clipped_sum_by_its_own_clipped_gradient(tmp_path, task, side):
    everyone = list(range(len(LENGTHS)))
    diff = clipped_sum(tmp_path, task, side, everyone) - clipped_sum(tmp_path, task, side, everyone[1:])
    own = clipped_sum(tmp_path, task, side, [0])
    assert diff.norm().item() <= C * (1 + 1e-5), diff.norm().item() / C
    torch.testing.assert_close(diff, own, rtol=0, atol=1e-4 * C)


def test_left_padding_without_the_fix_is_refused_by_the_check(tmp_path, monkeypatch):
    """The check finds the coupling; with the position_ids fix disabled, DPTrainer refuses to train."""
    import opacus_spectral.hf.batch_check as check

    monkeypatch.setattr(check, "_takes_position_ids", lambda model: False)
    with pytest.raises(BatchDependenceError, match="left padding"):
        clipped_sum(tmp_path, "causal_lm", "left", list(range(len(LENGTHS))))


def test_left_padded_bert_sequence_classification_is_refused(tmp_path):
    """BERT's pooler reads position 0: under left padding that is a pad in one batch and the record's first token in
    another, whatever the positions — the record's logits depend on the longest record, and no position_ids fix it."""
    with pytest.raises(BatchDependenceError, match="record's logits changed"):
        clipped_sum(tmp_path, "sequence_classification", "left", list(range(len(LENGTHS))))


def test_a_left_padded_causal_lm_batch_without_attention_mask_is_refused(tmp_path):
    """Before the check DPTrainer trained on it: the records attend to the padding (2.04·C on Llama, 2.67·C on GPT-2).
    (Right padding without a mask leaves a causal LM's real tokens alone — the check then passes, correctly.)"""
    unmasked = data("causal_lm", list(range(len(LENGTHS)))).remove_columns("attention_mask")
    tok = tokenizer()
    tok.model_input_names, tok.padding_side = ["input_ids"], "left"  # pad() then returns no attention_mask
    with pytest.raises(BatchDependenceError, match="per-example gradient changed"):
        clipped_sum(
            tmp_path,
            "causal_lm",
            "left",
            list(range(len(LENGTHS))),
            data_of=lambda task, rows: unmasked.select(rows),
            collator_of=lambda task, side: DataCollatorForLanguageModeling(tok, mlm=False),
        )
