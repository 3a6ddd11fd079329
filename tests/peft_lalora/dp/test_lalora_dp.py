"""LALoRA under DP-SGD: opacus_spectral.PrivacyEngine in hooks / functorch / ghost modes, with
BatchMemoryManager, the role plugin seen by denoisers, and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

opacus_spectral = pytest.importorskip("opacus_spectral")
from lalora_support import batch, build, changed_factors, factor_snapshot  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402

import peft_lalora  # noqa: E402
from peft_lalora import AlternationController  # noqa: E402

EXPECTED_3_3 = {  # 3 steps, start_round(), 3 steps
    ("step", "B"): ["B", "A", "B", "B", "A", "B"],
    ("step", "A"): ["A", "B", "A", "A", "B", "A"],
    ("round", "B"): ["B", "B", "B", "A", "A", "A"],
    ("freeze_a", "B"): ["B"] * 6,
    ("none", "B"): ["AB"] * 6,
}


class Recorder(opacus_spectral.Denoiser):
    """Identity denoiser that records what it is shown: (role, layer) of every LoRA gradient, per step."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, tuple[str, str | None]]] = []

    def __call__(self, grads):  # type: ignore[override]
        self.seen.append({g.name: (g.role, g.layer) for g in grads if "lora_" in g.name})
        return None


def _private(arch: str, mode: str, first: str, grad_sample_mode: str, n: int = 48, batch_size: int = 8, **kw):
    model = build(arch, alternation=mode, first_factor=first, init_b=kw.pop("init_b", False))
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2, weight_decay=0.1))
    x, y = batch(n, seed=5)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    recorder = Recorder()
    out = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode=grad_sample_mode,
        post_hooks=[recorder],
        **kw,
    )
    if grad_sample_mode == "ghost":
        private, dp_opt, criterion, dl = out
    else:
        (private, dp_opt, dl), criterion = out, nn.CrossEntropyLoss()
    ctrl = AlternationController(model, dp_opt)  # after make_private: both factors were trainable at wrap time
    return model, private, dp_opt, criterion, dl, ctrl, recorder, engine


def _dp_step(private, dp_opt, criterion, x, y) -> None:
    dp_opt.zero_grad()
    loss = criterion(private(x).logits, y)
    loss.backward()
    dp_opt.step()


def _run(model, private, dp_opt, criterion, dl, ctrl, steps: int = 6):
    phases, moved = [], []
    batches = iter(dl)
    for i in range(steps):
        if i == 3:
            ctrl.start_round()
        phases.append(ctrl.phase)
        before = factor_snapshot(model)
        x, y = next(batches)
        _dp_step(private, dp_opt, criterion, x, y)
        moved.append(changed_factors(before, model))
    return phases, moved


@pytest.mark.parametrize("grad_sample_mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_lalora_under_opacus_modes(arch: str, grad_sample_mode: str) -> None:
    torch.manual_seed(0)
    model, private, dp_opt, criterion, dl, ctrl, rec, engine = _private(
        arch, "step", "B", grad_sample_mode, poisson_sampling=False
    )
    phases, moved = _run(model, private, dp_opt, criterion, dl, ctrl)
    assert phases == moved == EXPECTED_3_3[("step", "B")]
    # the denoiser saw exactly the active factor's gradients, with LoRA roles and a shared layer name
    assert len(rec.seen) == 6
    for phase, seen in zip(phases, rec.seen, strict=True):
        roles = {role for role, _ in seen.values()}
        assert roles == {"lora_" + phase}
        assert all(layer and name.startswith(layer + ".lora_") for name, (_, layer) in seen.items())
    # six steps in one pass of the loader (poisson_sampling=False): the un-amplified bound, one Gaussian mechanism
    assert engine.accountant.history == [(1.0, 1.0, 1)]


@pytest.mark.parametrize(("mode", "first"), [k for k in EXPECTED_3_3 if k != ("step", "B")])
def test_other_modes_under_opacus(mode: str, first: str) -> None:
    torch.manual_seed(1)
    model, private, dp_opt, criterion, dl, ctrl, rec, _ = _private("bert", mode, first, "hooks", poisson_sampling=False)
    phases, moved = _run(model, private, dp_opt, criterion, dl, ctrl)
    assert phases == moved == EXPECTED_3_3[(mode, first)]


def test_batch_memory_manager_virtual_steps_do_not_count() -> None:
    torch.manual_seed(2)
    model, private, dp_opt, criterion, dl, ctrl, rec, engine = _private(
        "gpt2", "step", "B", "hooks", n=32, batch_size=16, poisson_sampling=False
    )
    real_phases, real_moved, virtual = [], [], 0
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=4, optimizer=dp_opt) as mem_loader:
        for x, y in mem_loader:
            phase = ctrl.phase
            before = factor_snapshot(model)
            _dp_step(private, dp_opt, criterion, x, y)
            if dp_opt._is_last_step_skipped:
                virtual += 1
                assert changed_factors(before, model) == "" and ctrl.phase == phase
            else:
                real_phases.append(phase)
                real_moved.append(changed_factors(before, model))
    assert virtual == 6  # 2 logical batches of 16 = 8 physical batches of 4
    assert real_phases == real_moved == ["B", "A"]
    assert ctrl.total_steps == 2 and len(rec.seen) == 2


def test_lora_moves_under_dp_poisson() -> None:
    torch.manual_seed(3)
    model, private, dp_opt, criterion, dl, ctrl, rec, _ = _private("bert", "none", "B", "hooks")
    before = factor_snapshot(model)
    for x, y in dl:  # Poisson batches
        _dp_step(private, dp_opt, criterion, x, y)
        break
    assert changed_factors(before, model) == "AB"  # upstream #820: LoRA must not be silently frozen


def test_role_plugin_names_and_shapes() -> None:
    from peft_lalora.dp.roles import lora_parameter_roles

    for arch in ("bert", "gpt2"):
        model = build(arch)
        roles = lora_parameter_roles(model)
        params = dict(model.named_parameters())
        assert len(roles) == 8 if arch == "bert" else len(roles) == 4
        for name, role in roles.items():
            p = params[name]
            assert name.startswith(role.layer + ".")
            if role.role == "lora_A":
                assert p.shape[0] == 4  # (r, in_features)
            else:
                assert role.role == "lora_B" and p.shape[1] == 4  # (out_features, r)
        if arch == "gpt2":  # Conv1D c_attn: in 32, out 96 (q, k, v)
            a = [params[n] for n, r in roles.items() if r.role == "lora_A"][0]
            b = [params[n] for n, r in roles.items() if r.role == "lora_B"][0]
            assert tuple(a.shape) == (4, 32) and tuple(b.shape) == (96, 4)
        # the registry finds the plugin through the installed entry point
        assert opacus_spectral.plugins.get_registry().roles(model) == roles


def test_lowpass_with_roles_runs_under_alternation() -> None:
    pytest.importorskip("opacus_spectral.denoisers.lowpass")  # the built-in lowpass denoiser (written separately)
    torch.manual_seed(4)
    model = build("bert")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2, weight_decay=0.1))
    x, y = batch(16, seed=6)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    private, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        post_hooks=["lowpass"],
        poisson_sampling=False,
    )
    ctrl = AlternationController(model, dp_opt)
    for xb, yb in dl:
        before = factor_snapshot(model)
        phase = ctrl.phase
        _dp_step(private, dp_opt, nn.CrossEntropyLoss(), xb, yb)
        assert changed_factors(before, model) == phase


def test_per_layer_clipping_with_alternation_is_refused() -> None:
    model = build("bert")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    x, y = batch(16, seed=7)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    private, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=[1.0] * n_trainable,
        clipping="per_layer",
    )
    with pytest.raises(ValueError, match="per-layer clipping"):
        AlternationController(model, dp_opt)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # nothing frozen
    AlternationController(model, dp_opt, mode="none")  # both factors every step: fine


def test_lora_on_embedding_under_dp_is_refused() -> None:
    model = build("bert", target_modules=["query", "word_embeddings"])
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    x, y = batch(16, seed=8)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match="lora_embedding_A.*ParameterDict|ParameterDict.*Embedding"):
        engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_dp_optimizer_without_opacus_spectral_gives_install_hint(monkeypatch) -> None:
    import opacus

    model = build("bert")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    x, y = batch(16, seed=9)
    private, dp_opt, dl = opacus.PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    monkeypatch.setitem(sys.modules, "opacus_spectral", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"peft_lalora\[dp\]"):
        AlternationController(model, dp_opt)


def test_dp_checkpoint_resume_mid_round_reproduces_uninterrupted_run(tmp_path) -> None:
    """Model, DP optimizer, accountant, controller and noise-generator state saved after step 4 (mid round 1);
    a fresh process-like rebuild continues with the same phases and bit-identical weights. (The engine draws its
    noise from OS entropy by default; a test that replays the noise passes its own generator and saves it.)"""

    def fresh():
        torch.manual_seed(10)
        objs = _private(
            "gpt2",
            "step",
            "A",
            "hooks",
            n=64,
            poisson_sampling=False,
            init_b=True,
            noise_generator=torch.Generator().manual_seed(3),
        )
        return (*objs[:4], list(objs[4]), *objs[5:])  # materialise batches: iterating a loader draws from the RNG

    def steps(objs, idx, log):
        model, private, dp_opt, criterion, data, ctrl, _, _ = objs
        for i in idx:
            if i == 2:
                ctrl.start_round()
            log.append(ctrl.phase)
            _dp_step(private, dp_opt, criterion, *data[i])

    objs = fresh()
    full: list[str] = []
    steps(objs, range(7), full)
    reference = {n: p.detach().clone() for n, p in objs[0].named_parameters()}

    objs = fresh()
    part: list[str] = []
    steps(objs, range(4), part)
    model, _, dp_opt, _, _, ctrl, _, engine = objs
    torch.save(
        {
            "model": model.state_dict(),
            "opt": dp_opt.state_dict(),
            "ctrl": ctrl.state_dict(),
            "acct": engine.accountant.state_dict(),
            "rng": torch.get_rng_state(),
            "noise": dp_opt.generator.get_state(),
        },
        tmp_path / "ckpt.pt",
    )
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    objs = fresh()
    model, _, dp_opt, _, _, ctrl, _, engine = objs
    model.load_state_dict(ckpt["model"])
    dp_opt.load_state_dict(ckpt["opt"])
    engine.accountant.load_state_dict(ckpt["acct"])
    ctrl.load_state_dict(ckpt["ctrl"])
    torch.set_rng_state(ckpt["rng"])
    dp_opt.generator.set_state(ckpt["noise"])
    steps(objs, range(4, 7), part)
    assert part == full == ["A", "B", "A", "B", "A", "B", "A"]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), reference[n]), n
    # one pass before the checkpoint, and one more charged after it: the rebuilt loader's pass is a new one to the
    # engine (poisson_sampling=False: the un-amplified bound, docs/engine.md)
    assert engine.accountant.history == [(1.0, 1.0, 2)]


def test_factor_frozen_before_make_private_is_refused() -> None:
    model = build("bert", alternation="step")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    early = AlternationController(model, opt)  # wrong order: freezes A before make_private
    assert early.phase == "B"
    x, y = batch(16, seed=11)
    engine = opacus_spectral.PrivacyEngine(accountant="rdp")
    private, dp_opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(ValueError, match="must be trainable when make_private is called"):
        AlternationController(model, dp_opt)


def _loader(seed: int) -> DataLoader:
    x, y = batch(16, seed=seed)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _one_step(private, dp_opt, dl) -> None:
    x, y = next(iter(dl))
    dp_opt.zero_grad()
    nn.functional.cross_entropy(private(x).logits, y).backward()
    dp_opt.step()


def test_a_controller_created_before_make_private_raises_at_the_first_dp_step_before_the_update() -> None:
    """Before: a doctor warning, then Opacus' "Per sample gradient is not initialized" one step later."""
    model = build("bert", alternation="step")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    AlternationController(model, opt)  # wrong order: on the torch optimizer, A frozen before make_private
    private, dp_opt, dl = opacus_spectral.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=_loader(12), noise_multiplier=1.0, max_grad_norm=1.0
    )
    before = factor_snapshot(model)
    with pytest.raises(RuntimeError, match=r"before make_private.*AlternationController\(model, dp_optimizer\)"):
        _one_step(private, dp_opt, dl)
    assert changed_factors(before, model) == ""  # refused before the inner optimizer moved anything


def test_a_controller_refuses_a_dp_optimizer_of_vanilla_opacus_naming_the_fix() -> None:
    """Upstream Opacus cannot freeze a factor between steps ("No activations detected" at the next backward)."""
    import opacus

    model = build("bert", alternation="step")
    model.train()
    opt = torch.optim.AdamW(peft_lalora.lalora_param_groups(model, 1e-2))
    private, dp_opt, dl = opacus.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=_loader(13), noise_multiplier=1.0, max_grad_norm=1.0
    )
    with pytest.raises(ValueError, match=r"opacus\.PrivacyEngine.*opacus_spectral\.PrivacyEngine\(\)"):
        AlternationController(model, dp_opt)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # nothing frozen
    AlternationController(model, dp_opt, mode="none")  # nothing toggles: vanilla Opacus trains it
    _one_step(private, dp_opt, dl)


def test_export_as_lora_carries_the_privacy_record(tmp_path) -> None:
    """A DP-trained LALoRA adapter exported as LoRA keeps its record beside it (before: dropped, and a second run on
    the export reported 4.871 where the composed value was 6.253); from a folder, the folder's record is copied."""
    from opacus_spectral.accounting.record import load_privacy_record, privacy_record_of, read_privacy_record

    model, private, dp_opt, criterion, dl, ctrl, _, engine = _private("bert", "step", "B", "hooks")
    _run(model, private, dp_opt, criterion, dl, ctrl, steps=3)
    out = peft_lalora.export_as_lora(model, tmp_path / "exported", delta=1e-5)
    assert read_privacy_record(out).runs == privacy_record_of(model).runs != ()
    again = peft_lalora.export_as_lora(out, tmp_path / "again")
    assert read_privacy_record(again).runs == read_privacy_record(out).runs
    fresh = build("bert", alternation="step")
    assert load_privacy_record(fresh, again).epsilon(1e-5, "rdp") == pytest.approx(engine.get_epsilon(1e-5))


def test_export_as_lora_without_a_delta_for_a_record_that_has_none_says_so(tmp_path) -> None:
    model, private, dp_opt, criterion, dl, ctrl, _, _ = _private("bert", "step", "B", "hooks")
    _run(model, private, dp_opt, criterion, dl, ctrl, steps=1)
    with pytest.raises(ValueError, match=r"export_as_lora\(\.\.\., delta=\.\.\.\)"):
        peft_lalora.export_as_lora(model, tmp_path / "exported")
