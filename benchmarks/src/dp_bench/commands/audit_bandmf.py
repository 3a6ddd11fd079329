"""``dp-bench audit --experiment fdp-bandmf``: the f-DP one-run audit of BandMF runs (``docs/audit.md``, "BandMF").

Arms: ``bandmf:<b>`` is a correct run of ``noise_mechanism=("bandmf", {"bands": b})``; ``bandmf:<b>:kappa=<K>`` is
a broken one, its coefficients the optimal ones times K — κ = K while its claim (:func:`misaccounted_mu`, on purpose)
takes κ = 1, so the released noise is K times too small for it. (The engine computes κ itself and charges σ/K, so a
mechanism cannot misaccount: the broken claim is made here, in the harness.) Every run is the validity experiment's
(:func:`.audit.validity_run`: the same synthetic data, model, seeds and m white-box canaries) with b·⌈T/b⌉ steps and
σ = √⌈T/b⌉/μ, so that every arm claims the same
μ-GDP for a canary.

Canaries are cyclic (the library's :class:`~opacus_spectral.audit.GradientCanaries` on a BandMF run, here
:class:`CyclicGradientCanaries`): each is in one group g and, when included, takes part in every step t ≡ g (mod b) —
at most ⌈T/b⌉ times, b steps apart: the participation the BandMF analysis bounds, at the within-group rate 1. By
default every canary is in group 0, whose steps are the ones the accounting charges (with T a multiple of b, all of
M's columns at them are whole, so the claim is exact); ``--bm-groups spread`` puts canary i in group i mod b. Their
claim is the mechanism's own accounting at that rate (:func:`opacus_spectral.audit.cyclic.cyclic_claimed_mu`); their
score is the log-likelihood ratio of "included" given the whitened release M·y
(:func:`opacus_spectral.audit.cyclic.whitened_scores`), the data's clipped gradient sum subtracted first (the
canaries' privacy does not rest on the data or its sampling, so an auditor who knows them is still bound by the
claim; ``docs/audit.md``); the release-only score (the library's default) is recorded beside it.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import numpy as np
import torch
from opacus_spectral.audit import GradientCanaries, audit_scores, gaussian_dp_epsilon
from opacus_spectral.audit.cyclic import cyclic_claimed_mu, whitened_scores
from opacus_spectral.mechanisms.bandmf_math import optimal_coefficients
from opacus_spectral.mechanisms.strategy import BandedToeplitz
from opacus_spectral.step.attachment import BEFORE_NOISE, CANARIES, attachment
from torch import nn

from .. import runner
from . import audit

__all__ = [
    "REPORT",
    "CyclicGradientCanaries",
    "arm_steps",
    "bandmf_run",
    "fdp_bandmf",
    "parse_arm",
]


def parse_arm(name: str) -> tuple[int, float]:
    """``"bandmf:4"`` → ``(4, 1.0)``; ``"bandmf:4:kappa=2"`` → ``(4, 2.0)`` (the coefficients times 2)."""
    parts = name.split(":")
    kappa = parts[2].removeprefix("kappa=") if len(parts) == 3 and parts[2].startswith("kappa=") else "1"
    ok = parts[0] == "bandmf" and len(parts) in (2, 3) and parts[1].isdigit() and int(parts[1]) >= 1
    if not ok or (len(parts) == 3 and not parts[2].startswith("kappa=")):
        raise ValueError(f"a BandMF arm is 'bandmf:<bands>' or 'bandmf:<bands>:kappa=<K>', got {name!r}")
    k = float(kappa)
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"{name!r}: kappa must be a positive number")
    return int(parts[1]), k


def arm_steps(steps: int, bands: int) -> int:
    """The arm's run length: ``steps`` rounded up to a multiple of b, so that every group takes part ⌈T/b⌉ times."""
    return bands * math.ceil(steps / bands)


class CyclicGradientCanaries(GradientCanaries):
    """The library's canaries (cyclic on a BandMF run: :mod:`opacus_spectral.audit.cyclic`) that also keep the
    data's clipped gradient sum at each canary's coordinate per step (read before the canaries are added: a
    ``BEFORE_NOISE`` subscriber ordered ahead of theirs), for the data-subtracted score. ``bands = 1``:
    :class:`~opacus_spectral.audit.GradientCanaries` exactly (same coordinates, coins, injections and sums)."""

    def __init__(self, dp_optimizer: Any, num_canaries: int, *, spread: bool = False, module: Any = None, seed=0):
        self._clean: list[torch.Tensor] = []
        groups = "spread" if spread else "first"
        super().__init__(dp_optimizer, num_canaries, module=module, seed=seed, groups=groups)
        self._clean_subscription = attachment(dp_optimizer).subscribe(
            BEFORE_NOISE, self._read_clean, order=CANARIES - 1
        )

    def _read_clean(self, opt: Any) -> None:
        if self.bands > 1:
            summed = [getattr(p, "summed_grad", None) for p in self.parameters]
            self._clean.append(self.gather(summed) / float(opt.max_grad_norm))

    def remove(self) -> None:
        self._clean_subscription.remove()
        super().remove()

    def clean_values(self) -> torch.Tensor:
        """(T, m): the data's clipped gradient sum at each canary's coordinate per step, in the same units."""
        return torch.stack(self._clean)


def misaccounted_mu(can: Any, kappa: float) -> float:
    """The broken arm's claim, on purpose: the canaries' μ with the run's coefficients divided by κ — what an engine
    that dropped κ would claim (the library's claim, σ/κ, is the correct one)."""
    unit = BandedToeplitz(tuple(c / kappa for c in can.mechanism.coefficients))
    return cyclic_claimed_mu(unit, can.noise_multipliers)


def _mechanism(bands: int, kappa: float, steps: int) -> Any:
    """The arm's ``noise_mechanism``: by name when correct, else BandMF with κ × the optimal coefficients."""
    if kappa == 1.0:
        return ("bandmf", {"bands": bands})
    return ("bandmf", {"bands": bands, "coefficients": [kappa * c for c in optimal_coefficients(steps, bands)]})


def bandmf_run(cfg: Any, data: torch.utils.data.TensorDataset, arm: str, seed: int) -> dict[str, Any]:
    """One seed of one arm: both bounds on the whitened scores against the canaries' BandMF claim."""
    bands, kappa = parse_arm(arm)
    steps = arm_steps(cfg.steps, bands)
    sigma = math.sqrt(steps / bands) / cfg.mu
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(data.tensors[0].shape[1], 64), nn.Tanh(), nn.Linear(64, 10))
    run = audit.train(
        model,
        data,
        method="none",
        noise_multiplier=sigma,
        batch=cfg.fv_batch,
        physical=cfg.fv_batch,
        steps=steps,
        lr=cfg.lr,
        seed=seed,
        white_box=cfg.fv_canaries,
        delta=cfg.delta,
        noise_mechanism=_mechanism(bands, kappa, steps),
        make_canaries=functools.partial(CyclicGradientCanaries, spread=cfg.bm_groups == "spread"),
    )
    can: CyclicGradientCanaries = run["canaries"]
    can.remove()
    coefficients = can.mechanism.coefficients
    # b = 1: M = I and every canary in every step, so the score is the sum (bit for bit DP-SGD's audit)
    if bands == 1:
        scores = release_scores = can.scores("sum")
    else:
        scores = whitened_scores(can.step_values() - can.clean_values(), can.groups, coefficients)
        release_scores = can.scores("whitened")
    snj = audit_scores(scores, can.included, delta=cfg.delta, confidence=cfg.confidence)
    fdp = audit_scores(scores, can.included, delta=cfg.delta, confidence=cfg.confidence, bound="fdp")
    release = audit_scores(release_scores, can.included, delta=cfg.delta, confidence=cfg.confidence, bound="fdp")
    mu = can.claimed_mu() if kappa == 1.0 else misaccounted_mu(can, kappa)
    claimed = gaussian_dp_epsilon(mu, cfg.delta)
    return {
        "method": arm,
        "kind": "correct" if kappa == 1.0 else "broken",
        "seed": seed,
        "bands": bands,
        "steps": can.steps,
        "noise_multiplier": sigma,
        "kappa": math.sqrt(sum(c * c for c in coefficients)),
        "epsilon_accountant": claimed,
        "mu_accountant": mu,
        "epsilon_data": float(run["epsilon"]),
        **audit.bound_fields(snj, fdp, claimed),
        "epsilon_lower_fdp_release": release.epsilon_lower,
        "above_fdp_release": bool(release.epsilon_lower > claimed),
    }


def fdp_bandmf(cfg: Any) -> dict[str, Any]:
    """Every arm of ``cfg.bm_arms`` over ``cfg.fv_seeds`` seeds, on the validity experiment's data."""
    data = audit.validity_data(cfg)
    rows = []
    for arm in cfg.bm_arms:
        for seed in range(cfg.seed, cfg.seed + cfg.fv_seeds):
            rows.append(bandmf_run(cfg, data, arm, seed))
        s = audit.validity_summary(rows)[arm]
        print(
            f"{arm:>16}: ε_lower > {s['epsilon_accountant']:.3f} in {s['above_fdp']}/{s['runs']} runs (f-DP), "
            f"{s['above_snj']}/{s['runs']} (SNJ); median {s['median_epsilon_lower_fdp']:.3f}, largest "
            f"{s['max_epsilon_lower_fdp']:.3f} / {s['max_epsilon_lower_snj']:.3f}",
            flush=True,
        )
    return {"rows": rows, "summary": audit.validity_summary(rows)}


def arms_table(res: dict[str, Any]) -> str:
    """Per arm: bands, steps, σ, κ, the canaries' claim, the data's ε (the engine's ``get_epsilon``) and the f-DP
    bound of the release-only score (the whitened release, the data's gradient left in)."""
    lines = [
        "| arm | bands | steps | σ | κ | canaries' claim μ / ε | data's ε (engine) | release-only: above / median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = res["fdp_bandmf"]["rows"]
    for arm in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == arm]
        r, lower = mine[0], [x["epsilon_lower_fdp_release"] for x in mine]
        lines.append(
            f"| {arm} | {r['bands']} | {r['steps']} | {r['noise_multiplier']:.4f} | {r['kappa']:.3f} | "
            f"{r['mu_accountant']:.3f} / {r['epsilon_accountant']:.3f} | {r['epsilon_data']:.4f} | "
            f"{sum(x['above_fdp_release'] for x in mine)} / {float(np.median(lower)):.3f} |"
        )
    return "\n".join(lines) + "\n"


def tables(res: dict[str, Any]) -> str:
    return audit.validity_tables(res, key="fdp_bandmf") + "\n" + arms_table(res)


def plot(res: dict[str, Any], path: Any) -> None:
    audit.plot_validity(res, path, key="fdp_bandmf", what="BandMF runs (red: κ = 2 claimed as 1)")


#: the runner's report protocol of the experiment
REPORT = runner.Report(tables=tables, plot=plot)


def main(cfg: Any, header: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    res: dict[str, Any] = {**header, "fdp_bandmf": fdp_bandmf(cfg)}
    res["seconds"] = time.perf_counter() - t0
    runner.write(res, REPORT, cfg.bm_out, cfg.bm_plot, indent=2)
    print(f"wrote {cfg.bm_out} and {cfg.bm_plot} ({res['seconds']:.0f} s)")
    return res
