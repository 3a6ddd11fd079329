"""Cost of BandMF's noise stream beside DP-SGD's, same-run ratios (``docs/results/mechanisms.md``, "Cost").

Per bed, one DP model per arm — ``gaussian`` (DP-SGD: Opacus' own noise, no mechanism installed) and ``b<k>``, BandMF
with k bands (``make_private(..., noise_mechanism=("bandmf", {"bands": k}), steps=--horizon)``) — all from the same
initialization, no denoisers, the batch check and the doctor off (the doctor would rightly flag the fixed batches);
stepped on the same fixed batches of exactly B records, one step per arm per round, the order reversed every other
round (A B C D, D C B A, ...), medians with quartiles. Each step draws its indices from the arm's own sampler
(Opacus' Poisson over N records; cyclic Poisson over the step's group of N/b, which the engine checks is drawn once
per step) but trains on the fixed batch: the draws are timed, the collation of a batch is in neither arm.

* the step-time ratio bandmf / gaussian: the ratio of the medians, and the median [quartiles] of the per-round
  ratios; b = 1 is a control (BandMF with one band releases DP-SGD's noise: ≈ 1.00 up to timing noise);
* noise generation: the optimizer's ``add_noise`` (the i.i.d. draw, the stream, the addition to the clipped sum)
  timed inside the step, as a share of the arm's median step, and BandMF's extra over the gaussian ``add_noise`` as a
  share of the median gaussian step;
* the stream alone, offline after the steps (``--reps`` passes over every tensor on pre-drawn noise, at the run's
  thread count and at one thread), as a share of the median gaussian step: on a CPU shared with other work, a
  parallel region can stall when its other thread is descheduled, which inflates the in-step time of many small
  operations; the one-thread figure shows the work without that;
* the memory of the stream's buffers (``BandStream.memory_bytes()``) against (b − 1) × the trainable parameters'
  bytes;
* the noise certificate (``docs/mechanisms.md``, "The noise certificate"; on by default in every arm): its
  ``check`` timed inside the step, as a share of the arm's median step (target ≤ 0.5 %).

Before timing, every BandMF stream is primed with b − 1 draws per tensor: the timed steps run at the stream's steady
state (b − 1 buffers per tensor; until then a step's stream work grows with the buffers held). The per-step cost does
not depend on the run's length T (``--horizon``, what the coefficients are optimized for).

Beds: ``lora`` — SmolLM2-135M-Instruct (packaged weights; a random initialization of its shapes when they are not
installed, recorded) with LoRA r = 32, α = 64 on every ``q_proj`` / ``v_proj`` (``overhead_llm.CASES["qv"]``), B = 64
sequences of ``--seq`` tokens, AdamW; ``mlp`` and ``cnn`` — the Fashion-MNIST models of :mod:`dp_bench.vision` at
B = ``--vision-batch`` on random 28 × 28 images (timings do not depend on the pixels), SGD. The loaders' dataset size
N (``--lora-records``, ``--vision-records``) only sets q = B/N (b·q ≤ 1 is required).

    OMP_NUM_THREADS=2 dp-bench mechanism-cost
    dp-bench mechanism-cost --replot          # the table and the plot of docs/results/mechanism_cost.json
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from opacus_spectral.errors import ReproducibleNoiseWarning
from opacus_spectral.mechanisms.install import mechanism_of
from torch import nn

from opacus_spectral import PrivacyEngine, causal_lm_loss

from .. import runner
from ..config import opt, parse_config, start
from ..meta import RESULTS
from ..timing import spread, sync, timed_steps
from ..vision import build as build_vision

BEDS = ("lora", "mlp", "cnn")
TARGET_SHARE = 0.01  #: the target: noise generation <= 1 % of a DP step
CERTIFICATE_SHARE = 0.005  #: the target: the noise certificate <= 0.5 % of a DP step


@dataclass
class Config:
    beds: str = opt("lora,mlp,cnn", "comma-separated: lora (SmolLM2 DP-LoRA), mlp, cnn (Fashion-MNIST)")
    model: str = opt("smollm2", "lora bed: smollm2 or tiny (the tests' random tiny Llama)", choices=("smollm2", "tiny"))
    bands: str = opt("1,4,32", "comma-separated BandMF bands, each an arm beside gaussian")
    device: str = opt("cpu", "cpu or cuda")
    lora_batch: int = opt(64, "lora bed: batch B (sequences)")
    lora_physical: int = opt(64, "lora bed: physical batch (a step is B / physical forward-backward passes)")
    seq: int = opt(32, "lora bed: tokens per sequence (the §10 bed's blocks; shorter: a larger noise share)")
    lora_records: int = opt(4096, "lora bed: the loader's N (sets q = B/N only)")
    lora_rounds: int = opt(3, "lora bed: timed rounds (one step per arm each)")
    vision_batch: int = opt(1024, "mlp / cnn beds: batch B")
    vision_records: int = opt(60000, "mlp / cnn beds: the loader's N (Fashion-MNIST's training set)")
    vision_rounds: int = opt(15, "mlp / cnn beds: timed rounds (one step per arm each)")
    warmup: int = opt(1, "untimed warm-up steps per arm")
    reps: int = opt(20, "offline passes of the stream over every tensor (per thread count)")
    horizon: int = opt(100, "the run length T BandMF's coefficients are optimized for (>= every b)")
    noise_seed: int = opt(0, "PrivacyEngine noise_seed (a benchmark: only timings are kept)")
    out: Path = opt(RESULTS / "mechanism_cost.json", "result JSON")
    plot: Path = opt(RESULTS / "mechanism_cost.png", "result plot (PNG)")
    replot: bool = opt(False, "only the table and the plot from --out")

    def validate(self) -> None:
        unknown = [b for b in self.beds.split(",") if b and b not in BEDS]
        if unknown or not any(self.beds.split(",")):
            raise ValueError(f"unknown or no beds {unknown}; choose from {list(BEDS)}")
        try:
            bands = [int(b) for b in self.bands.split(",") if b]
        except ValueError:
            raise ValueError(f"--bands must be comma-separated integers, got {self.bands!r}") from None
        if not bands or min(bands) < 1 or max(bands) > self.horizon:
            raise ValueError(f"--bands must be integers in [1, --horizon={self.horizon}], got {self.bands!r}")
        if min(self.lora_rounds, self.vision_rounds, self.warmup, self.seq - 1) < 1:
            raise ValueError("--lora-rounds, --vision-rounds and --warmup must be >= 1, --seq >= 2")
        if not 1 <= self.lora_physical <= self.lora_batch:
            raise ValueError(f"need 1 <= --lora-physical <= --lora-batch, got {self.lora_physical}")

    def band_list(self) -> list[int]:
        return [int(b) for b in self.bands.split(",") if b]


class _Rows(torch.utils.data.Dataset):
    """``n`` records cycling over the rows of ``tensors`` (the loader only needs N for q = B/N)."""

    def __init__(self, tensors: Sequence[torch.Tensor], n: int) -> None:
        self.tensors, self.n = tuple(tensors), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i % len(t)] for t in self.tensors)


@dataclass
class Bed:
    """A model to time: ``build()`` gives the same initialization at every call."""

    name: str
    source: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    batches: list[tuple[torch.Tensor, ...]]  # fixed batches of exactly B rows
    records: int
    physical: int
    rounds: int
    extra: dict[str, Any] = field(default_factory=dict)


def _lora_model(cfg: Config, rows: int) -> tuple[nn.Module, torch.Tensor, str]:
    from ..data import DataUnavailableError
    from .overhead_llm import load_model

    try:
        return load_model(cfg.model, rows, cfg.seq)
    except DataUnavailableError:  # the SmolLM2 package (or the texts) not installed: its shapes, random weights
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        shape = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
        ids = torch.randint(0, 49152, (rows, cfg.seq), generator=torch.Generator().manual_seed(0))
        return LlamaForCausalLM(shape).train(), ids, "random init, SmolLM2-135M shapes (weights absent), random tokens"


def lora_bed(cfg: Config) -> Bed:
    from peft import LoraConfig, get_peft_model

    from .overhead_llm import CASES

    targets, r, alpha = CASES["qv"]
    base, ids, source = _lora_model(cfg, 2 * cfg.lora_batch)

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            lora = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets))
            return get_peft_model(copy.deepcopy(base), lora).train()

    return Bed(
        name="lora",
        source=source,
        build=build,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        loss=lambda m, b: causal_lm_loss(m(input_ids=b[0]).logits, b[0]),
        batches=[(ids[: cfg.lora_batch],), (ids[cfg.lora_batch :],)],
        records=cfg.lora_records,
        physical=cfg.lora_physical,
        rounds=cfg.lora_rounds,
        extra={"target_modules": list(targets), "r": r, "lora_alpha": alpha, "seq": cfg.seq},
    )


def vision_bed(name: str, cfg: Config) -> Bed:
    g = torch.Generator().manual_seed(0)
    n = cfg.vision_batch
    x, y = torch.randn(2 * n, 1, 28, 28, generator=g), torch.randint(0, 10, (2 * n,), generator=g)
    crit = nn.CrossEntropyLoss()
    return Bed(
        name=name,
        source=f"dp_bench.vision {name}, random 28x28 images",
        build=lambda: build_vision(name, 0),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
        loss=lambda m, b: crit(m(b[0]), b[1]),
        batches=[(x[:n], y[:n]), (x[n:], y[n:])],
        records=cfg.vision_records,
        physical=n,
        rounds=cfg.vision_rounds,
    )


@dataclass
class Arm:
    module: Any
    optimizer: Any
    loader: Any
    noise_s: list[float]
    setup_s: float
    trainable_bytes: int
    _indices: Any = None
    cert_s: list[float] = field(default_factory=list)

    def draw(self) -> list[int]:
        """The next batch's indices from the arm's sampler (a new pass when one ends)."""
        for _ in range(2):
            if self._indices is None:
                self._indices = iter(self.loader.batch_sampler)
            try:
                return next(self._indices)
            except StopIteration:
                self._indices = None
        raise RuntimeError("the sampler yields no batch")


def _time_noise(optimizer: Any, device: torch.device) -> list[float]:
    """Wrap the optimizer's ``add_noise`` (Opacus' own, or the mechanism's) to record its seconds per call."""
    inner, seconds = optimizer.add_noise, []

    def add_noise() -> None:
        sync(device)
        t0 = time.perf_counter()
        inner()
        sync(device)
        seconds.append(time.perf_counter() - t0)

    optimizer.add_noise = add_noise  # Opacus calls self.add_noise()
    return seconds


def _time_certificate(certificate: Any, device: torch.device) -> list[float]:
    """Wrap the engine's noise certificate's ``check`` (called from the step hook) to record its seconds per call."""
    inner, seconds = certificate.check, []

    def check(optimizer: Any) -> None:
        sync(device)
        t0 = time.perf_counter()
        inner(optimizer)
        sync(device)
        seconds.append(time.perf_counter() - t0)

    certificate.check = check  # the hook calls certificate.check(optim): the instance attribute wins
    return seconds


def prime_stream(optimizer: Any) -> None:
    """b − 1 draws through the mechanism for every tensor the optimizer holds (the keys ``install_noise`` uses):
    the stream's steady state, b − 1 buffers per tensor."""
    mech = mechanism_of(optimizer)
    params = [p for g in optimizer.original_optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for _ in range(mech.bands - 1):
            for i, p in enumerate(params):
                mech.noise(i, torch.randn_like(p))
            mech.end_step()


def make_arm(bed: Bed, bands: int | None, cfg: Config, device: torch.device) -> Arm:
    """The bed's model under DP with ``bands`` (None: gaussian); BandMF's stream primed; ``add_noise`` timed."""
    model = bed.build().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(_Rows(bed.batches[0], bed.records), batch_size=len(bed.batches[0][0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        engine = PrivacyEngine(accountant="prv", noise_seed=cfg.noise_seed)
    mechanism = {} if bands is None else {"noise_mechanism": ("bandmf", {"bands": bands}), "steps": cfg.horizon}
    t0 = time.perf_counter()
    gsm, dp_opt, dp_loader = engine.make_private(
        module=model,
        optimizer=bed.optimizer(params),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=True,
        batch_check=False,
        doctor=False,
        **mechanism,
    )
    setup_s = time.perf_counter() - t0
    if bands is not None:
        prime_stream(dp_opt)
        # the certificate follows the stream's step (primed outside any DP step: nothing released to whiten yet)
        engine.noise_certificate.t = mechanism_of(dp_opt).stream_step
    nbytes = sum(p.numel() * p.element_size() for p in params)
    arm = Arm(gsm, dp_opt, dp_loader, _time_noise(dp_opt, device), setup_s, nbytes)
    arm.cert_s = _time_certificate(engine.noise_certificate, device)
    return arm


def _dp_step(bed: Bed, arm: Arm, batch: tuple[torch.Tensor, ...], device: torch.device) -> None:
    """One DP step on ``batch`` (the sampler's indices drawn, not used): physical batches accumulated (Opacus' skip
    signal), noise at the last."""
    arm.draw()
    n = len(batch[0])
    starts = list(range(0, n, bed.physical))
    for k, s in enumerate(starts):
        arm.optimizer.zero_grad(set_to_none=True)
        bed.loss(arm.module, tuple(t[s : s + bed.physical].to(device) for t in batch)).backward()
        arm.optimizer.signal_skip_step(do_skip=k < len(starts) - 1)
        arm.optimizer.step()


def run_bed(bed: Bed, cfg: Config, device: torch.device) -> dict[str, Any]:
    """Every arm of ``bed`` interleaved, summarized by :func:`summarize`."""
    bands = cfg.band_list()
    names = ["gaussian", *(f"b{b}" for b in bands)]
    arms = {"gaussian": make_arm(bed, None, cfg, device)} | {f"b{b}": make_arm(bed, b, cfg, device) for b in bands}

    def step(i: int, name: str) -> None:
        _dp_step(bed, arms[name], bed.batches[(i // len(names)) % len(bed.batches)], device)

    def clear() -> None:
        for a in arms.values():
            a.noise_s.clear()
            a.cert_s.clear()

    def after(i: int, name: str, seconds: float) -> None:
        print(f"[{bed.name}] step {i} {name}: {seconds:.3f} s", flush=True)

    load0 = os.getloadavg()
    times = timed_steps(
        step, bed.rounds, arms=names, warmup=cfg.warmup * len(names), device=device, on_start=clear, after=after
    )
    out = summarize(times, arms, bands)
    g_step = out["arms"]["gaussian"]["step_s"]["median"]
    for b in bands:
        out["bands"][str(b)]["offline_stream"] = offline_stream(arms[f"b{b}"].optimizer, cfg.reps, device, g_step)
    n_params = sum(p.numel() for p in arms["gaussian"].module.parameters() if p.requires_grad)
    out.update(source=bed.source, trainable_params=n_params, batch=len(bed.batches[0][0]), records=bed.records)
    out.update(physical=bed.physical, sample_rate=len(bed.batches[0][0]) / bed.records, **bed.extra)
    out.update(loadavg_start=load0, loadavg_end=os.getloadavg())
    return out


def offline_stream(optimizer: Any, reps: int, device: torch.device, step_s: float) -> dict[str, Any]:
    """The stream's work for one step (every tensor, on pre-drawn noise; the draw itself excluded), ``reps`` times,
    at the run's thread count and (CPU) at one thread: spreads and the median's share of ``step_s``."""
    mech = mechanism_of(optimizer)
    params = [p for g in optimizer.original_optimizer.param_groups for p in g["params"]]
    zs = [torch.randn_like(p) for p in params]
    threads = [torch.get_num_threads()] + ([1] if device.type == "cpu" and torch.get_num_threads() > 1 else [])
    out: dict[str, Any] = {}
    for n in threads:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            with torch.no_grad():
                ts = timed_steps(lambda i, a: [mech.noise(k, z) for k, z in enumerate(zs)], reps, device=device)[None]
        finally:
            torch.set_num_threads(before)
        out[f"threads_{n}"] = {"seconds": spread(ts), "share_of_gaussian_step": statistics.median(ts) / step_s}
    return out


def summarize(times: dict[str, list[float]], arms: dict[str, Arm], bands: Sequence[int]) -> dict[str, Any]:
    """Per arm: step and ``add_noise`` spreads; per b: the ratios, the noise shares and the stream's memory."""
    g_step = statistics.median(times["gaussian"])
    g_noise = statistics.median(arms["gaussian"].noise_s)
    out: dict[str, Any] = {"arms": {}, "bands": {}}
    for name, arm in arms.items():
        out["arms"][name] = {
            "step_s": spread(times[name]),
            "add_noise_s": spread(arm.noise_s),
            "raw_step_s": times[name],
            "raw_add_noise_s": list(arm.noise_s),
            "setup_s": arm.setup_s,
            "certificate_s": spread(arm.cert_s),
            "certificate_share_of_step": statistics.median(arm.cert_s) / statistics.median(times[name]),
        }
        row = out["arms"][name]
        row["meets_certificate_share"] = row["certificate_share_of_step"] <= CERTIFICATE_SHARE
    trainable = arms["gaussian"].trainable_bytes
    for b in bands:
        arm, t = arms[f"b{b}"], times[f"b{b}"]
        noise = statistics.median(arm.noise_s)
        out["bands"][str(b)] = {
            "step_ratio": statistics.median(t) / g_step,
            "round_ratio": spread([a / g for a, g in zip(t, times["gaussian"], strict=True)]),
            "noise_share_of_step": noise / statistics.median(t),
            "gaussian_noise_share_of_step": g_noise / g_step,
            "extra_noise_share": (noise - g_noise) / g_step,
            "stream_bytes": mechanism_of(arm.optimizer).buffer_bytes(),  # b − 1 buffers per tensor
            "expected_bytes": (b - 1) * trainable,
        }
        out["bands"][str(b)]["meets_target_share"] = out["bands"][str(b)]["noise_share_of_step"] <= TARGET_SHARE
    out["trainable_bytes"] = trainable
    return out


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} [{s['q1'] * 1e3:.1f}, {s['q3'] * 1e3:.1f}]"


def _offline(o: dict[str, Any]) -> str:
    """``ms at n threads / ms at 1 thread | share at n / share at 1`` of the offline stream timing."""
    ms = " / ".join(f"{v['seconds']['median'] * 1e3:.2f}" for v in o.values())
    share = " / ".join(f"{100 * v['share_of_gaussian_step']:.2f} %" for v in o.values())
    return f"{ms} ({', '.join(k.removeprefix('threads_') for k in o)} thr) | {share}"


def tables(result: dict[str, Any]) -> str:
    """One row per (bed, b): step times, the ratios, the noise shares and the stream's memory."""
    lines = [
        "| bed | b | step gaussian ms | step bandmf ms | ratio (medians) | per-round ratio | add_noise gaussian ms "
        "| add_noise bandmf ms | noise / step | extra / step | stream offline ms | stream / step | stream MiB "
        "| (b−1)×params MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for bed, c in result["beds"].items():
        g = c["arms"]["gaussian"]
        for b, r in c["bands"].items():
            a, rr = c["arms"][f"b{b}"], r["round_ratio"]
            lines.append(
                f"| {bed} | {b} | {_ms(g['step_s'])} | {_ms(a['step_s'])} | {r['step_ratio']:.3f} | "
                f"{rr['median']:.3f} [{rr['q1']:.3f}, {rr['q3']:.3f}] | {_ms(g['add_noise_s'])} | "
                f"{_ms(a['add_noise_s'])} | {100 * r['noise_share_of_step']:.2f} % | "
                f"{100 * r['extra_noise_share']:.2f} % | {_offline(r['offline_stream'])} | "
                f"{r['stream_bytes'] / 2**20:.2f} | "
                f"{r['expected_bytes'] / 2**20:.2f} |"
            )
    lines += ["", "| bed | arm | step ms | noise certificate ms | certificate / step |", "|---|---|---|---|---|"]
    for bed, c in result["beds"].items():
        for name, a in c["arms"].items():
            if "certificate_s" in a:  # results stored before the certificate have none
                share = 100 * a["certificate_share_of_step"]
                lines.append(f"| {bed} | {name} | {_ms(a['step_s'])} | {_ms(a['certificate_s'])} | {share:.3f} % |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: step-time ratio bandmf / gaussian per bed and b (per-round quartiles); right: add_noise's share of the
    step (pale) and its extra over the gaussian add_noise (solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beds = list(result["beds"])
    bands = list(next(iter(result["beds"].values()))["bands"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(bands)
    for j, b in enumerate(bands):
        xs = [i + (j - (len(bands) - 1) / 2) * width for i in range(len(beds))]
        rows = [result["beds"][bed]["bands"][b] for bed in beds]
        rr = [r["round_ratio"] for r in rows]
        err = [[r["median"] - r["q1"] for r in rr], [r["q3"] - r["median"] for r in rr]]
        left.bar(xs, [r["median"] for r in rr], width, yerr=err, capsize=3, label=f"b = {b}")
        color = f"C{j}"
        right.bar(xs, [100 * r["noise_share_of_step"] for r in rows], width, color=color, alpha=0.35)
        right.bar(xs, [100 * r["extra_noise_share"] for r in rows], width, color=color, label=f"b = {b}")
    left.axhline(1.0, color="black", lw=0.8)
    right.axhline(100 * TARGET_SHARE, color="tab:red", ls="--", lw=1, label="1 % target")
    for ax, title in (
        (left, "step time, bandmf / gaussian (per round)"),
        (right, "add_noise, % of the step (solid: extra over DP-SGD)"),
    ):
        ax.set_xticks(range(len(beds)), beds)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT = runner.Report(tables=tables, plot=plot)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(Config, argv, prog="dp-bench mechanism-cost", description=__doc__)
    if cfg.replot:
        return runner.replot(cfg.out, REPORT, cfg.plot)
    device = torch.device(cfg.device)
    res: dict[str, Any] = {
        **start("mechanism-cost", cfg, argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": os.cpu_count(),
        "target_share": TARGET_SHARE,
        "beds": {},
    }
    t0 = time.perf_counter()
    for name in (b for b in cfg.beds.split(",") if b):
        bed = lora_bed(cfg) if name == "lora" else vision_bed(name, cfg)
        res["beds"][name] = run_bed(bed, cfg, device)
        print(f"[{name}] done at {time.perf_counter() - t0:.0f} s", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    return runner.write(res, REPORT, cfg.out, cfg.plot, indent=2)
