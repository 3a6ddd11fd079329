"""PostHookHandle's step API: ``logical_steps`` and ``add_step_callback`` tell a training loop when a
logical DP step (noise added by Opacus) completed — never on a BatchMemoryManager virtual step, never on an
inner-optimizer step taken without Opacus' noise."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import Recorder, loader, mlp
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus_spectral.errors import DoctorWarning
from opacus_spectral.step import PostHookHandle, StepDiagnostics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine

NM, C = 1.1, 1.0


def _private(post_hooks, *, data: DataLoader | None = None, **kwargs):
    torch.manual_seed(0)
    model = mlp(hidden=32, d_out=4)
    engine = PrivacyEngine(accountant="rdp")
    gsm, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data or loader(256, 64, d_out=4),
        noise_multiplier=NM,
        max_grad_norm=C,
        post_hooks=post_hooks,
        **kwargs,
    )
    assert isinstance(engine.post_hooks, PostHookHandle)
    return engine.post_hooks, gsm, dp_opt, dl, model


def _step(gsm: nn.Module, dp_opt, x: torch.Tensor, y: torch.Tensor) -> None:
    dp_opt.zero_grad()
    nn.functional.mse_loss(gsm(x), y).backward()
    dp_opt.step()


@pytest.mark.parametrize("with_denoiser", [False, True], ids=["no-denoiser", "recorder"])
def test_batch_memory_manager_counts_and_calls_back_once_per_logical_step(with_denoiser: bool) -> None:
    rec = Recorder()
    handle, gsm, dp_opt, dl, model = _private([rec] if with_denoiser else [])
    calls: list[tuple[int, StepDiagnostics | None, torch.Tensor]] = []
    handle.add_step_callback(lambda i, d: calls.append((i, d, model[0].weight.detach().clone())))
    physical, ends = 0, []
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=8, optimizer=dp_opt) as mem:
        for x, y in mem:
            before = len(calls)
            _step(gsm, dp_opt, x, y)
            physical += 1
            if len(calls) > before:  # the callback ran after the update of this logical step
                ends.append(physical)
                assert torch.equal(calls[-1][2], model[0].weight)
    assert len(dl) == 4 and physical >= 16
    assert handle.logical_steps == 4
    assert [i for i, _, _ in calls] == [0, 1, 2, 3]
    assert len(ends) == 4 and ends[-1] == physical
    diags = [d for _, d, _ in calls]
    assert all(isinstance(d, StepDiagnostics) and not d.skipped for d in diags)
    assert [d.step for d in diags] == [0, 1, 2, 3]
    assert handle.diagnostics.steps == 4
    if with_denoiser:
        assert [r[0]["step"] for r in rec.seen] == [0, 1, 2, 3]


def test_inner_optimizer_stepped_without_noise_is_not_a_logical_step() -> None:
    handle, gsm, dp_opt, dl, _ = _private([Recorder()], data=loader(64, 16, d_out=4))
    calls: list[int] = []
    handle.add_step_callback(lambda i, d: calls.append(i))
    x, y = next(iter(dl))
    nn.functional.mse_loss(gsm(x), y).backward()
    with pytest.warns(DoctorWarning, match="without a noisy, accounted DP step"):
        dp_opt.original_optimizer.step()  # bypasses Opacus: no noise, no logical step
    assert calls == [] and handle.logical_steps == 0
    _step(gsm, dp_opt, x, y)  # a real DP step afterwards is step 0
    assert calls == [0] and handle.logical_steps == 1


def test_removed_callback_stops_while_the_counter_goes_on() -> None:
    handle, gsm, dp_opt, dl, _ = _private([], data=loader(64, 16, d_out=4))
    first: list[int] = []
    second: list[int] = []
    h1 = handle.add_step_callback(lambda i, d: first.append(i))
    handle.add_step_callback(lambda i, d: second.append(i))
    batches = list(dl)
    _step(gsm, dp_opt, *batches[0])
    h1.remove()
    for x, y in batches[1:3]:
        _step(gsm, dp_opt, x, y)
    assert first == [0] and second == [0, 1, 2] and handle.logical_steps == 3
    handle.remove()  # detached: nothing is counted or called any more
    _step(gsm, dp_opt, *batches[3])
    assert second == [0, 1, 2] and handle.logical_steps == 3
    with pytest.raises(TypeError, match="callable"):
        handle.add_step_callback(42)  # type: ignore[arg-type]


def test_skipped_nonfinite_step_is_counted_and_reported() -> None:
    base = loader(64, 16, d_out=4)
    x_all, y_all = base.dataset.tensors
    x_all = x_all.clone()
    x_all[3] = float("nan")  # one poisoned example in the first batch
    data = DataLoader(TensorDataset(x_all, y_all), batch_size=16)
    handle, gsm, dp_opt, _, _ = _private([Recorder()], data=data, on_nonfinite_grad="skip_step")
    calls: list[tuple[int, StepDiagnostics | None]] = []
    handle.add_step_callback(lambda i, d: calls.append((i, d)))
    # fixed batches (the Poisson sample is drawn from OS entropy): the first holds the poisoned example
    batches = [(x_all[:16], y_all[:16]), (x_all[16:32], y_all[16:32])]
    with pytest.warns(RuntimeWarning, match="skipping the step"):
        _step(gsm, dp_opt, *batches[0])
    _step(gsm, dp_opt, *batches[1])
    assert handle.logical_steps == 2
    assert [i for i, _ in calls] == [0, 1]
    assert calls[0][1] is not None and calls[0][1].skipped
    assert calls[1][1] is not None and not calls[1][1].skipped
