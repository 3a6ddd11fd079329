"""The doctor's checks of what a DP step trained on and what moved the weights (opacus_spectral.doctor.doctor): a
sequence-first model under batch_first=True, steps on batches the DP loader never yielded, a second optimizer on the
clean gradient, a non-finite noisy gradient without a pipeline (also through DPTrainer). Each failure reproduced
(silent upstream), then caught; and silence on correct runs."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus_spectral.doctor.batches import BatchObserver
from opacus_spectral.doctor.doctor import install_doctor
from opacus_spectral.errors import DoctorError, DoctorWarning, NonFiniteGradientError
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine, set_trainable

T, F, N = 40, 3, 32  # sequence length above the dataset size: a per-time-step "sample" is never a record count


class SeqFirst(nn.Module):
    """Takes records [B, T, F] and runs sequence-first ([T, B, F]) layers, as an RNN-style model does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(F, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.transpose(0, 1)))  # [T, B, 8]
        return self.out(h).mean(0)  # [B, 2]


def seq_data(n: int = N, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(10 * torch.randn(n, T, F, generator=g), torch.randint(0, 2, (n,), generator=g))


def mlp_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def private(model, data, *, batch=16, doctor="raise", watch=True, opt=None, **kw):
    """make_private with the doctor installed on the returned loader (the engine's wiring, spelled out)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        doctor=False,
        **kw,
    )
    doc = install_doctor(
        out[1], out[0], accountant=engine.accountant, mode=doctor, data_loader=out[-1] if watch else None
    )
    return engine, out, doc


def train(out, loader, steps=None, second=None):
    model, dp = out[0], out[1]
    for i, (x, y) in enumerate(loader):
        if steps is not None and i >= steps:
            break
        nn.functional.cross_entropy(model(x), y).backward()
        if second is not None:
            second.step()
        dp.step()
        dp.zero_grad(set_to_none=True)


def clipped_sum(dp, model, x, y) -> torch.Tensor:
    nn.functional.cross_entropy(model(x), y).backward()
    dp.clip_and_accumulate()
    total = torch.cat([p.summed_grad.flatten() for p in dp.params])
    dp.zero_grad(set_to_none=True)
    return total


# ------------------------------------------------------------------------------------------ batch_first
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_sequence_first_model_under_batch_first_clips_per_time_step(batch_first):
    """Upstream, batch_first=True on a sequence-first model clips per time step: one record moves the clipped sum
    by far more than max_grad_norm. The doctor sees T rows for a batch of fewer records."""
    model = SeqFirst()
    engine, out, doc = private(model, seq_data(), doctor=False, watch=False, batch_first=batch_first)
    x, y = seq_data(4, seed=1).tensors
    delta = (clipped_sum(out[1], model, x, y) - clipped_sum(out[1], model, x[1:], y[1:])).norm().item()
    if batch_first:
        assert delta > 2.0  # C = 1: the sensitivity bound is broken, silently
    else:
        assert delta <= 1.0 + 1e-5

    engine, out, doc = private(SeqFirst(), seq_data(), batch=16, batch_first=batch_first)
    if batch_first:
        before = [p.detach().clone() for p in out[0].parameters()]
        with pytest.raises(DoctorError, match=r"\[batch_dim\].*do not have one row per record.*batch_first=False"):
            train(out, out[-1])
        assert all(torch.equal(a, b) for a, b in zip(before, out[0].parameters(), strict=True))  # before the update
    else:
        with BatchMemoryManager(data_loader=out[-1], max_physical_batch_size=4, optimizer=out[1]) as loader:
            train(out, loader)
        train(out, out[-1])
        assert doc.findings == [] and doc.dp_steps == 2 * len(out[-1])


# ------------------------------------------------------------------------------------------ sampling
def test_training_on_the_users_own_loader_is_caught():
    """The issue's case: the DP loader has rate 1/16 but the loop trains on the user's loader of 128-record
    batches. Upstream the accountant silently charges q = 1/16 for steps that used half the data each."""
    data = mlp_data(256)
    own = DataLoader(data, batch_size=128, shuffle=True)
    engine, out, doc = private(mlp(), data, doctor=False, watch=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing says a word
        train(out, own)
    assert engine.accountant.history == [(1.0, 1 / 16, 2)]  # charged at 1/16; the real rate was 1/2

    engine, out, doc = private(mlp(), data)
    before = [p.detach().clone() for p in out[0].parameters()]
    with pytest.raises(
        DoctorError,
        match=r"\[sampling\]: DP step 1 trained on a batch the DP data loader did not yield"
        r".*q = 0\.0625.*iterate the data loader make_private returned",
    ):
        train(out, own)
    assert all(torch.equal(a, b) for a, b in zip(before, out[0].parameters(), strict=True))  # raised before the update

    engine, out, doc = private(mlp(), data, doctor="warn")  # one batch from the DP loader, then two steps on it
    x, y = next(iter(out[-1]))
    with pytest.warns(DoctorWarning, match=r"step 2 trained on a batch .* \(1 batch\(es\) drawn"):
        train(out, [(x, y), (x, y)])
    assert [f.check for f in doc.findings] == ["sampling"]


def test_the_dp_loader_in_every_correct_form_is_silent():
    data = mlp_data(64)
    engine, out, doc = private(mlp(), data)
    train(out, out[-1])  # plain
    with BatchMemoryManager(data_loader=out[-1], max_physical_batch_size=3, optimizer=out[1]) as loader:
        train(out, loader)  # physical batches
    dp_loader = out[-1]
    sorted_batches = DataLoader(dp_loader.dataset, batch_sampler=dp_loader.batch_sampler)  # a loader over its sampler
    train(out, sorted_batches)
    prefetching = DataLoader(dp_loader.dataset, batch_sampler=dp_loader.batch_sampler, num_workers=2, prefetch_factor=2)
    train(out, prefetching, steps=3)  # drawn ahead, then the pass is abandoned
    train(out, out[-1])
    assert doc.findings == [] and doc.dp_steps == 4 * len(dp_loader) + 3
    assert isinstance(dp_loader.batch_sampler, UniformWithReplacementSampler)

    doc.remove()  # the sampler is its plain class again, and a copy of an observed one is plain
    assert type(dp_loader.batch_sampler) is UniformWithReplacementSampler
    observer = BatchObserver(dp_loader)
    assert type(dp_loader.batch_sampler) is not UniformWithReplacementSampler
    assert type(pickle.loads(pickle.dumps(dp_loader.batch_sampler))) is observer._original
    assert type(copy.deepcopy(dp_loader.batch_sampler)) is observer._original
    observer.detach()
    assert type(dp_loader.batch_sampler) is observer._original


def test_a_step_that_accumulates_several_backward_passes_is_silent():
    """Opacus' gradient accumulation: k batches from the DP loader, k backward passes, one step; the per-sample rows
    are the records of the k batches together (a run of queued batches, not one batch)."""
    engine, out, doc = private(mlp(), mlp_data(64), poisson_sampling=False)
    model, dp = out[0], out[1]
    it = iter(out[-1])
    for _ in range(2):
        for _ in range(2):
            x, y = next(it)
            nn.functional.cross_entropy(model(x), y).backward()
        dp.step()
        dp.zero_grad(set_to_none=True)
    assert doc.findings == [] and doc.dp_steps == 2
    observer = BatchObserver(DataLoader(range(10), batch_size=3))
    list(observer.sampler)
    assert observer.on_dp_step(4) == [] and not observer.queued  # the last two batches (3 + 1), the rest skipped
    observer.detach()


def test_batches_drawn_and_skipped_pair_with_the_step_that_matches():
    """A resumed Trainer draws batches it skips; a new pass drops the unfinished one's queue."""
    observer = BatchObserver(DataLoader(range(10), batch_size=3))
    it = iter(observer.sampler)
    for _ in range(3):
        next(it)
    assert list(observer.queued) == [3, 3, 3]
    assert observer.on_dp_step(3) == [] and list(observer.queued) == [3, 3]
    next(iter(observer.sampler))
    assert list(observer.queued) == [3]  # the new pass dropped the old queue
    assert [c for c, _ in observer.on_dp_step(5)] == ["batch_dim"]
    assert [c for c, _ in observer.on_dp_step(3)] == ["sampling"]
    list(observer.sampler)  # a whole pass
    assert list(observer.queued) == [3, 3, 3, 1]
    assert observer.on_dp_step(1) == [] and not observer.queued  # three drawn and skipped, the last one trained
    observer.detach()
    with pytest.raises(ValueError, match="no batch sampler"):
        BatchObserver(DataLoader(range(4), batch_size=None))
    model = mlp()
    with pytest.warns(DoctorWarning, match="batch checks off.*no batch sampler"):
        engine, out, doc = private(model, mlp_data(), doctor="raise", watch=False)
        doc.remove()
        install_doctor(out[1], out[0], mode="raise", data_loader=DataLoader(range(4), batch_size=None))


# ------------------------------------------------------------------------------------------ parameter changes
def test_a_second_optimizer_on_the_clean_gradient_is_caught():
    """Upstream a plain optimizer stepping on the clean gradient before the DP step moves the weights by a
    noise-free, unaccounted update, silently. The doctor catches it before the DP update (even at the first step)."""
    data = mlp_data(64)
    engine, out, doc = private(mlp(), data, doctor=False, watch=False)
    second = torch.optim.SGD(out[0].parameters(), lr=1.0)
    x, y = next(iter(out[-1]))
    nn.functional.cross_entropy(out[0](x), y).backward()
    clean = [p.grad.detach().clone() for p in out[0].parameters()]
    before = [p.detach().clone() for p in out[0].parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing says a word
        second.step()  # the leak: a deterministic function of the batch
    assert all(torch.allclose(b - g, p) for b, g, p in zip(before, clean, out[0].parameters(), strict=True))

    for second_cls, kw in ((torch.optim.SGD, {}), (torch.optim.AdamW, {"fused": True})):
        engine, out, doc = private(mlp(), data)
        second = second_cls(out[0].parameters(), lr=1e-3, **kw)
        with pytest.raises(
            DoctorError,
            match=r"\[param_change\]: 4 parameter\(s\) changed before DP step 1 without a "
            r"noisy, accounted step.*second optimizer",
        ):
            train(out, out[-1], second=second)

    engine, out, doc = private(mlp(), data)  # a manual edit through .data (invisible to autograd) after the forward
    model = out[0]
    x, y = next(iter(out[-1]))
    nn.functional.cross_entropy(model(x), y).backward()
    model._module[0].bias.data.add_(1e-3)
    with pytest.raises(DoctorError, match=r"1 parameter\(s\) changed.*'0\.bias'"):
        out[1].step()


def test_legitimate_parameter_writes_are_silent(tmp_path):
    """Weight decay inside the DP step, set_trainable toggles, weights loaded between a step and the next training
    forward (a checkpoint, a federated round's global model), with evaluation forwards in between, do not count."""
    data = mlp_data(64)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    engine, out, doc = private(model, data, opt=opt)
    train(out, out[-1], steps=2)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=out[0], optimizer=out[1])
    set_trainable([model[0].weight], False)
    train(out, out[-1], steps=2)
    set_trainable([model[0].weight], True)
    model.eval()
    model(data.tensors[0][:4])  # an evaluation forward (autograd on) before the load: not the baseline
    model.train()
    with torch.no_grad():
        model(data.tensors[0][:4])
    global_state = {k: v + 0.01 for k, v in model.state_dict().items()}
    model.load_state_dict(global_state)
    train(out, out[-1], steps=2)
    engine.load_checkpoint(path=tmp_path / "c.pt", module=out[0], optimizer=out[1])
    train(out, out[-1], steps=2)
    assert doc.findings == [] and doc.dp_steps == 8


@pytest.mark.gpu
def test_parameter_change_is_reported_on_the_accelerator_without_a_sync(device):
    data = mlp_data(64)
    model = mlp().to(device)
    engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(*(t.to(device) for t in data.tensors)), batch_size=16)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        doctor="warn",
    )
    second = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(DoctorWarning, match="changed before DP step 1"):
        for _ in range(3):
            train(out, out[-1], second=second)
            torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ non-finite
def nan_data(n: int = 16) -> TensorDataset:
    data = mlp_data(n)
    data.tensors[0][3, 2] = float("nan")  # one poisoned record
    return data


def test_a_nan_record_without_a_pipeline():
    """Upstream one NaN record makes every weight NaN, silently; the doctor aborts the step before the update
    (raise) or warns (warn); a pipeline, when installed, applies its own policy and the doctor stays out."""
    engine, out, doc = private(mlp(), nan_data(), batch=16, doctor=False, watch=False)  # q = 1: every record sampled
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing says a word
        train(out, out[-1])
    assert all(torch.isnan(p).all() for p in out[0].parameters())

    engine, out, doc = private(mlp(), nan_data(), batch=16)
    before = [p.detach().clone() for p in out[0].parameters()]
    with pytest.raises(
        DoctorError,
        match=r"\[nonfinite\]: the noisy gradient of DP step 1 holds NaN/Inf in 4 "
        r"parameter\(s\).*aborted before the update.*on_nonfinite_grad='skip_step'",
    ):
        train(out, out[-1])
    assert all(torch.equal(a, b) for a, b in zip(before, out[0].parameters(), strict=True))
    assert all(p.grad is None for p in out[0].parameters())

    engine, out, doc = private(mlp(), nan_data(), batch=16, doctor="warn")
    with pytest.warns(DoctorWarning, match="makes those weights NaN"):
        train(out, out[-1])
    engine, out, doc = private(mlp(), nan_data(), batch=16, post_hooks=[])
    with pytest.raises(NonFiniteGradientError):
        train(out, out[-1])
    assert doc.findings == []

    engine, out, doc = private(mlp(), mlp_data(16), batch=16)  # finite gradients whose 2-norm overflows float32
    for p in out[1].params:
        p.grad = torch.full_like(p, 1e20)
    doc._check_finite()
    assert doc.findings == [] and all(p.grad is not None for p in out[1].params)


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.lin(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Records(torch.utils.data.Dataset):
    def __init__(self, data: TensorDataset) -> None:
        self.x, self.y = data.tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


@pytest.mark.parametrize("doctor", [False, "raise"])
def test_dptrainer_default_post_hooks_none_and_a_nan_record(tmp_path, doctor):
    from opacus_spectral.hf import DPTrainer, DPTrainingArguments

    model = TinyClassifier()
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=0.1,
        noise_multiplier=1.0,
        target_delta=1e-5,
        accountant="rdp",
        doctor=doctor,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=Records(nan_data()))
    if doctor is False:  # the silent failure: every weight NaN, nothing said (the loss is not logged either)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DoctorWarning)
            trainer.train()
        assert all(torch.isnan(p).all() for p in model.parameters())
    else:
        with pytest.raises(DoctorError, match=r"\[nonfinite\].*'lin\.weight'.*aborted before the update"):
            trainer.train()
        assert all(torch.isfinite(p).all() for p in model.parameters())
