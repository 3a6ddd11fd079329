"""Putting a realized strategy (:mod:`.realization`) on what ``make_private`` builds (``docs/mechanisms.md``): its
loader (cyclic Poisson sampling), its noise (the optimizer's ``add_noise``, from the engine's own draw), its accountant
hook (the :class:`~.strategy.Accounting` the engine computes from the strategy, charged per DP step) and the noise std
denoisers are calibrated with. The default ``"gaussian"`` installs nothing: training is bit-identical to Opacus'.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from opacus.optimizers import (
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
)
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch.utils.data import DataLoader

from ..accounting.bounds import charge_log
from .base import NoiseMechanism, check_contract
from .cyclic import CyclicPoissonSampler, partition, partition_digest
from .realization import Realization, realize

__all__ = [
    "MECHANISM_ATTR",
    "MechanismSpec",
    "accountant_hook",
    "check_in_step",
    "cyclic_loader",
    "install_noise",
    "mechanism_of",
    "std_factor",
]

MECHANISM_ATTR = "_opacus_spectral_mechanism"
#: what ``make_private(noise_mechanism=...)`` takes: a registered name, ``(name, {kwargs})`` or a mechanism object
MechanismSpec = str | tuple[str, Mapping[str, Any]] | NoiseMechanism


class CyclicLoader(DataLoader):
    """The DP loader of a cyclic-Poisson mechanism: Opacus' collate (empty batches allowed), the cyclic sampler, and
    ``sample_rate`` = B/N like Opacus' ``DPDataLoader``. Iterating it ties every batch it yields to the sampler draw
    it came from (in the training process, whatever ``num_workers``: worker processes fetch in the order the sampler
    dispatched and the loader yields in that order), so that :func:`check_in_step` sees which draw each DP step
    trains."""

    sample_rate: float
    #: batches a training loop may draw ahead of the step it trains (accelerate's loaders fetch 1 ahead)
    lookahead: int = 0
    #: the sampler draw of the batch this loader yielded last, and whether one was yielded since the last DP step
    last_draw: int | None = None
    fresh: bool = False

    def __iter__(self) -> Any:
        sampler = self.batch_sampler
        if not isinstance(sampler, CyclicPoissonSampler):
            yield from super().__iter__()
            return
        draws: deque[int] = deque()
        sampler.next_draws = draws  # the iterator created now records its draws there, in dispatch order
        for batch in super().__iter__():
            self.last_draw, self.fresh = (draws.popleft() if draws else None), True
            yield batch


def cyclic_loader(
    dp_loader: Any, mechanism: Realization, *, partition_seed: int, shard: tuple[int, int] = (0, 1)
) -> CyclicLoader:
    """The loader of ``dp_loader``'s dataset that samples group t mod b at step t (rate b·B/N within the group;
    under DDP, ``shard`` = (rank, world size): this rank's share of the group)."""
    q = 1 / len(dp_loader)
    sampler = CyclicPoissonSampler(
        num_samples=len(dp_loader.dataset),
        groups=mechanism.sample_rate_factor,
        sample_rate=mechanism.sample_rate_factor * q,
        steps_per_epoch=len(dp_loader),
        partition_seed=partition_seed,
        generator=dp_loader.batch_sampler.generator,
        shard=shard,
    )
    loader = CyclicLoader(
        dp_loader.dataset,
        batch_sampler=sampler,
        collate_fn=dp_loader.collate_fn,
        num_workers=dp_loader.num_workers,
        pin_memory=dp_loader.pin_memory,
        timeout=dp_loader.timeout,
        worker_init_fn=dp_loader.worker_init_fn,
        multiprocessing_context=dp_loader.multiprocessing_context,
        generator=dp_loader.generator,
        prefetch_factor=dp_loader.prefetch_factor,
        persistent_workers=dp_loader.persistent_workers,
    )
    loader.sample_rate = q
    return loader


def accountant_hook(
    accountant: Any, mechanism: Realization, count: Callable[[int], None], loader: Any = None
) -> Callable:
    """The accountant's step hook under ``mechanism``: at DP step t, what its :class:`~.strategy.Accounting` charges
    (DP-SGD's (σ′, q′) at every ``every``-th step), reported to the engine's count and to the doctor. With ``loader``
    (a cyclic loader), each step must train on the group batch the loader drew last (:func:`check_in_step`)."""
    state = {"step": 0}

    def hook(optim: DPOptimizer) -> None:
        if int(optim.accumulated_iterations) != 1:
            raise ValueError(
                f"noise_mechanism={mechanism.name!r} samples one group per step: gradient accumulation over "
                f"{optim.accumulated_iterations} loader batches per step would mix groups (use BatchMemoryManager "
                "for smaller physical batches instead)"
            )
        check_in_step(loader, state["step"], state)
        sigma, q = float(optim.noise_multiplier), 1 / _loader_len(optim)
        acc = mechanism.accounting(sigma, q)  # computed from the strategy (.strategy), never declared
        state["sigma"], state["clip"] = sigma, float(optim.max_grad_norm)  # the DP state's facts (checkpoints)
        if acc.every > 1:
            _check_constant(state, acc.noise_multiplier, float(optim.max_grad_norm), mechanism.name)
        charged = acc.charge(state["step"])
        state["step"] += 1
        if charged:
            accountant.step(noise_multiplier=acc.noise_multiplier, sample_rate=acc.sample_rate)
        count(charged)
        charge_log(accountant).record(charged)

    hook.state = state  # type: ignore[attr-defined]  # the step, restored by load_checkpoint
    return hook


def _check_constant(state: dict[str, Any], sigma: float, clip: float, name: str) -> None:
    """A mechanism charged every k > 1 steps is accounted with one σ and one clipping bound C for the k steps of each
    charge: a σ or C that changes during the run (a noise or clipping scheduler, an edit) would leave steps uncharged
    at their own (the band mixes noise scaled for one C with signal clipped to another). (A resume with another σ is
    refused by ``load_checkpoint``, against the accountant's history.)"""
    first = state.setdefault("noise_multiplier", sigma), state.setdefault("max_grad_norm", clip)
    if (sigma, clip) != first:
        raise ValueError(
            f"noise_mechanism={name!r} is accounted with one noise multiplier and one clipping bound for the whole "
            f"run ({first[0]}, {first[1]}), but step {state['step'] + 1} uses ({sigma}, {clip}): a changing σ or C "
            "(a noise or clipping scheduler, say) is not covered by its accounting"
        )


def ghost_workers_error(name: str) -> ValueError:
    """Ghost clipping reports one accumulated iteration whatever the loop did, and with a cyclic loader's batches
    fetched by worker processes :func:`check_in_step` cannot count them: two batches trained as one step would go
    unseen (refused in ``make_private``, :meth:`MechanismRun.check_setup`)."""
    return ValueError(
        f"noise_mechanism={name!r} with grad_sample_mode='ghost' needs the loader's num_workers=0: ghost clipping "
        "cannot tell one loader batch per step from several, and with worker processes the engine cannot count "
        "the batches drawn (use num_workers=0, grad_sample_mode='hooks', or DPTrainer)"
    )


def check_in_step(loader: Any, step: int, state: dict[str, Any] | None = None) -> None:
    """DP step ``step`` (0-based) must train on the draw right after the previous step's: a drawn batch skipped (say,
    an empty one) would put one group at two steps less than b apart, outside the accounting (each record at most
    once in every b consecutive steps). When the step's batch came from iterating the loader ``make_private`` returned
    (any ``num_workers``), its draw is known (:class:`CyclicLoader`): consecutive steps must train consecutive draws
    (a batch peeked before training only shifts the cycle, which the accounting allows). Otherwise (a loop that builds
    its own loader over the sampler) the draws are counted: at most ``lookahead`` ahead of the step (a loader of
    one's own with workers, which draws further ahead, is refused: a skipped batch would hide in its prefetch)."""
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, CyclicPoissonSampler) or sampler.groups == 1:
        return
    if state is not None and getattr(loader, "fresh", False) and loader.last_draw is not None:
        loader.fresh = False
        previous, state["draw"] = state.get("draw"), loader.last_draw
        if previous is not None and loader.last_draw != previous + 1:
            raise RuntimeError(
                f"cyclic Poisson sampling: DP step {step + 1} trains a batch that is not the one drawn after the "
                "previous step's: a batch the loader yielded was not stepped on (an empty one skipped, say), which "
                "puts a group at two steps less than b apart — not covered by the BandMF accounting. Step the "
                "optimizer once per batch, in order, empty batches included."
            )
        return
    if not 0 <= sampler.step - (step + 1) <= getattr(loader, "lookahead", 0):
        raise RuntimeError(
            f"cyclic Poisson sampling: DP step {step + 1} is not trained on batch {step + 1} of the loader "
            f"make_private returned ({sampler.step} drawn): every batch it yields must be stepped on, an empty one "
            "included (skipping one puts a group at two steps less than b apart, which the BandMF accounting does "
            "not cover). Step the optimizer once per batch, in order. A batch that does not come from iterating "
            "that loader (say, its sampler re-wrapped in a DataLoader of your own) is tied to its draw by counting "
            "the draws, which a loader with workers defeats by drawing ahead: iterate the loader make_private "
            "returned — it keeps the num_workers of the DataLoader you passed, and ties every batch to its draw."
        )


def _loader_len(optim: DPOptimizer) -> float:
    """1/q: Opacus sets ``expected_batch_size = N·q``; the mechanism keeps q on the optimizer (``install_noise``)."""
    return getattr(optim, MECHANISM_ATTR + "_steps_per_epoch")


#: the optimizers whose ``add_noise`` the mechanism replaces (flat or per-layer clipping, hooks or ghost, DDP): their
#: own adds i.i.d. N(0, (σC)²) to each summed gradient, on rank 0 alone under DDP, and nothing else
DISTRIBUTED = (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping)
REPLACEABLE = (DPOptimizer, DPOptimizerFastGradientClipping, *DISTRIBUTED)


def check_replaceable(cls: type, name: str) -> None:
    """Refuse an optimizer whose ``add_noise`` does more than Opacus' i.i.d. draw: AdaClip's noises the count of
    unclipped records that moves C (dropped, C would follow the exact count, and change within a band); FSDP's and
    ``DistributedPerLayerOptimizer``'s shard or split the noise their own way."""
    if not any(cls.add_noise is ok.add_noise for ok in REPLACEABLE):
        raise ValueError(
            f"noise_mechanism={name!r} replaces the optimizer's add_noise, but {cls.__name__} adds noise "
            "its own way (adaptive clipping noises the unclipped count; FSDP and DistributedPerLayerOptimizer shard "
            "it): use flat or per_layer clipping with grad_sample_mode 'hooks' or 'ghost', or the gaussian mechanism"
        )


def install_noise(optimizer: DPOptimizer, mechanism: Realization, steps_per_epoch: int) -> None:
    """Replace the optimizer's ``add_noise`` by Opacus' own, with each tensor's i.i.d. draw passed through the
    mechanism; the stream advances for every parameter the optimizer holds, frozen ones included (their draw is
    discarded). Under DDP (hooks or ghost) only rank 0 adds noise, as Opacus' distributed optimizers do."""
    check_replaceable(type(optimizer), mechanism.name)
    setattr(optimizer, MECHANISM_ATTR, mechanism)
    setattr(optimizer, MECHANISM_ATTR + "_steps_per_epoch", steps_per_epoch)
    distributed = isinstance(optimizer, DISTRIBUTED)

    def add_noise() -> None:
        if distributed and optimizer.rank != 0:  # rank 0 adds the noise; every rank keeps the same step and std
            for p in optimizer.params:
                p.grad = p.summed_grad.view_as(p)
            optimizer._opacus_spectral_std_factor = mechanism.std_factor()
            mechanism.end_step()
            return
        std = optimizer.noise_multiplier * optimizer.max_grad_norm
        trainable = {id(p) for p in optimizer.params}
        for i, p in enumerate(q for g in optimizer.original_optimizer.param_groups for q in g["params"]):
            if id(p) not in trainable:
                if mechanism.correlated:  # keep a frozen factor's stream in step (its draw is not released)
                    mechanism.noise(i, _generate_noise(std=std, reference=p, generator=optimizer.generator))
                continue
            _check_processed_flag(p.summed_grad)
            z = _generate_noise(
                std=std, reference=p.summed_grad, generator=optimizer.generator, secure_mode=optimizer.secure_mode
            )
            p.grad = (p.summed_grad + mechanism.noise(i, z)).view_as(p)
            _mark_as_processed(p.summed_grad)
        optimizer._opacus_spectral_std_factor = mechanism.std_factor()
        mechanism.end_step()

    optimizer.add_noise = add_noise  # an instance attribute: Opacus calls self.add_noise()


def mechanism_of(optimizer: Any) -> Realization | None:
    """The realization of the run's strategy on ``optimizer`` (``None``: Opacus' own noise)."""
    return getattr(optimizer, MECHANISM_ATTR, None)


def std_factor(optimizer: Any) -> float:
    """The released noise's per-entry std at the last step, in units of σC (1 for i.i.d. Gaussian noise)."""
    return float(getattr(optimizer, "_opacus_spectral_std_factor", 1.0))


def steps_of(steps: int | None, epochs: float | None, steps_per_epoch: int) -> int | None:
    """The run's length in DP steps: ``steps``, or ``epochs`` × the loader's steps per epoch."""
    if steps is not None and epochs is not None:
        raise ValueError("give steps= or epochs=, not both")
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        return steps
    if epochs is not None:
        if not (isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0):
            raise ValueError(f"epochs must be a positive number, got {epochs!r}")
        return max(1, int(round(epochs * steps_per_epoch)))
    return None


def agreed_seed(seed: int) -> int:
    """Rank 0's partition seed on every rank (one partition for the whole group of processes)."""
    box = [int(seed)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


#: the key of :meth:`MechanismRun.state_dict` in an engine checkpoint
CHECKPOINT_KEY = "opacus_spectral_noise_mechanism"


class MechanismRun:
    """One ``make_private``'s noise mechanism other than the default: the loader, the accountant hook and the noise it
    installs, and what a checkpoint keeps of it (never the noise buffers)."""

    def __init__(self, mechanism: NoiseMechanism, *, steps: int | None, epochs: float | None, partition_seed: int):
        self.mechanism = mechanism
        self.realization: Realization | None = None  #: the strategy realized for this run (check_setup / build_loader)
        self._length = (steps, epochs)
        self.partition_seed = int(partition_seed)
        self.loader: Any = None
        self.hook: Any = None
        self.certificate: Any = None  #: the engine's noise certificate of this run (reset with the stream)

    @classmethod
    def create(
        cls, registry: Any, spec: Any, *, steps: Any, epochs: Any, seed: Callable[[], int], **setting: Any
    ) -> Any:
        """``None`` for the default (``spec`` None or ``"gaussian"``: Opacus' own noise, untouched); else a run,
        after the refusals of ``docs/mechanisms.md`` ("What is refused")."""
        if spec is None or spec == "gaussian":
            if steps is not None or epochs is not None:
                raise ValueError("steps= / epochs= size a noise mechanism's run: they need noise_mechanism='bandmf'")
            return None
        mechanism = check_contract(registry.create_mechanism(spec))
        if not setting.get("poisson_sampling", True):
            raise ValueError(
                f"noise_mechanism={mechanism.name!r} is accounted for the (cyclic) Poisson sampling the engine builds "
                "only: leave poisson_sampling=True"
            )
        if setting.get("accountant") == "gdp":
            raise ValueError(f"noise_mechanism={mechanism.name!r} needs an upper-bound accountant: 'prv' or 'rdp'")
        return cls(mechanism, steps=steps, epochs=epochs, partition_seed=seed())

    @property
    def steps(self) -> int | None:
        """The run's length the strategy was realized for (``None``: not given, or not realized yet)."""
        return None if self.realization is None else self.realization.steps

    def realize(self, data_loader: Any) -> Realization:
        """The mechanism's strategy for this run, realized (once per run; a fresh stream for every ``make_private``,
        whatever mechanism object it was given)."""
        if self.realization is None:
            steps_per_epoch = len(data_loader)
            self.realization = realize(
                self.mechanism,
                steps=steps_of(*self._length, steps_per_epoch),
                sample_rate=1 / steps_per_epoch,
                dataset_size=len(data_loader.dataset),
            )
        return self.realization

    def build_loader(self, dp_loader: Any, *, distributed: bool = False) -> Any:
        """Realize the strategy for this run and return the loader it samples with: cyclic Poisson sampling of
        group t mod b (b = 1: Poisson over every record; under DDP: every rank with rank 0's partition seed,
        sampling its share of each group)."""
        realization = self.realize(dp_loader)
        shard = (0, 1)
        if distributed and dist.is_available() and dist.is_initialized():
            shard = (dist.get_rank(), dist.get_world_size())
            self.partition_seed = agreed_seed(self.partition_seed)
        self.loader = cyclic_loader(dp_loader, realization, partition_seed=self.partition_seed, shard=shard)
        return self.loader

    def check_setup(self, optimizer_class: type | None, data_loader: Any) -> None:
        """Before ``make_private`` builds anything: the optimizer class it will build (None: Opacus refuses the
        combination itself) must be one whose noise the mechanism can replace; ghost clipping needs ``num_workers=0``
        under a cyclic sampler with b > 1 (:func:`ghost_workers_error`)."""
        realization = None if data_loader is None else self.realize(data_loader)  # the strategy's refusals first
        if optimizer_class is None:
            return
        check_replaceable(optimizer_class, self.mechanism.name)
        workers = getattr(data_loader, "num_workers", 0)
        cyclic = realization is not None and realization.bands > 1
        if cyclic and workers > 0 and issubclass(optimizer_class, DPOptimizerFastGradientClipping):
            raise ghost_workers_error(self.mechanism.name)

    def accountant_hook(self, accountant: Any, count: Callable[[int], None]) -> Callable:
        self.hook = accountant_hook(accountant, self.realization, count, self.loader)
        return self.hook

    def install(self, optimizer: DPOptimizer) -> None:
        install_noise(optimizer, self.realization, len(self.loader))

    def check_denoisers(self, denoisers: Any) -> None:
        """Denoisers that assume noise independent across steps refuse a correlated mechanism."""
        if not self.realization.correlated:
            return
        bad = [type(d).__name__ for d in denoisers if getattr(d, "assumes_independent_noise", False)]
        if bad:
            raise ValueError(
                f"{', '.join(bad)} assume(s) DP noise independent across steps, but noise_mechanism="
                f"{self.mechanism.name!r} correlates it: their averaging would not reduce it as they model. Drop them, "
                "or use the gaussian mechanism"
            )

    def state_dict(self) -> dict[str, Any]:
        """The mechanism's settings and realized strategy (coefficients, κ), the partition (its seed, secret, and a
        digest that a resume checks) and the step in the group cycle; never the noise buffers."""
        sampler = None if self.loader is None else self.loader.batch_sampler
        state = {} if self.hook is None else self.hook.state
        return {
            **self.realization.state(),
            "sample_rate": None if self.loader is None else 1 / len(self.loader),  # the loader's q: a fact of the run
            "noise_multiplier": state.get("sigma"),  # the optimizer's σ and C at the last charge
            "max_grad_norm": state.get("clip"),
            "partition_seed": self.partition_seed,
            "partition_digest": partition_digest(sampler.parts) if isinstance(sampler, CyclicPoissonSampler) else None,
            "step": 0 if self.hook is None else int(self.hook.state["step"]),
        }

    def check_state(self, state: Any, where: str, facts: dict[str, Any] | None = None) -> None:
        """Refuse (before anything is loaded) a checkpoint of another mechanism, or one whose partition seed rebuilds
        other groups on this data (another dataset size, a torch whose generator draws differently): resuming would
        put records in other groups, at steps the accounting does not cover. Mid-band (its step not a multiple of b)
        the loader's rate and ``facts`` (the resumed optimizer's σ and C) must equal the checkpoint's: the band's one
        charge covers one (σ, C, q) — a change is accounted exactly only at a band boundary. No message shows the
        seed."""
        ours = self.realization.state()
        theirs = {k: state.get(k) for k in ours} if isinstance(state, dict) else state
        if theirs != ours:
            raise ValueError(
                f"{where}: the checkpoint was trained with noise mechanism {_shown(theirs)}, this run uses "
                f"{_shown(ours)} (a resume must realize the same strategy: the same mechanism, settings and "
                "coefficients)"
            )
        self._check_mid_band(state, where, facts or {})
        sampler = self.loader.batch_sampler
        if isinstance(sampler, CyclicPoissonSampler):
            rebuilt = partition(len(self.loader.dataset), sampler.groups, int(state["partition_seed"]))
            if partition_digest(rebuilt) != state.get("partition_digest"):
                raise ValueError(
                    f"{where}: the groups rebuilt from the checkpoint's partition seed are not the ones it trained on "
                    "(another dataset size, or a torch whose generator draws differently): resuming would put records "
                    "in other groups, at steps the accounting does not cover"
                )

    def _check_mid_band(self, state: dict[str, Any], where: str, facts: dict[str, Any]) -> None:
        step, bands = int(state.get("step", 0)), self.realization.bands
        if bands == 1 or step % bands == 0:
            return
        now = {"sample_rate": 1 / len(self.loader), **facts}
        changed = [k for k, v in now.items() if v is not None and not _same(state.get(k), v)]
        if changed:
            raise ValueError(
                f"{where}: the checkpoint stops inside a band (step {step % bands} of {bands}), and this run changes "
                f"{', '.join(changed)}: the band's one charge covers one noise multiplier, clipping bound and sample "
                f"rate, so a change is accounted exactly only at a band boundary (a multiple of {bands} steps). "
                "Resume with the checkpoint's settings"
            )

    def load_state_dict(self, state: Any, where: str) -> None:
        """A resumed run (:meth:`check_state` first): the same mechanism and partition, the group cycle continued, a
        fresh noise stream."""
        self.check_state(state, where)
        self.partition_seed = int(state["partition_seed"])
        sampler = self.loader.batch_sampler
        if isinstance(sampler, CyclicPoissonSampler):
            sampler.parts = partition(len(self.loader.dataset), sampler.groups, self.partition_seed)
            sampler.partition_seed = self.partition_seed
            sampler.step = int(state["step"])
        if self.hook is not None:
            self.hook.state["step"] = int(state["step"])
        self.realization.reset()
        if self.certificate is not None:
            self.certificate.reset()


def _shown(state: Any) -> str:
    """A mechanism's state for a message: its settings and κ, without the list of coefficients."""
    if not isinstance(state, dict):
        return repr(state)
    return repr({k: v for k, v in state.items() if k != "coefficients"})


def _same(saved: Any, now: Any) -> bool:
    return isinstance(saved, (int, float)) and math.isclose(float(saved), float(now), rel_tol=1e-12, abs_tol=0.0)
