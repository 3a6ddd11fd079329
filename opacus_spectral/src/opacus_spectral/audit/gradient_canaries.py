"""White-box gradient canaries: Dirac canaries injected into the clipped sum of an Opacus ``DPOptimizer``.

Canary i is a fixed gradient ``C·e_{c_i}`` — the clipping bound C times the unit vector of one coordinate
``c_i`` of a trainable parameter (a *Dirac canary*; distinct coordinates, chosen at random). It is a worst-case
example of DP-SGD: its clipped gradient has the largest norm the mechanism allows, whatever the model. Each
canary is included with probability ½ (its secret coin); an included canary takes part in a logical step with
probability ``sample_rate`` (1.0: every step) and is then added to ``p.summed_grad`` *before* Opacus draws the
noise — the exact DP-SGD mechanism, one privacy unit per canary (``docs/math.md`` §5.4).

The auditor reads what the step *released*: ``p.grad`` as the inner optimizer receives it (after the noise, the
scaling and every denoiser of ``post_hooks``), at the canary's coordinate, in units of one canary's signal
(``C/(B·k)`` for mean reduction). Scores (``docs/math.md`` §5.5): the sum over steps (the likelihood-ratio
test for ``sample_rate = 1``), or the per-step likelihood ratio of a subsampled canary.

Attach after ``make_private``; they subscribe to the optimizer's :mod:`~opacus_spectral.step.attachment` (injection at
``BEFORE_NOISE``, reading at ``BEFORE_INNER_STEP`` after the denoiser pipeline, whatever the order of attaching)::

    canaries = GradientCanaries(optimizer, 5000, module=model, seed=0)
    ...train...
    canaries.audit(delta=1e-5).epsilon_lower  <  canaries.claimed_epsilon(1e-5)

On a BandMF run (``noise_mechanism=("bandmf", {"bands": b})``, b > 1) the canaries are cyclic (:mod:`.cyclic`):
canary i is in group 0 (``groups="first"``) or i mod b (``"spread"``) and, when included, takes part at the steps
t ≡ its group (mod b) counted from attaching; the claim is the mechanism's own accounting and the default score
whitens the correlated noise. (Canaries in every step would not be covered by BandMF's claim.)

Supported: ``DPOptimizer`` with flat clipping (hooks, functorch, ghost), any ``loss_reduction``, accumulation
(BatchMemoryManager), the ``gaussian`` and ``bandmf`` noise mechanisms. Refused: per-layer or adaptive clipping (the
canary's norm would not be the bound the accountant assumes) and distributed optimizers (each rank would inject its
own copy).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer
from torch import nn

from ..mechanisms.install import mechanism_of
from ..step.attachment import BEFORE_INNER_STEP, BEFORE_NOISE, CANARIES, InnerStep, attachment
from ..step.installation import HANDLE_ATTR
from ..step.noise_std import clean_scale, world_size
from ..step.parameters import describe_parameters
from ..step.selection import ParamFilter, resolve_param_filter
from .claims import canary_epsilon, gaussian_dp_epsilon
from .cyclic import cyclic_claimed_mu, whitened_scores
from .guesses import AuditResult, audit_scores

__all__ = ["GradientCanaries"]


class GradientCanaries:
    """Dirac gradient canaries on ``dp_optimizer`` (module docstring).

    Args:
        dp_optimizer: the Opacus optimizer returned by ``make_private`` (flat clipping, one process).
        num_canaries: m, the number of canaries (distinct coordinates; at most the number of entries).
        module: the model, to name parameters for ``params=``.
        params: optional name filter for the parameters that hold canaries (needs ``module``).
        sample_rate: probability that an included canary takes part in a step (1.0: every step).
        seed: seeds the coordinates, the coins and the per-step sampling (independent of Opacus' noise).
        keep_steps: also keep every step's released value per canary (needed by ``score="likelihood_ratio"``
            and ``"whitened"``; default: when ``sample_rate < 1`` or on BandMF). Memory: m floats per step.
        groups: on BandMF, ``"first"`` (every canary in group 0) or ``"spread"`` (canary i in group i mod b).
    """

    def __init__(
        self,
        dp_optimizer: DPOptimizer,
        num_canaries: int,
        *,
        module: nn.Module | None = None,
        params: ParamFilter = None,
        sample_rate: float = 1.0,
        seed: int = 0,
        keep_steps: bool | None = None,
        groups: str = "first",
    ) -> None:
        _check_optimizer(dp_optimizer)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        self.mechanism, self.bands = _cyclic_setup(dp_optimizer, sample_rate, groups)
        if params is not None and module is None:
            raise ValueError("params= selects parameters by name: pass module= too")
        self.optimizer = dp_optimizer
        self.sample_rate = float(sample_rate)
        self.keep_steps = (self.sample_rate < 1.0 or self.bands > 1) if keep_steps is None else bool(keep_steps)
        if self.bands > 1 and not self.keep_steps:
            raise ValueError("canaries on a BandMF run need their per-step values (keep_steps=True)")
        select = resolve_param_filter(params)
        infos = describe_parameters(dp_optimizer.params, module, None)
        #: the parameters that hold canaries (in the optimizer's order), and their names
        self.parameters = [p for p in dp_optimizer.params if select(infos[id(p)].name)]
        self.param_names = [infos[id(p)].name for p in self.parameters]
        sizes = np.array([p.numel() for p in self.parameters], dtype=np.int64)
        total = int(sizes.sum())
        if not 1 <= num_canaries <= total:
            raise ValueError(
                f"num_canaries must be in [1, {total}] (the selected parameters' entries), got {num_canaries}"
            )
        self.num_canaries = int(num_canaries)
        rng = np.random.default_rng(seed)
        coords = rng.choice(total, size=self.num_canaries, replace=False)
        #: the secret coins: canary i is in the training run iff ``included[i]``
        self.included = torch.from_numpy(rng.random(self.num_canaries) < 0.5)
        #: each canary's group: it takes part at the steps t ≡ group (mod bands) only (all 0 when bands = 1)
        self.groups = torch.zeros(self.num_canaries, dtype=torch.long)
        if groups == "spread":
            self.groups = torch.arange(self.num_canaries) % self.bands
        self._injected = 0
        starts = np.concatenate([[0], np.cumsum(sizes)])
        owner = np.searchsorted(starts, coords, side="right") - 1
        #: per parameter: (its index among the selected, flat coordinates, positions among the canaries)
        self._slots: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for j in np.unique(owner):
            pos = np.flatnonzero(owner == j)
            dev = self.parameters[j].device
            self._slots.append((int(j), torch.from_numpy(coords[pos] - starts[j]).to(dev), torch.from_numpy(pos)))
        #: (parameter name, flat index) of every canary
        self.coordinates = [(self.param_names[int(o)], int(c - starts[o])) for o, c in zip(owner, coords, strict=True)]
        self._gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
        self._sums = torch.zeros(self.num_canaries, dtype=torch.float64)
        self._steps: list[torch.Tensor] = []
        self.noise_multipliers: list[float] = []  #: σ the optimizer reported at each observed step
        self._pending = False
        self._handle_at_attach = getattr(dp_optimizer.original_optimizer, HANDLE_ATTR, None)
        att = attachment(dp_optimizer)  # order CANARIES: the released gradient is read after the pipeline
        self._subscriptions = [
            att.subscribe(BEFORE_NOISE, self._add_noise, order=CANARIES),
            att.subscribe(BEFORE_INNER_STEP, self._read_released, order=CANARIES),
        ]
        self._removed = False

    # -- the mechanism ------------------------------------------------------------------------------
    def _add_noise(self, opt: DPOptimizer) -> None:
        """Before Opacus' noise: add ``C·e_c`` of every included canary sampled this step to ``p.summed_grad``."""
        present = self.included.clone()
        if self.bands > 1:
            present &= self.groups == self._injected % self.bands
        self._injected += 1
        if self.sample_rate < 1.0:
            present &= torch.rand(self.num_canaries, generator=self._gen) < self.sample_rate
        weight = present.to(torch.float64) * float(opt.max_grad_norm)
        for j, idx, pos in self._slots:
            p = self.parameters[j]
            summed = getattr(p, "summed_grad", None)
            if summed is None:  # frozen this step: its canaries are not in the sum
                continue
            if not summed.is_contiguous():
                p.summed_grad = summed = summed.contiguous()
            summed.view(-1).index_add_(0, idx, weight[pos].to(device=summed.device, dtype=summed.dtype))
        self._pending = True

    def _read_released(self, step: InnerStep) -> None:
        """Before the inner step, after the denoisers: the released value at every canary's coordinate."""
        pending, self._pending = self._pending, False
        if not (pending and step.noised):
            return  # no noise was added (a direct inner step): nothing was released by DP-SGD
        if getattr(step.optimizer.original_optimizer, HANDLE_ATTR, None) is not self._handle_at_attach:
            raise RuntimeError(
                "the denoiser pipeline on this optimizer changed after the gradient canaries were attached, so "
                "their scores would mix the gradients two mechanisms released; attach GradientCanaries after "
                "make_private"
            )
        unit = float(self.optimizer.max_grad_norm) * clean_scale(self.optimizer)  # one canary's signal in p.grad
        values = self.gather([p.grad for p in self.parameters]) / unit
        self._sums += values
        if self.keep_steps:
            self._steps.append(values.to(torch.float32))
        self.noise_multipliers.append(float(self.optimizer.noise_multiplier))

    def gather(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """(m,) float64 on the CPU: each canary's entry of ``tensors`` — one tensor per entry of :attr:`parameters`,
        shaped like it (``None``: its canaries read 0)."""
        if len(tensors) != len(self.parameters):
            raise ValueError(
                f"gather needs one tensor per canary parameter ({len(self.parameters)}), got {len(tensors)}"
            )
        for t, p in zip(tensors, self.parameters, strict=True):
            if t is not None and t.shape != p.shape:
                raise ValueError(
                    f"gather: a tensor of shape {tuple(t.shape)} for a parameter of shape {tuple(p.shape)}"
                )
        values = torch.zeros(self.num_canaries, dtype=torch.float64)
        for j, idx, pos in self._slots:
            if tensors[j] is not None:
                values[pos] = tensors[j].detach().reshape(-1).index_select(0, idx).to("cpu", torch.float64)
        return values

    def remove(self) -> None:
        """Stop injecting and reading (the optimizer's ``add_noise`` is restored)."""
        if self._removed:
            return
        self._removed = True
        for subscription in self._subscriptions:
            subscription.remove()

    # -- the auditor --------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Logical steps whose released gradient was read."""
        return len(self.noise_multipliers)

    def step_values(self) -> torch.Tensor:
        """(T, m): every observed step's released value at each canary's coordinate, in units of its signal (needs
        ``keep_steps``)."""
        if not self.keep_steps:
            raise ValueError("the per-step values need GradientCanaries(..., keep_steps=True)")
        if not self._steps:
            return torch.zeros(0, self.num_canaries, dtype=torch.float64)
        return torch.stack(self._steps).to(torch.float64)

    def scores(self, score: str | None = None) -> torch.Tensor:
        """Per-canary scores, higher = more likely included (``docs/math.md`` §5.5). Default: ``"whitened"`` on
        BandMF, ``"sum"`` otherwise.

        ``"sum"``: Σ_t z_t, z_t the released value at the canary's coordinate in units of its signal.
        ``"whitened"``: on BandMF, ⟨M x_g, M z⟩ − ½‖M x_g‖² (:func:`~.cyclic.whitened_scores`), the log-likelihood
        ratio under the claimed M (κ = 1) with the data's gradient taken as noise.
        ``"likelihood_ratio"``: Σ_t log(1 − p + p·exp((z_t − ½)/σ_t²)) with p = ``sample_rate`` and σ_t the
        reported noise multiplier — the log-likelihood ratio of "included" for the undenoised mechanism
        (needs ``keep_steps``). Either is a valid score for the bound; they differ in power.
        """
        score = score or ("whitened" if self.bands > 1 else "sum")
        if score == "sum":
            return self._sums.clone()
        if score == "whitened":
            if self.bands == 1:
                raise ValueError("score='whitened' is for BandMF runs (b > 1); DP-SGD's noise is white: use 'sum'")
            self._check_phase()
            return whitened_scores(self.step_values(), self.groups, self.mechanism.coefficients)
        if score != "likelihood_ratio":
            raise ValueError(f"score must be 'sum', 'whitened' or 'likelihood_ratio', got {score!r}")
        if not self.keep_steps:
            raise ValueError(
                "score='likelihood_ratio' needs the per-step values: GradientCanaries(..., keep_steps=True)"
            )
        if not self._steps:
            return torch.zeros(self.num_canaries, dtype=torch.float64)
        z = torch.stack(self._steps).to(torch.float64)  # (T, m)
        inv_var = torch.tensor([s**-2 if s > 0 else math.inf for s in self.noise_multipliers], dtype=torch.float64)
        log_lr = (z - 0.5) * inv_var[:, None]
        p = self.sample_rate
        if p == 1.0:
            return log_lr.sum(0)
        # log(1 − p + p·e^x) = logaddexp(log(1 − p), log p + x)
        return torch.logaddexp(torch.full_like(log_lr, math.log1p(-p)), log_lr + math.log(p)).sum(0)

    def audit(
        self,
        *,
        delta: float = 0.0,
        confidence: float = 0.95,
        guesses: list[tuple[int, int]] | None = None,
        score: str | None = None,
        bound: str = "snj",
    ) -> AuditResult:
        """The one-run lower bound on ε from this run (:func:`~opacus_spectral.audit.audit_scores`).

        ``bound="fdp"`` tests the μ-GDP claim of :meth:`claimed_mu` (tighter for Gaussian noise, ``docs/audit.md``)
        and needs ``sample_rate = 1`` and ``delta > 0``; ``"snj"`` (default) tests the (ε, δ) claim.
        """
        if self.steps == 0:
            raise RuntimeError("no DP step was observed since the canaries were attached")
        if bound == "fdp" and self.sample_rate < 1.0:
            raise ValueError(
                "bound='fdp' tests a μ-GDP claim, which only canaries present in every step have (sample_rate=1); "
                f"these are subsampled at rate {self.sample_rate:g}: use bound='snj'"
            )
        return audit_scores(
            self.scores(score), self.included, delta=delta, confidence=confidence, guesses=guesses, bound=bound
        )

    def claimed_mu(self) -> float:
        """μ of the μ-GDP claim for one canary present in every observed step: ``sqrt(Σ_t σ_t⁻²)`` with the σ_t
        the optimizer reported (``docs/math.md`` §5.4); ``inf`` after a step without noise. On BandMF: in every step
        of its group, the mechanism's accounting at rate 1 (:func:`~.cyclic.cyclic_claimed_mu`)."""
        if self.sample_rate < 1.0:
            raise ValueError(
                f"canaries subsampled at rate {self.sample_rate:g} are not μ-GDP for any simple μ: their claim is "
                "claimed_epsilon(delta) (Opacus' accountant)"
            )
        if self.bands > 1:
            self._check_phase()
            return cyclic_claimed_mu(self.mechanism, self.noise_multipliers)
        if any(s <= 0 for s in self._charged()):
            return math.inf
        return math.sqrt(sum(s**-2 for s in self._charged()))

    def _charged(self) -> list[float]:
        """The σ the accountant was charged at each observed step: the optimizer's, or a one-band mechanism's σ′
        (BandMF with coefficients (c_0,): σ/c_0)."""
        if self.mechanism is None:
            return list(self.noise_multipliers)
        return [self.mechanism.accounting(s, self.sample_rate).noise_multiplier for s in self.noise_multipliers]

    def _check_phase(self) -> None:
        """Every injection was read: the group of step t (t ≡ g mod b) is the same for the injections and the scores."""
        if self._injected != self.steps:
            raise RuntimeError(
                f"{self._injected} injections but {self.steps} released steps read: a step was injected and not "
                "released (removed mid-step?), so the canaries' groups and steps no longer line up"
            )

    def claimed_epsilon(self, delta: float, *, accountant: str = "prv") -> float:
        """The ε a correct engine claims for one canary over the observed steps (``docs/math.md`` §5.4):
        exact μ-GDP for ``sample_rate = 1``, Opacus' ``accountant`` at the canary's rate otherwise."""
        if self.bands > 1:
            return gaussian_dp_epsilon(self.claimed_mu(), delta)
        return canary_epsilon(self._charged(), self.sample_rate, delta, accountant=accountant)


def _cyclic_setup(opt: DPOptimizer, sample_rate: float, groups: str) -> tuple[Any, int]:
    """The run's noise mechanism and b (1 unless BandMF); refuses what the canaries' claim would not cover."""
    if groups not in ("first", "spread"):
        raise ValueError(f"groups must be 'first' or 'spread', got {groups!r}")
    mechanism = mechanism_of(opt)
    bands = 1 if mechanism is None else int(mechanism.bands)  # every mechanism is a realized banded Toeplitz
    if bands > 1 and sample_rate < 1.0:
        raise ValueError(
            "on a BandMF run the canaries take part in every step of their group (sample_rate=1): a subsampled "
            "canary's claim is not μ-GDP and its sensitivity under correlated noise is not what the claim assumes"
        )
    return mechanism, bands


def _check_optimizer(opt: Any) -> None:
    if not isinstance(opt, DPOptimizer):
        raise TypeError(f"GradientCanaries needs an Opacus DPOptimizer (from make_private), got {type(opt).__name__}")
    if isinstance(opt, (DPPerLayerOptimizer, AdaClipDPOptimizer)) or not isinstance(opt.max_grad_norm, (int, float)):
        raise NotImplementedError(
            "gradient canaries need flat clipping with a fixed bound (clipping='flat'): per-layer and adaptive "
            "clipping change the norm a canary may have"
        )
    if world_size(opt) > 1 or "Distributed" in type(opt).__name__:
        raise NotImplementedError("gradient canaries are not supported under DDP (every rank would inject them)")
