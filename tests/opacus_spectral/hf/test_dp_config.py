"""DPTrainingArguments (opacus_spectral.hf.dp_config): parsed by HfArgumentParser and read back from what it saves;
the noise seed and denoiser objects never reach training_args.bin, the JSON, the printed form, the log records or
what the integrations read; no field shadows a TrainingArguments field with another meaning; the DP settings are
refused as DPTrainer keywords and post_hooks are checked when the DPTrainer is built."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import struct
import warnings

import pytest
import torch
import transformers
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from opacus_spectral.hf.dp_config import REDACTED_NOISE_SEED
from trainer_support import Recorder, args, dataset, lalora_model, trainer
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

SEED = 918273645  # a noise seed whose digits and pickled bytes appear nowhere by chance
SEED_BYTES = (str(SEED).encode(), struct.pack("<i", SEED))  # as text, and as pickle's 4-byte BININT

CLI = [
    "--output_dir", "run", "--target_delta", "1e-5", "--target_epsilon", "3", "--per_sample_max_grad_norm", "0.5",
    "--post_hooks", "rmt", '["lowpass", {"kernel": "binomial5"}]', "--doctor", "warn", "--batch_check", "off",
    "--make_private_kwargs", '{"on_denoiser_error": "skip"}', "--no_alternation", "--accountant", "rdp",
    "--report_to", "none",
]  # fmt: skip


def test_hf_argument_parser_reads_every_dp_setting_and_reads_back_what_it_saved(tmp_path):
    parser = HfArgumentParser(DPTrainingArguments)
    (a,) = parser.parse_args_into_dataclasses(CLI)
    assert (a.target_delta, a.target_epsilon, a.per_sample_max_grad_norm, a.accountant) == (1e-5, 3.0, 0.5, "rdp")
    assert a.post_hooks == ["rmt", ("lowpass", {"kernel": "binomial5"})]  # the JSON pair read as (name, kwargs)
    assert a.make_private_kwargs == {"on_denoiser_error": "skip"}
    assert (a.doctor, a.batch_check, a.alternation, a.noise_seed, a.max_grad_norm) == ("warn", "off", False, None, 0)
    saved = tmp_path / "args.json"
    saved.write_text(a.to_json_string())
    (b,) = parser.parse_json_file(str(saved))
    (c,) = parser.parse_dict(a.to_dict())
    assert b == c == dataclasses.replace(a, hub_token="<HUB_TOKEN>")  # the Trainer's own redaction, as before


def test_choices_are_enforced_on_the_command_line():
    with pytest.raises(SystemExit):
        HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses([*CLI, "--grad_sample_mode", "ghosts"])


def test_a_misspelled_keyword_is_refused_with_the_closest_field_names(tmp_path):
    """Before: "__init__() got an unexpected keyword argument 'target_epsilom'" and nothing more."""
    base = dict(output_dir=str(tmp_path), target_epsilon=3.0, target_delta=1e-5)
    with pytest.raises(TypeError, match=r"'target_epsilom' \(did you mean 'target_epsilon'"):
        DPTrainingArguments(**{**base, "target_epsilom": 3.0})
    with pytest.raises(TypeError, match=r"'per_sample_max_grad_nrom' \(did you mean 'per_sample_max_grad_norm'"):
        DPTrainingArguments(**base, per_sample_max_grad_nrom=1.0)
    with pytest.raises(TypeError) as err:  # a Trainer field too; a word close to none gets no guess
        DPTrainingArguments(**base, learning_rat=1e-3, qqqqqq=1)
    assert "arguments 'learning_rat' (did you mean 'learning_rate'?), 'qqqqqq';" in str(err.value)
    assert DPTrainingArguments(**base, learning_rate=1e-3).learning_rate == 1e-3


def seeded(tmp_path, **kw) -> DPTrainingArguments:
    return args(tmp_path, noise_seed=SEED, post_hooks=["ema", Recorder()], **kw)


def test_the_seed_and_denoiser_objects_are_not_in_any_saved_or_printed_form(tmp_path):
    a = seeded(tmp_path)
    printed = [a.to_json_string(), json.dumps(a.to_sanitized_dict()), str(a), repr(a)]
    assert not any(str(SEED) in text for text in printed)
    assert a.to_dict()["noise_seed"] == REDACTED_NOISE_SEED
    assert a.to_dict()["post_hooks"] == ["ema", "<object: recorder>"]
    buffer = io.BytesIO()
    torch.save(a, buffer)  # what the Trainer writes to training_args.bin
    assert not any(b in buffer.getvalue() for b in SEED_BYTES)
    back = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert back.noise_seed == REDACTED_NOISE_SEED and back.post_hooks == ["ema", "<object: recorder>"]
    assert a.noise_seed == SEED and isinstance(a.post_hooks[1], Recorder)  # the live object keeps them
    assert copy.deepcopy(a).noise_seed == copy.copy(a).noise_seed == SEED  # so do copies in this process


def test_arguments_read_back_refuse_to_train_until_the_secret_is_given_again(tmp_path):
    buffer = io.BytesIO()
    torch.save(args(tmp_path, noise_seed=SEED), buffer)
    back = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    model = lalora_model()
    with pytest.raises(ValueError, match="noise_seed was redacted when these arguments were saved"):
        DPTrainer(model=model, args=back, train_dataset=dataset())
    with pytest.raises(ValueError, match="noise_seed was redacted"):  # the JSON read back: refused when parsed
        HfArgumentParser(DPTrainingArguments).parse_dict(args(tmp_path, noise_seed=SEED).to_dict())
    with pytest.raises(ValueError, match=r"'<object: recorder>' stands for a denoiser object.*pass the object again"):
        HfArgumentParser(DPTrainingArguments).parse_dict(args(tmp_path, post_hooks=[Recorder()]).to_dict())


class Tracker(TrainerCallback):
    """What an experiment tracker reads (W&B, MLflow, Comet: ``args.to_dict()``; TensorBoard: ``to_json_string``,
    ``to_sanitized_dict``) and every log record."""

    def __init__(self):
        self.seen: list[str] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen += [json.dumps(args.to_dict()), args.to_json_string(), json.dumps(args.to_sanitized_dict())]

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(json.dumps(logs))


def test_a_seeded_run_writes_and_logs_no_seed(tmp_path):
    """A seeded run with a checkpoint and save_model, the Trainer's logger at INFO: no file under output_dir holds
    the seed (as text or as pickled bytes), nor does any log record, logged line or what an integration reads."""
    tracker, lines = Tracker(), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = transformers.utils.logging.get_logger("transformers")
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReproducibleNoiseWarning)
            t = trainer(tmp_path, noise_seed=SEED, train_args=args(tmp_path, max_steps=1, save_strategy="steps"))
        t.add_callback(tracker)
        t.train()
        t.save_model(str(tmp_path / "final"))
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(level)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"training_args.bin", "opacus_spectral_dp.pt", "trainer_state.json"} <= {p.name for p in files}
    assert [p for p in files if any(b in p.read_bytes() for b in SEED_BYTES)] == []
    assert lines and tracker.seen and not any(str(SEED) in text for text in [*lines, *tracker.seen])
    assert str(SEED) not in json.dumps(t.state.log_history)
    saved = torch.load(tmp_path / "final" / "training_args.bin", weights_only=False)
    assert saved.noise_seed == REDACTED_NOISE_SEED and t.args.noise_seed == SEED


def test_no_field_shadows_a_trainer_field_with_another_meaning(tmp_path):
    """Only max_grad_norm is redefined, with the Trainer's meaning (clipping of the batch gradient) and default 0:
    the per-example bound has its own name. Any other value is refused, naming the field to use."""
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(DPTrainingArguments.__annotations__) & own == {"max_grad_norm"}  # the fields it defines
    assert args(tmp_path).max_grad_norm == 0
    with pytest.raises(ValueError, match="max_grad_norm=1.0 is the Trainer's clipping.*per_sample_max_grad_norm"):
        args(tmp_path, max_grad_norm=1.0)
    t = trainer(tmp_path)
    t.args.max_grad_norm = 1.0  # set after construction: refused when training starts
    with pytest.raises(ValueError, match="max_grad_norm=1.0 is the Trainer's clipping"):
        t.train()


def test_dp_settings_are_refused_as_dptrainer_keywords_and_plain_training_arguments_are_refused(tmp_path):
    model = lalora_model()
    with pytest.raises(TypeError, match=r"DPTrainer got \['max_grad_norm', 'target_epsilon'\].*per_sample_max_grad"):
        DPTrainer(model=model, args=args(tmp_path), train_dataset=dataset(), target_epsilon=3.0, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="DPTrainer needs args=DPTrainingArguments.*got TrainingArguments"):
        DPTrainer(model=model, args=TrainingArguments(str(tmp_path)), train_dataset=dataset())


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"target_delta": None}, ValueError, r"target_delta in \(0, 1\) is required"),
        ({"target_epsilon": None}, ValueError, "give target_epsilon .* or noise_multiplier"),
        ({"per_sample_max_grad_norm": float("nan")}, ValueError, "per_sample_max_grad_norm .* must be finite and > 0"),
        ({"doctor": "loud"}, ValueError, r"doctor must be one of \('raise', 'warn', 'off'\), got 'loud'"),
        ({"post_hooks": "rmt"}, TypeError, "post_hooks must be a list"),
        ({"post_hooks": ['["rmt", {"gate": 2}']}, ValueError, "not a JSON"),
        ({"noise_seed": 1.5}, TypeError, "noise_seed must be an int or None"),
        ({"make_private_kwargs": {"noise_generator": None}}, ValueError, "may not set noise_generator.*noise_seed"),
        ({"make_private_kwargs": {"poisson_sampling": False}}, ValueError, "may not set.*DPTrainer sets them"),
    ],
)
def test_settings_that_cannot_work_are_refused_when_the_arguments_are_built(tmp_path, change, error, match):
    with pytest.raises(error, match=match):
        args(tmp_path, **change)


def test_true_and_false_read_as_raise_and_off(tmp_path):
    a = args(tmp_path, doctor=False, batch_check=True)
    assert (a.doctor, a.batch_check) == ("off", "raise")


def test_post_hooks_are_built_with_the_trainer_naming_the_closest_denoiser(tmp_path):
    """A misspelled denoiser was caught only when train() built the optimizer, after the model was placed and the
    data loaded; now the DPTrainer refuses it, and a bad keyword, when it is built."""
    model = lalora_model()
    for hooks, match in (
        (["lowpas"], r"unknown denoiser 'lowpas'.*(?i:did you mean 'lowpass')"),
        ([("lowpass", {"kernal": "binomial5"})], "kernal"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            DPTrainer(model=model, args=args(tmp_path, post_hooks=hooks), train_dataset=dataset())
    t = DPTrainer(model=model, args=args(tmp_path, post_hooks=["ema"]), train_dataset=dataset())
    assert [type(d).__name__ for d in t._denoisers] == ["EMADenoiser"] and t.args.post_hooks == ["ema"]
