"""Privacy around the Trainer (docs/trainer.md): DPTrainer's noise and Poisson sample do not come from the seed
the Trainer publishes, nothing derived from the training data without noise is logged or saved, and a resume
refuses DP state that disagrees with the checkpoint beside it."""

from __future__ import annotations

import json
import shutil
import warnings

import datasets
import pytest
import torch
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.hf import DPTrainer, DPTrainingArguments
from opacus_spectral.hf.logs import PUBLIC_LOG_KEYS
from opacus_spectral.hf.state import DP_STATE_FILE
from peft import LoraConfig, get_peft_model
from text_support import synthetic_text_task, tiny_bert
from torch import nn
from trainer_support import quiet_cpu_args
from transformers import TrainerCallback

pytestmark = pytest.mark.slow

N, LR, C, SIGMA = 16, 0.5, 1.0, 1.0  # q = 1: every record in the one logical batch of B = 16
BOUND = 2 * LR * C / N  # what one flipped label can move the parameters without noise (0.0625)


def lora_model() -> nn.Module:
    model = tiny_bert(seed=0)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))


def records(flip: bool = False) -> datasets.Dataset:
    data = synthetic_text_task(N, seq_len=16, seed=0)[:]
    if flip:
        data["label"] = data["label"].clone()
        data["label"][0] = 1 - data["label"][0]
    return datasets.Dataset.from_dict(data).with_format("torch")


def train_args(tmp_path, **kw) -> DPTrainingArguments:
    """One step of q = 1 at noise multiplier SIGMA (RDP, δ = 1e-5); ``kw`` sets or overrides any argument."""
    run = dict(per_device_train_batch_size=N, max_steps=1, learning_rate=LR, seed=42, noise_multiplier=SIGMA)
    return quiet_cpu_args(tmp_path, **{**run, **kw})


def one_step(tmp_path, *, flip: bool = False, **dp) -> torch.Tensor:
    """One SGD step (q = 1) with the same TrainingArguments.seed every time; the trained parameters, flattened."""
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    t = DPTrainer(
        model=model,
        args=train_args(tmp_path, per_sample_max_grad_norm=C, **dp),
        train_dataset=records(flip),
        optimizers=(torch.optim.SGD(params, lr=LR), None),
    )
    t.train()
    assert t.sample_rate == 1.0 and t.privacy_engine.accountant.history == [(SIGMA, 1.0, 1)]
    return torch.cat([p.detach().flatten() for p in params])


def test_default_noise_does_not_come_from_the_trainer_seed(tmp_path):
    """The neighbouring-run probe: with the default noise source two runs differ at the noise scale, on the same
    data as on neighbouring data, although the Trainer seeds the global RNG with the same seed."""
    a, b = one_step(tmp_path / "a"), one_step(tmp_path / "b")
    neighbour = one_step(tmp_path / "c", flip=True)
    noise_scale = LR * SIGMA * C / N * (2 * a.numel()) ** 0.5  # the norm of the difference of two noise draws
    for other in (b, neighbour):
        gap = (a - other).norm().item()
        assert gap > 20 * BOUND and gap == pytest.approx(noise_scale, rel=0.2)


def test_noise_seed_reproduces_the_noise_and_warns(tmp_path):
    """noise_seed=s: the same noise in every run, so neighbouring runs differ by less than the noise-free bound."""
    with pytest.warns(ReproducibleNoiseWarning, match="NOT differentially private against anyone who knows"):
        a = one_step(tmp_path / "a", noise_seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        b, neighbour = one_step(tmp_path / "b", noise_seed=7), one_step(tmp_path / "c", flip=True, noise_seed=7)
        other_seed = one_step(tmp_path / "d", noise_seed=8)
    assert torch.equal(a, b)
    assert 0 < (a - neighbour).norm().item() <= BOUND
    assert (a - other_seed).norm().item() > 20 * BOUND


class Captured(TrainerCallback):
    """What integrations see: the logs every on_log receives and the state at the end."""

    def __init__(self):
        self.logs, self.flos = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, **kwargs):
        self.flos.append((state.total_flos, state.num_input_tokens_seen))


def logged_run(tmp_path, **dp):
    model = lora_model()
    t = DPTrainer(
        model=model,
        args=train_args(
            tmp_path,
            max_steps=2,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=8,
            **dp,
        ),
        train_dataset=records(),
        eval_dataset=records(),
    )
    seen = Captured()
    t.add_callback(seen)
    out = t.train()
    return t, seen, out


def test_nothing_from_the_training_data_without_noise_is_logged_or_saved(tmp_path):
    t, seen, out = logged_run(tmp_path)
    training = [r for r in t.state.log_history if not any(k.startswith("eval_") for k in r)]
    assert training and all(set(r) <= PUBLIC_LOG_KEYS for r in training), training
    assert all(set(r) <= PUBLIC_LOG_KEYS for r in seen.logs if not any(k.startswith("eval_") for k in r))
    assert set(out.metrics) <= PUBLIC_LOG_KEYS  # no total_flos, train_runtime, train_samples_per_second, loss
    assert t.state.total_flos == 0 and t.state.num_input_tokens_seen == 0 and set(seen.flos) == {(0, 0)}
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["total_flos"] == 0 and saved["num_input_tokens_seen"] == 0
    assert all(set(r) <= PUBLIC_LOG_KEYS for r in saved["log_history"] if "eval_loss" not in r)
    evaluation = [r for r in t.state.log_history if "eval_loss" in r]  # the evaluation set is the user's to judge
    assert len(evaluation) == 1 and "eval_runtime" in evaluation[0] and "epsilon" in evaluation[0]
    assert all(r["epsilon"] == t.get_epsilon() for r in training[-1:])


def test_release_nonprivate_stats_logs_what_the_filter_removes(tmp_path):
    t, seen, out = logged_run(tmp_path, release_nonprivate_stats=True)
    summary = t.state.log_history[-1]  # (the Trainer's printer callback pops total_flos from the dict it is handed)
    assert {"total_flos", "train_loss", "train_runtime", "train_samples_per_second"} <= set(summary)
    assert summary["total_flos"] == t.state.total_flos > 0 and any("loss" in r for r in seen.logs)


def test_a_key_not_known_to_be_public_is_dropped_with_a_warning(tmp_path):
    t, _, _ = logged_run(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"did not log \['my_statistic'\].*release_nonprivate_stats=True"):
        t.log({"my_statistic": 1.0, "learning_rate": 0.1})
    assert t.state.log_history[-1].keys() == {"learning_rate", "epsilon", "delta", "step", "epoch"}


def test_checkpoint_dp_state_holds_no_generator_state(tmp_path):
    """opacus_spectral_dp.pt: configuration, accountant history, step and digest; no RNG state (byte tensors) and
    no seed. rng_state.pth (the Trainer's global RNG) no longer draws any noise: the tests above show it."""
    logged_run(tmp_path)
    state = torch.load(tmp_path / "checkpoint-2" / DP_STATE_FILE, weights_only=True)
    assert set(state) == {
        "format",
        "config",
        "accountant",
        "post_hooks",
        "global_step",
        "parameters_digest",
        "privacy_record",  # earlier runs, the history composed with, the run's random id and unit
    }

    def leaves(x, path=""):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                yield from leaves(v, f"{path}/{i}")
        else:
            yield path, x

    for path, leaf in leaves(state):
        assert not any(w in path.lower() for w in ("rng", "generator", "seed")), path
        assert not (isinstance(leaf, torch.Tensor) and leaf.dtype == torch.uint8), path


# -- tampered checkpoints -------------------------------------------------------------------------------------
def adamw_trainer(out, max_steps=6, save_steps=2) -> DPTrainer:
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    a = train_args(
        out,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=save_steps,
        learning_rate=1e-2,
        noise_multiplier=1.0,
    )
    return DPTrainer(
        model=model, args=a, train_dataset=records(), optimizers=(torch.optim.AdamW(params, lr=1e-2), None)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    t = adamw_trainer(out)
    t.train()
    return out, t


def edited(checkpoints, tmp_path, step, edit_dp=None, edit_trainer_state=None, remove=()):
    src = checkpoints[0] / f"checkpoint-{step}"
    dst = tmp_path / "edited" / src.name
    shutil.copytree(src, dst)
    if edit_dp is not None:
        state = torch.load(dst / DP_STATE_FILE, weights_only=True)
        edit_dp(state)
        torch.save(state, dst / DP_STATE_FILE)
    if edit_trainer_state is not None:
        saved = json.loads((dst / "trainer_state.json").read_text())
        edit_trainer_state(saved)
        (dst / "trainer_state.json").write_text(json.dumps(saved))
    for name in remove:
        (dst / name).unlink()
    return dst


def history_edit(fn):
    def edit(state):
        state["accountant"]["history"] = [fn(*entry) for entry in state["accountant"]["history"]]

    return edit


def resume(tmp_path, checkpoint):
    return adamw_trainer(tmp_path / "resumed").train(resume_from_checkpoint=str(checkpoint))


def test_untampered_checkpoint_resumes(checkpoints, tmp_path):
    out, full = checkpoints
    t = adamw_trainer(tmp_path / "resumed")
    t.train(resume_from_checkpoint=str(edited(checkpoints, tmp_path, 2)))
    assert t.privacy_engine.accountant.history == full.privacy_engine.accountant.history == [(1.0, 0.25, 6)]
    assert t.get_epsilon() == full.get_epsilon()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (history_edit(lambda s, q, n: (s * 50, q, n)), r"records noise_multiplier 50\.0.* uses 1\.0"),
        (history_edit(lambda s, q, n: (s, q / 100, n)), r"records sample rate 0\.0025"),
    ],
    ids=["sigma_x50", "rate_over_100"],
)
def test_edited_accountant_history_is_refused(checkpoints, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        resume(tmp_path, edited(checkpoints, tmp_path, 2, edit_dp=edit))


def test_emptied_history_at_step_zero_with_six_step_weights_is_refused(checkpoints, tmp_path):
    def empty(state):
        state["accountant"]["history"], state["global_step"] = [], 0

    ckpt = edited(checkpoints, tmp_path, 6, edit_dp=empty, edit_trainer_state=lambda s: s.update(global_step=0))
    with pytest.raises(ValueError, match=r"optimizer\.pt .*: 6.*counted more steps than the accountant's 0"):
        resume(tmp_path, ckpt)


def test_step_counts_that_disagree_are_refused(checkpoints, tmp_path):
    ckpt = edited(checkpoints, tmp_path, 4, edit_trainer_state=lambda s: s.update(global_step=2))
    with pytest.raises(ValueError, match="step counts disagree.*the DP state: 4, trainer_state.json: 2"):
        resume(tmp_path, ckpt)


def test_weights_of_another_step_are_refused(checkpoints, tmp_path):
    ckpt = edited(checkpoints, tmp_path, 2)
    shutil.copy(checkpoints[0] / "checkpoint-6" / "adapter_model.safetensors", ckpt / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="trained parameters loaded from .* are not the ones its DP state"):
        resume(tmp_path, ckpt)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "trainer_state.json"])
def test_a_checkpoint_without_the_trainer_counters_is_refused(checkpoints, tmp_path, name):
    with pytest.raises(ValueError, match=rf"lacks \['{name}'\].*save_only_model"):
        resume(tmp_path, edited(checkpoints, tmp_path, 2, remove=[name]))


def test_resuming_with_a_noise_seed_does_not_replay_the_first_steps_noise(tmp_path, monkeypatch):
    """A resumed run given the same noise_seed draws new (still reproducible) noise, not the stream of step 1 again:
    a repeat would cancel in the difference of two checkpoints."""
    import opacus.optimizers.optimizer as opacus_optimizer

    draws, real = [], opacus_optimizer._generate_noise
    monkeypatch.setattr(opacus_optimizer, "_generate_noise", lambda *a, **k: draws.append(real(*a, **k)) or draws[-1])

    def run(out, resume_from=None, max_steps=4):
        del draws[:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReproducibleNoiseWarning)
            model = lora_model()
            params = [p for p in model.parameters() if p.requires_grad]
            run = dict(per_device_train_batch_size=4, max_steps=max_steps, save_strategy="steps", save_steps=2)
            a = train_args(out, **run, noise_multiplier=1.0, noise_seed=7)
            DPTrainer(
                model=model, args=a, train_dataset=records(), optimizers=(torch.optim.SGD(params, lr=0.1), None)
            ).train(resume_from_checkpoint=resume_from)
        return [d.clone() for d in draws]

    full = run(tmp_path / "full")
    per_step = len(full) // 4
    resumed = run(tmp_path / "resumed", resume_from=str(tmp_path / "full" / "checkpoint-2"))
    again = run(tmp_path / "again", resume_from=str(tmp_path / "full" / "checkpoint-2"))
    assert len(resumed) == 2 * per_step and all(torch.equal(x, y) for x, y in zip(resumed, again, strict=True))
    for first, later in zip(full, resumed, strict=False):  # the resumed steps' noise is not steps 1-2's noise
        assert not torch.equal(first, later)
