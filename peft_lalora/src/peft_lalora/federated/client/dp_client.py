"""A federated DP-SGD client for LA-LoRA adapters (LA-LoRA paper, Alg. 1, client side).

Each client owns a base model with a LALoRA adapter, an optimizer and an
:class:`opacus_spectral.PrivacyEngine` built **once** (wrapping a model twice double-hooks it, an Opacus
pitfall). A round (:meth:`DPClient.fit`):

1. loads the global adapter state (LoRA A, B and the trainable head) into the model;
2. resets the inner optimizer's state (the reference code rebuilds the optimizer every round; resetting
   keeps the single DP wrapper) and re-seeds its noise, Poisson-sampling and torch generators — by
   default from **OS entropy** (``secrets``), fresh every round; only with the explicit opt-in
   ``ClientConfig.reproducible_noise`` from ``(seed, client, round)`` (see below);
3. runs K local DP-SGD steps with Poisson sampling; the :class:`~peft_lalora.AlternationController`
   decides which factor trains on each step (federated round ``r`` — 1-based, as Flower's
   ``server_round`` — is schedule round ``r - 1``, so RoLoRA trains ``first_factor`` in round 1);
   ``post_hooks`` (e.g. ``["lowpass"]``) post-process the noisy gradient;
4. returns a cloned adapter state, the number of local examples, and the ε spent so far according to the
   client's own accountant, which lives across rounds (its history can be exported and restored).

An empty Poisson batch still takes a DP step (zero clipped sum plus noise): skipping it would release
"no update" exactly when no example was sampled, which the accountant does not cover.

Noise and replays. The DP guarantee assumes the Gaussian noise and the Poisson sample are unknown to
the adversary. The federation seed is in the server-written run configuration and the round index is
sent by the server, so noise seeded from them can be regenerated (and subtracted) by anyone who knows
the seed, and a server that replays a round would get two releases with the same noise. Hence:

* by default every round draws fresh seeds from the OS CSPRNG (``secrets.randbits``) for the noise
  generator, the Poisson sampler and the torch RNG (dropout); nothing about them is stored or sent;
* ``reproducible_noise=True`` seeds them from :func:`round_seeds` ``(seed, client, round)`` — for
  experiments only (runner equivalence, bit-exact resumption): the noise is then a function of public
  seeds and is **not private against whoever knows the seed**; a :class:`ReproducibleNoiseWarning` is
  emitted;
* a client refuses (:class:`ReplayedRoundError`) any round index ``<=`` the last one it ran; the last
  round is part of :meth:`DPClient.state_dict`, so a client rebuilt *with* that state (Flower's
  ``context.state``) refuses it as well. One rebuilt without it (state lost) starts at round 0 again and
  accepts an old round: it cannot tell that from a first sampling (``docs/federated.md``).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from opacus_spectral.errors import ReproducibleNoiseWarning  # the DP client needs the [dp] extra
from torch import nn

__all__ = [
    "ClientConfig",
    "ClientUpdate",
    "DPClient",
    "NamedInputsLoss",
    "REPRODUCIBLE_NOISE_NOTE",
    "ReplayedRoundError",
    "adapter_state",
    "load_adapter_state",
    "privacy_parameters",
    "round_seeds",
    "sequence_classification_loss",
    "trainable_parameters",
]

from ..server.ledger import check_accountant, delta_problem
from .adapter_state import adapter_state, load_adapter_state, trainable_parameters
from .losses import LossFn, NamedInputsLoss, sequence_classification_loss

#: What a result records when ``reproducible_noise`` is on.
REPRODUCIBLE_NOISE_NOTE = (
    "noise is a function of public seeds: for experiments only, not private against whoever knows the seed"
)


class ReplayedRoundError(RuntimeError):
    """A client was asked to train a round index it has already run (or an older one)."""


def _os_seed() -> int:
    """A 63-bit seed from the OS CSPRNG (never derived from, stored with or sent alongside the run)."""
    return secrets.randbits(63)


def round_seeds(seed: int, client: int, server_round: int, n: int = 3) -> list[int]:
    """``n`` independent 63-bit seeds for ``(seed, client, server_round)`` (``numpy.random.SeedSequence``)."""
    ss = np.random.SeedSequence(
        [int(seed) & 0xFFFFFFFF, int(client) & 0xFFFFFFFF, int(server_round) & 0xFFFFFFFF, 0x1A1A]
    )
    return [int(x) for x in ss.generate_state(n, dtype=np.uint64) >> np.uint64(1)]


@dataclass
class ClientConfig:
    """Hyper-parameters every client of a federation shares.

    Privacy: give ``noise_multiplier`` directly, or ``target_epsilon`` with ``planned_steps`` (the most DP
    steps the client can run, e.g. rounds × local_steps); σ is then calibrated per client from its own
    sample rate ``q = 1 / ceil(n / batch_size)``.
    """

    local_steps: int = 5
    batch_size: int = 16
    lr: float = 5e-3
    optimizer: str = "adamw"  #: "adamw" or "sgd"
    weight_decay: float = 0.0
    momentum: float = 0.0  #: SGD only
    b_lr_ratio: float = 1.0  #: B's lr / A's lr (reference code: 2)
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    planned_steps: int | None = None
    delta: float = 1e-5
    accountant: str = "rdp"
    post_hooks: list[Any] = field(default_factory=list)
    grad_sample_mode: str = "hooks"  #: "hooks" or "functorch"
    secure_mode: bool = False  #: Opacus' CSPRNG (torchcsprng) for noise/sampling instead of OS-entropy seeds
    #: seed noise / Poisson sampling / dropout from ``(seed, client, round)``: experiments only, NOT private
    #: against whoever knows the seed (see the module docstring). Default: fresh OS entropy every round.
    reproducible_noise: bool = False
    #: ``noise_multiplier=0`` (clipping only, NOT private) is refused unless this is set (then it warns)
    allow_non_private: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.batch_size < 1:
            raise ValueError("local_steps and batch_size must be >= 1")
        check_accountant(self.accountant)
        for name in ("lr", "max_grad_norm", "b_lr_ratio"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)!r}")
        if self.target_epsilon is not None and not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
            raise ValueError(f"target_epsilon must be finite and > 0, got {self.target_epsilon!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.noise_multiplier == 0 and not self.allow_non_private:  # the engine only warns, as Opacus accepts it
            raise ValueError(
                "noise_multiplier=0: this client would train with no noise, so its updates are not differentially "
                "private; set allow_non_private=True for a clipping-only reference run"
            )
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon")
        if self.target_epsilon is not None and (self.planned_steps is None or self.planned_steps < 1):
            raise ValueError("target_epsilon needs planned_steps >= 1 (e.g. rounds * local_steps)")
        sigma = self.noise_multiplier
        if sigma is not None and not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.grad_sample_mode not in ("hooks", "functorch"):
            raise ValueError(
                f"grad_sample_mode must be 'hooks' or 'functorch', got {self.grad_sample_mode!r} (ghost clipping "
                "replaces the loss with Opacus' DP criterion, which DPClient's loss_fn interface does not carry)"
            )
        if self.secure_mode and self.reproducible_noise:
            raise ValueError("secure_mode and reproducible_noise exclude each other (CSPRNG noise cannot be seeded)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["post_hooks"] = [h if isinstance(h, (str, list, tuple, dict)) else type(h).__name__ for h in self.post_hooks]
        return d


@dataclass
class ClientUpdate:
    """What a client returns after a round."""

    client: int
    round: int  #: the federated round (1-based)
    state: dict[str, torch.Tensor]
    num_examples: int
    epsilon: float
    delta: float
    history: list[tuple[float, float, int]]
    steps: int  #: DP steps run in this round
    loss: float  #: mean training loss over the round's non-empty batches (nan if all were empty)
    noise_multiplier: float
    sample_rate: float


def privacy_parameters(config: ClientConfig, num_examples: int) -> tuple[float, float]:
    """(noise multiplier, q) of a client with ``num_examples`` examples: q = 1 / ⌈n / min(B, n)⌉ (Opacus' Poisson
    rate for its loader) and the noise multiplier as given or calibrated from ``target_epsilon`` over
    ``planned_steps`` (:func:`opacus_spectral.accounting.calibration.noise_multiplier_for`). The server computes the
    same numbers to charge its privacy ledger without trusting the client's report. ``ValueError`` when
    ``config.delta >= 1/num_examples`` (:func:`~peft_lalora.federated.server.ledger.delta_problem`)."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    problem = delta_problem(config.delta, num_examples)
    if problem is not None:
        raise ValueError(problem)
    batch = min(config.batch_size, num_examples)
    q = 1.0 / math.ceil(num_examples / batch)
    if config.noise_multiplier is not None:
        return float(config.noise_multiplier), q
    from opacus_spectral.accounting.calibration import noise_multiplier_for

    noise_multiplier = noise_multiplier_for(
        target_epsilon=config.target_epsilon,
        target_delta=config.delta,
        sample_rate=q,
        steps=config.planned_steps,
        accountant=config.accountant,
    )
    return float(noise_multiplier), q


def _adapter_model(model: nn.Module, peft_config: Any) -> nn.Module:
    """``model`` if it is a PeftModel, else ``model`` with the ``peft_config`` adapter attached."""
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    if peft_config is None:
        raise ValueError("peft_config is required when model is not a PeftModel")
    return get_peft_model(model, peft_config)


def _inner_optimizer(peft_model: nn.Module, config: ClientConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over the LA-LoRA parameter groups (B at ``b_lr_ratio·lr``)."""
    from ...alternation.factors import lalora_param_groups

    groups = lalora_param_groups(peft_model, config.lr, b_lr_ratio=config.b_lr_ratio, weight_decay=config.weight_decay)
    for g in groups:
        g.pop("name", None)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def _schedule_of(peft_model: nn.Module) -> Any:
    """The :class:`~peft_lalora.AlternationSchedule` of the one active adapter (``LALoraConfig.schedule``); ``None``
    for a plain LoRA adapter or several active ones (the controller then resolves it, and refuses what it must)."""
    from ...tuners.lalora.config import LALoraConfig

    active = list(getattr(peft_model, "active_adapters", None) or [])
    config = getattr(peft_model, "peft_config", {}).get(active[0]) if len(active) == 1 else None
    return config.schedule if isinstance(config, LALoraConfig) else None


def _server_round(server_round: Any) -> int:
    """The 1-based round of :meth:`DPClient.fit`; ``ValueError`` unless it is an integer >= 1."""
    if server_round is None:
        raise TypeError("DPClient.fit() needs server_round, the 1-based federated round")
    if isinstance(server_round, bool) or int(server_round) != server_round or server_round < 1:
        raise ValueError(f"server_round is the 1-based federated round, got {server_round!r}")
    return int(server_round)


# ----------------------------------------------------------------------------------------------- client
class DPClient:
    """One DP federated client (see module docstring).

    Args:
        client_id: integer id (partition index); also seeds the client's RNGs.
        model: the base model (e.g. ``BertForSequenceClassification``), or a PeftModel with the adapter
            already attached.
        peft_config: a :class:`peft_lalora.LALoraConfig` (its ``alternation`` picks LA-LoRA / RoLoRA /
            FFA-LoRA / DP-LoRA); ``None`` when ``model`` is already a PeftModel.
        train_data: a map-style dataset of tensor tuples (e.g. ``TensorDataset``).
        config: :class:`ClientConfig`.
        seed: federation seed (seeds the noise only with ``config.reproducible_noise``).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (mean over the batch).
    """

    def __init__(
        self,
        client_id: int,
        model: nn.Module,
        peft_config: Any,
        train_data: torch.utils.data.Dataset,
        config: ClientConfig,
        *,
        seed: int = 0,
        loss_fn: LossFn = sequence_classification_loss,
    ) -> None:
        self.client_id = int(client_id)
        self.config = config
        if config.reproducible_noise:
            warnings.warn(
                f"client {client_id}: reproducible_noise=True — {REPRODUCIBLE_NOISE_NOTE}",
                ReproducibleNoiseWarning,
                stacklevel=2,
            )
        self.seed = int(seed)
        self.loss_fn = loss_fn
        self.num_examples = len(train_data)  # type: ignore[arg-type]
        if self.num_examples < 1:
            raise ValueError(f"client {client_id} has no training examples")
        device = torch.device(config.device)
        self.peft_model = _adapter_model(model, peft_config).to(device).train()
        self.params = trainable_parameters(self.peft_model)
        if not self.params:
            raise ValueError("the adapter has no trainable parameters")
        # Seeded from OS entropy here and again at every round (or from round_seeds when reproducible).
        self._sampler_gen = torch.Generator()
        self._sampler_gen.manual_seed(_os_seed())
        self._noise_gen = None if config.secure_mode else torch.Generator(device=device)
        if self._noise_gen is not None:
            self._noise_gen.manual_seed(_os_seed())
        self.noise_multiplier, self.sample_rate = privacy_parameters(config, self.num_examples)
        self._make_private(train_data)
        self.rounds_run = 0
        self.total_steps = 0
        self.last_round = 0  #: last federated round run (1-based; 0 = none yet); older/equal ones are refused

    def _make_private(self, train_data: torch.utils.data.Dataset) -> None:
        """The optimizer (:func:`_inner_optimizer`), Opacus' wrapping of model, optimizer and Poisson loader (built
        once per client), and the alternation controller on the adapter's :class:`~peft_lalora.AlternationSchedule`."""
        import opacus_spectral

        from ...alternation.controller import AlternationController

        config = self.config
        loader = torch.utils.data.DataLoader(
            train_data, batch_size=min(config.batch_size, self.num_examples), shuffle=False, generator=self._sampler_gen
        )
        self.engine = opacus_spectral.PrivacyEngine(accountant=config.accountant, secure_mode=config.secure_mode)
        self.module, self.optimizer, self.loader = self.engine.make_private(
            module=self.peft_model,
            optimizer=_inner_optimizer(self.peft_model, config),
            data_loader=loader,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=config.max_grad_norm,
            poisson_sampling=True,
            noise_generator=self._noise_gen,
            grad_sample_mode=config.grad_sample_mode,
            post_hooks=list(config.post_hooks),
            allow_non_private=config.allow_non_private,
        )
        self.controller = AlternationController(self.peft_model, self.optimizer, schedule=_schedule_of(self.peft_model))

    # -------------------------------------------------------------------------------------- privacy
    @property
    def history(self) -> list[tuple[float, float, int]]:
        """The accountant's compressed history ``[(σ, q, steps), ...]`` (what the ledger needs)."""
        return [(float(s), float(q), int(n)) for s, q, n in self.engine.accountant.history]

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the config's δ) according to this client's accountant."""
        if not self.engine.accountant.history:
            return 0.0
        eps = float(self.engine.accountant.get_epsilon(delta=self.config.delta if delta is None else delta))
        return 0.0 if eps < 0 else eps  # (0, δ)-DP: never a negative ε

    def state_dict(self) -> dict[str, Any]:
        """What must survive between rounds when the client is rebuilt (Flower): the accountant history,
        counters and the last round run (replay protection). Optimizer state is reset every round and RNGs
        are re-seeded, so nothing else is."""
        return {
            "history": self.history,
            "rounds_run": self.rounds_run,
            "total_steps": self.total_steps,
            "last_round": self.last_round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from ..server.ledger import normalize_history

        self.engine.accountant.history = list(normalize_history(state.get("history", [])))
        self.rounds_run = int(state.get("rounds_run", 0))
        self.total_steps = int(state.get("total_steps", 0))
        self.last_round = int(state.get("last_round", 0))

    # -------------------------------------------------------------------------------------- training
    def _reseed(self, server_round: int) -> int:
        """Seed the sampler and noise generators for a round; return the seed for torch's global RNG.
        Fresh OS entropy by default, ``round_seeds(seed, client, round)`` only with ``reproducible_noise``."""
        if self.config.reproducible_noise:
            s_sampler, s_noise, s_torch = round_seeds(self.seed, self.client_id, server_round)
        else:
            s_sampler, s_noise, s_torch = _os_seed(), _os_seed(), _os_seed()
        self._sampler_gen.manual_seed(s_sampler)
        if self._noise_gen is not None:
            self._noise_gen.manual_seed(s_noise)
        return s_torch

    def _empty_step(self) -> None:
        """A DP step on an empty Poisson batch: zero per-sample gradients, so the update is pure noise."""
        for p in self.optimizer.params:
            p.grad_sample = p.new_zeros((0, *p.shape))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _check_round(self, server_round: int) -> int:
        """``server_round`` if it is a new round for this client; :class:`ReplayedRoundError` otherwise."""
        if server_round <= self.last_round:
            raise ReplayedRoundError(
                f"client {self.client_id}: round {server_round} requested but round {self.last_round} was already "
                "run; refusing to train a round index twice (a replayed round would release a second update "
                "of the same round)"
            )
        return server_round

    def _local_steps(self, k_steps: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """``k_steps`` DP steps on Poisson batches (an empty batch is a pure-noise step); the summed loss of the
        non-empty batches and their number."""
        loss_sum = torch.zeros((), device=device)
        n_loss = 0
        it = iter(self.loader)
        for _ in range(k_steps):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(self.loader)
                batch = next(it)
            batch = [t.to(device) for t in batch]
            if batch[0].shape[0] == 0:
                self._empty_step()
                continue
            loss = self.loss_fn(self.module, batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = loss_sum + loss.detach()
            n_loss += 1
        return loss_sum, n_loss

    def fit(
        self,
        global_state: Mapping[str, torch.Tensor],
        server_round: int | None = None,
        local_steps: int | None = None,
    ) -> ClientUpdate:
        """Run one round of ``local_steps`` (default ``config.local_steps``) DP steps from ``global_state``.

        Args:
            global_state: the global adapter to start from.
            server_round: the federated round, **1-based** (Flower's ``server_round``; the alternation schedule's
                round is ``server_round - 1``). Must exceed every round this client has run before
                (:class:`ReplayedRoundError` otherwise, before anything is trained).
            local_steps: overrides ``config.local_steps``.
        """
        k_steps = self.config.local_steps if local_steps is None else int(local_steps)
        if k_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {k_steps}")
        server_round = self._check_round(_server_round(server_round))
        load_adapter_state(self.params, global_state)
        self.last_round = server_round  # consumed even if training fails below: never retried
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.original_optimizer.state.clear()
        pipeline = getattr(self.engine.post_hooks, "pipeline", None)
        if pipeline is not None:
            pipeline.reset()
        torch_seed = None if self.config.secure_mode else self._reseed(server_round)
        device = torch.device(self.config.device)
        fork_devices = [device] if device.type == "cuda" else []
        self.module.train()
        with torch.random.fork_rng(devices=fork_devices, enabled=torch_seed is not None):
            if torch_seed is not None:
                torch.manual_seed(torch_seed)
            self.controller.start_round(server_round=server_round)
            loss_sum, n_loss = self._local_steps(k_steps, device)
        self.rounds_run += 1
        self.total_steps += k_steps
        mean_loss = float(loss_sum) / n_loss if n_loss else math.nan
        return ClientUpdate(
            client=self.client_id,
            round=server_round,
            state=adapter_state(self.params),
            num_examples=self.num_examples,
            epsilon=self.epsilon(),
            delta=self.config.delta,
            history=self.history,
            steps=k_steps,
            loss=mean_loss,
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
        )
