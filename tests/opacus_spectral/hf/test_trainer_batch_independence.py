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


def _probed(tmp_path, task: str, side: str, rows: list[int], **kw):
    seen: dict = {}
    clipped_sum(tmp_path, task, side, rows, seen=seen, **kw)
    return seen["trainer"]


def test_the_left_padding_probe_decides_the_position_fix_whatever_the_sampled_records(tmp_path):
    """Records of one length (no padding in the check's batch) under a left-padding collator: before, the position_ids
    fix stayed off and later left-padded batches coupled their records (2.56·C on GPT-2); now the probe pads one record
    by hand and finds that GPT-2 needs position_ids on every left-padded batch."""
    same = [1, 1, 1]  # three records of 3 tokens: nothing to pad
    t = _probed(tmp_path, "causal_lm", "left", same)
    assert t.batch_check_result.left_padding == "positions" and t.position_ids_from_mask is True
    batch = {
        "input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1], [1] * 4]),
    }
    assert t._model_inputs(batch)["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]  # per batch, from its mask


def test_a_model_that_numbers_positions_from_its_ids_is_left_alone(tmp_path):
    """RoBERTa counts positions over the non-pad ids itself: padding on the left changes nothing, and position_ids
    from the mask (starting at 0, not at its pad id + 1) would be wrong — the probe leaves it alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import RobertaConfig, RobertaForTokenClassification

    def roberta(task):
        config = RobertaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            num_labels=3, pad_token_id=1, max_position_embeddings=40, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base = RobertaForTokenClassification(config)
        return get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"], task_type="TOKEN_CLS"))

    t = _probed(tmp_path, "token_classification", "right", [0, 2, 4], model_of=roberta)
    assert t.batch_check_result.left_padding == "none" and t.position_ids_from_mask is False


def test_a_left_padded_batch_the_probe_found_unfixable_is_refused_before_its_update(tmp_path):
    """BERT sequence classification pools position 0 (a pad under left padding): no position_ids fix it. The check's
    sample had no padding, so only the probe knows; a left-padded training batch is then refused."""
    t = _probed(tmp_path, "sequence_classification", "right", [1, 1, 1])
    assert t.batch_check_result.left_padding == "couples"
    padded = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])}
    with pytest.raises(BatchDependenceError, match="Pad on the right"):
        t.batch_check_result.check_batch(padded)
    t.batch_check_result.check_batch(
        {"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    )
