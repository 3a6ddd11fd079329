"""``opacus_spectral.PrivacyEngine``: Opacus' engine plus post-noise denoisers.

Vocabulary: a *denoiser* is a callable over the step's noisy gradients; ``post_hooks=[...]`` is the
``make_private`` argument listing denoisers; the *pipeline* (:class:`~opacus_spectral.step.pipeline.PostNoisePipeline`)
runs them every logical step.

A drop-in subclass: without ``post_hooks`` it trains exactly like ``opacus.PrivacyEngine`` (same optimizer
classes, same noise, same accountant — bit-identical parameters for the same generators); the differences are
the alternation-safe GradSampleModule (identical maths, see :mod:`~opacus_spectral.step.grad_sample`) and where
randomness comes from: noise and Poisson sample are drawn from OS-entropy generators, never torch's global RNG
(:mod:`~opacus_spectral.step.noise_source`).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import opacus
import torch
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample import AbstractGradSampleModule
from opacus.grad_sample.utils import get_gsm_class
from opacus.optimizers import DPOptimizer, FSDPOptimizerFastGradientClipping, get_optimizer_class
from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from opacus.validators.errors import UnsupportedModuleError
from torch import nn
from torch.distributed._composable.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from .accounting.bounds import (
    GDP_WHY,
    EngineCount,
    bounded_epsilon,
    check_delta,
    refuse_gdp,
    without_inapplicable_warnings,
)
from .accounting.calibration import epsilon_from_history
from .accounting.checkpoint import (
    COUNT_KEY,
    load_checkpoint_file,
    optimizer_step_count,
    read_engine_count,
    verify_accountant_history,
)
from .accounting.record import compose_privacy_record, noise_multiplier_after, prior_history
from .accounting.sampling import (
    UNAMPLIFIED,
    PassTracker,
    counted_hook,
    refuse_unbounded,
    sampler_kind,
    shuffled_hook,
    warn_ignored_sampler,
)
from .denoisers.advice import external_stacklevel
from .doctor.batch_check import BatchCheck, BatchCheckSetting, install_batch_check
from .doctor.doctor import Doctor, DoctorSetting, accounted_steps, install_doctor
from .errors import ApproximateEpsilonWarning, NonPrivateWarning, ShuffledSamplingWarning
from .mechanisms.certificate import CERTIFICATE_ATTR, NoiseCertificate
from .mechanisms.install import CHECKPOINT_KEY as MECHANISM_KEY
from .mechanisms.install import MechanismRun, MechanismSpec
from .mechanisms.realization import realize
from .optimizers.adam_bc import DPAdamBC, attach_noise_variance
from .optimizers.adam_bc import check_denoisers as check_adam_bc
from .plugins.registry import DenoiserSpec, Registry, get_registry
from .step.copies import refuse_copies
from .step.grad_sample import check_per_sample_support, safe_class
from .step.installation import PostHookHandle, install_post_hooks, remove_pipeline
from .step.noise_source import NoiseSource, parameter_device, warn_reproducible
from .step.parameters import unwrap
from .step.pipeline import DEFAULT_MAX_OUTPUT_RATIO, OnError, OnNonFinite
from .step.precision import PrecisionGuard, install_precision_guard

CHECKPOINT_KEY = "opacus_spectral_post_hooks"
NON_PRIVATE = (
    "noise_multiplier=0 trains with clipping only and NO noise: the model is NOT differentially private, "
    "whatever the accountant reports"
)


def _check_max_grad_norm(value: Any) -> None:
    """``max_grad_norm`` (flat, or one per layer) must be finite and > 0: 0 clips every gradient to zero (nothing
    trains while ε is spent), inf bounds no sensitivity (the noise protects nothing), a negative one is meaningless."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    ok = bool(values) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values
    )
    if not ok:
        raise ValueError(
            f"max_grad_norm must be a finite number > 0 (clipping='per_layer': a list of them), got {value!r}: 0 "
            "clips every per-sample gradient to zero (nothing trains while epsilon is spent), inf bounds no "
            "sensitivity (the noise then protects nothing). Pass the clipping bound C, e.g. 1.0"
        )


#: the engine's own settings: given to ``make_private``, they are refused with where they belong
ENGINE_SETTINGS = ("accountant", "secure_mode", "registry", "noise_seed")
#: what ``make_private_with_epsilon`` takes besides ``make_private``'s keywords (the budget, the search's tolerance)
CALIBRATION_KEYWORDS = ("target_epsilon", "target_delta", "epochs", "epsilon_tolerance")


def _keywords_of(fn: Callable[..., Any]) -> set[str]:
    """The names ``fn`` takes as keywords (neither ``self`` nor ``*args`` / ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds} - {"self"}


def _optimizer_class(kwargs: dict[str, Any]) -> type | None:
    """The DPOptimizer class Opacus' ``make_private`` will build for ``kwargs`` (None for a combination it refuses)."""
    distributed = isinstance(kwargs.get("module"), (DPDDP, DDP, FSDPModule))
    try:
        return get_optimizer_class(
            clipping=kwargs.get("clipping", "flat"),
            distributed=distributed,
            grad_sample_mode=kwargs.get("grad_sample_mode", "hooks"),
        )
    except ValueError:  # an unknown clipping or mode: Opacus names it
        return None


def _optimizer_keywords(kwargs: dict[str, Any]) -> set[str]:
    """The keywords Opacus' ``**kwargs`` carry to the optimizer class ``make_private`` builds (AdaClip's settings)."""
    cls = _optimizer_class(kwargs)
    return set() if cls is None else _keywords_of(cls.__init__) - _keywords_of(DPOptimizer.__init__)


def refuse_unknown_keywords(where: str, given: Iterable[str], accepted: set[str]) -> None:
    """``TypeError`` for a keyword ``where`` does not use (Opacus' ``**kwargs`` ignores it without a word), naming
    where an engine setting belongs, or the closest keyword it takes."""
    unknown = sorted(set(given) - accepted)
    if not unknown:
        return
    name = unknown[0]
    if name in ENGINE_SETTINGS:
        hint = f"it belongs to the engine: PrivacyEngine({name}=...), for every make_private of that engine"
    else:
        close = difflib.get_close_matches(name, sorted(accepted), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(sorted(accepted))}"
    raise TypeError(
        f"{where}() got an unexpected keyword argument {name!r}: {hint} (Opacus' make_private would ignore it)"
    )


def refuse_fsdp(*, module: Any = None, grad_sample_mode: str | None = None, optimizer: Any = None) -> None:
    """The engine refuses FSDP — a model wrapped by it, ``grad_sample_mode="ghost_fsdp"`` (``make_private``), or its
    optimizer (:func:`~opacus_spectral.step.installation.install_post_hooks` on a hand-built one)."""
    fsdp = isinstance(module, FSDPModule) or isinstance(optimizer, FSDPOptimizerFastGradientClipping)
    if fsdp or grad_sample_mode == "ghost_fsdp":
        raise NotImplementedError(
            "FSDP (an FSDP-wrapped model, grad_sample_mode='ghost_fsdp') is not supported by opacus_spectral: its "
            "gradients are sharded DTensors, and a spectral denoiser needs each full matrix. Use DDP (torch's "
            "DistributedDataParallel or Opacus' DPDDP), or opacus.PrivacyEngine without post_hooks."
        )


def _replaceable_modules(module: nn.Module) -> list[str]:
    """``'name' (Type)`` of the trainable modules Opacus' validator refuses and ``ModuleValidator.fix`` replaces."""
    found = []
    for name, sub in trainable_modules(module):
        kind = type(sub)
        if kind in ModuleValidator.FIXERS and ModuleValidator.VALIDATORS.get(kind, lambda m: [])(sub):
            found.append(f"{name!r} ({kind.__name__})")
    return found


def _unit(kwargs: dict[str, Any]) -> dict[str, bool]:
    return {"new_privacy_unit": bool(kwargs.get("new_privacy_unit", False))}


def _forward_module(module: Any) -> nn.Module:
    """The module whose forward the user calls: the wrapper ``make_private`` returned, or with ``wrap_model=False``
    (a hooks object, not a module) the user's model."""
    return module if isinstance(module, nn.Module) else unwrap(module)


class PrivacyEngine(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` whose ``make_private`` takes ``post_hooks=[...]``.

    After ``make_private`` the installed pipeline is ``engine.post_hooks`` (a :class:`PostHookHandle` with
    ``diagnostics``, ``logical_steps``, ``add_step_callback()``, ``state_dict()`` and ``remove()``), or ``None``
    when ``post_hooks`` was not given.

    ``noise_seed=None`` (default): every ``make_private`` draws the noise and the Poisson sample from new
    generators seeded from OS entropy. ``noise_seed=<int>``: from generators derived from that seed — reproducible,
    and NOT private against whoever knows it (warns :class:`~opacus_spectral.errors.ReproducibleNoiseWarning`).
    ``secure_mode=True`` keeps Opacus' behaviour (torchcsprng).
    """

    def __init__(
        self,
        *,
        accountant: str = "prv",
        secure_mode: bool = False,
        registry: Registry | None = None,
        noise_seed: int | None = None,
    ):
        if secure_mode and noise_seed is not None:
            raise ValueError("noise_seed makes the noise reproducible, secure_mode makes it unpredictable: pick one")
        with warnings.catch_warnings():
            # Opacus' "Secure RNG turned off" is about noise from torch's global RNG, which this engine never draws
            # from (OS-entropy generators: docs/engine.md, "Noise, seeds and reproducibility"); gdp's caveat is
            # ApproximateEpsilonWarning, where the ε is read
            warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
            with without_inapplicable_warnings("gdp"):
                super().__init__(accountant=accountant, secure_mode=secure_mode)
        self.noise_source = NoiseSource(noise_seed)
        self._sample_rate: float | None = None  # what the accountant's hook records, set by make_private
        self._generators: list[tuple[torch.Generator, str, int]] = []  # (generator, purpose, rank) made here
        if noise_seed is not None:
            warn_reproducible()
        self.registry = registry
        self.post_hooks: PostHookHandle | None = None
        self.doctor: Doctor | None = None  #: the checks installed by the last make_private (docs/engine.md)
        self.batch_check: BatchCheck | None = None  #: the last make_private's batch-independence check (docs/engine.md)
        self.precision_guard: PrecisionGuard | None = None  #: float32 clipping under autocast (docs/engine.md)
        self.mechanism_run: MechanismRun | None = None  #: the last make_private's noise mechanism (docs/mechanisms.md)
        #: the last make_private's noise certificate (every step's released noise against its charge)
        self.noise_certificate: NoiseCertificate | None = None

    def validate(self, *, module: nn.Module, optimizer: Any, data_loader: Any) -> None:  # type: ignore[override]
        """Opacus' check that every trainable module can be trained privately; modules Opacus' validator can replace
        (BatchNorm) are named, with the fix."""
        try:
            super().validate(module=module, optimizer=optimizer, data_loader=data_loader)
        except UnsupportedModuleError as err:
            fixable = _replaceable_modules(module)
            if not fixable:
                raise
            shown = ", ".join(fixable[:4]) + (" ..." if len(fixable) > 4 else "")
            why = " (a BatchNorm makes each record's output depend on the other records of its batch)"
            raise UnsupportedModuleError(
                f"make_private: {len(fixable)} module(s) cannot be trained with differential privacy as they are: "
                f"{shown}{why if 'BatchNorm' in shown else ''}. Fix: "
                "model = opacus.validators.ModuleValidator.fix(model) replaces them with modules Opacus supports "
                "(BatchNorm with GroupNorm); do it before building the optimizer, as the fixed model has new "
                f"parameters. Opacus' findings: {err}"
            ) from err

    # Opacus builds the GradSampleModule here; swap in the alternation-safe classes.
    def _prepare_model(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        max_grad_norm: float | list[float] = 1.0,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
    ) -> Any:
        refuse_fsdp(module=module, grad_sample_mode=grad_sample_mode)
        check_per_sample_support(module)
        cls = safe_class(grad_sample_mode, wrap_model)
        if wrap_model and isinstance(module, AbstractGradSampleModule):
            # a module this engine (or Opacus) already wrapped, e.g. make_private called again
            accepted = {get_gsm_class(grad_sample_mode), cls}
            if (
                module.batch_first != batch_first
                or module.loss_reduction != loss_reduction
                or type(module) not in accepted
            ):
                raise ValueError(
                    f"pre-existing {type(module).__name__} does not match batch_first={batch_first}, "
                    f"loss_reduction={loss_reduction!r}, grad_sample_mode={grad_sample_mode!r}; pass the plain module"
                )
            return module
        if cls is None:
            return super()._prepare_model(
                module,
                batch_first=batch_first,
                max_grad_norm=max_grad_norm,
                loss_reduction=loss_reduction,
                grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model,
            )
        self.validate(module=module, optimizer=None, data_loader=None)
        kwargs: dict[str, Any] = {"batch_first": batch_first, "loss_reduction": loss_reduction}
        if grad_sample_mode == "functorch":
            kwargs["force_functorch"] = True
        if grad_sample_mode == "ghost":
            kwargs["max_grad_norm"] = max_grad_norm
        return cls(module, **kwargs)

    def make_private(  # type: ignore[override]
        self,
        *args: Any,
        post_hooks: Sequence[DenoiserSpec] | None = None,
        on_denoiser_error: OnError = "raise",
        oracle: bool = False,
        max_output_ratio: float | None = DEFAULT_MAX_OUTPUT_RATIO,
        on_nonfinite_grad: OnNonFinite = "raise",
        allow_non_private: bool = False,
        new_privacy_unit: bool = False,
        doctor: DoctorSetting | None = None,
        batch_check: BatchCheckSetting | None = None,
        noise_mechanism: MechanismSpec | None = None,
        steps: int | None = None,
        epochs: float | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """``opacus.PrivacyEngine.make_private`` plus denoisers.

        Args:
            post_hooks: denoisers applied to the noisy gradient every logical step, in this order: registered
                names (``"rmt"``), ``(name, {kwargs})`` pairs or denoiser callables. ``None``: no pipeline.
            on_denoiser_error: ``"raise"`` or ``"fallback"`` (see
            :class:`~opacus_spectral.step.pipeline.PostNoisePipeline`). oracle: record cosines to the clean clipped
            gradient each step (benchmarks only). max_output_ratio: per-tensor bound on a denoiser's output norm, in
            units of max(that tensor's noisy
                gradient norm, its expected noise norm) (default 1000; ``None``: no bound). Needs ``post_hooks``.
            on_nonfinite_grad: NaN/Inf in the noisy gradient: ``"raise"`` (default), ``"skip_step"`` or
                ``"ignore"`` (Opacus' behaviour). Needs ``post_hooks`` (``[]`` is enough).
            allow_non_private: ``noise_multiplier=0`` (clipping without noise: no differential privacy) warns a
                :class:`NonPrivateWarning` unless this is ``True``; with denoisers in ``post_hooks`` it is refused.
            new_privacy_unit: a model that carries a privacy record (:mod:`~opacus_spectral.accounting.record`) is
                composed with by default (ε continues); ``True`` states that the new data are a different privacy
                unit, and the accountant starts from 0.
            doctor: checks for silent failures (:mod:`~opacus_spectral.doctor.doctor`): ``True``/``"warn"`` (default),
                ``"raise"``, or ``False`` (off). The installed checks are ``engine.doctor``.
            batch_check: at the first training forward, check that no record's outputs depend on the other records
                of its batch (:mod:`~opacus_spectral.doctor.batch_check`): ``"raise"`` (default), ``"warn"`` or
                ``False``.
            noise_mechanism: ``None`` / ``"gaussian"`` (DP-SGD, Opacus' own noise), ``"bandmf"`` or
                ``("bandmf", {"bands": b})`` (banded matrix-factorization noise with cyclic Poisson sampling,
                ``docs/mechanisms.md``), or a :class:`~opacus_spectral.mechanisms.base.NoiseMechanism`.
            steps, epochs: the run's length (one of them), which ``"bandmf"`` optimizes its coefficients for.

        Returns what Opacus returns: ``(module, optimizer, data_loader)``, or with ghost clipping
        ``(module, optimizer, criterion, data_loader)``. A keyword neither this engine nor Opacus uses is a
        ``TypeError`` (:func:`refuse_unknown_keywords`), before anything is built.
        """
        refuse_unknown_keywords("make_private", kwargs, self._keywords(kwargs))
        self._check_noise(kwargs.get("noise_multiplier"), allow_non_private, post_hooks)
        _check_max_grad_norm(kwargs.get("max_grad_norm", 1.0))
        check_adam_bc(kwargs.get("optimizer"), post_hooks)
        self._drop_previous_pipeline(kwargs.get("optimizer"))
        self._generators = []
        if not self.secure_mode and kwargs.get("noise_generator") is None and kwargs.get("optimizer") is not None:
            kwargs["noise_generator"] = self.noise_source.noise_generator(parameter_device(kwargs["optimizer"]))
            self._generators.append((kwargs["noise_generator"], "noise", 0))
        noise = self._create_mechanism(noise_mechanism, steps, epochs, kwargs.get("poisson_sampling", True))
        if self.mechanism_run is not None:  # before Opacus hooks the model: a retry must find it untouched
            self.mechanism_run.check_setup(_optimizer_class(kwargs), kwargs.get("data_loader"))
            noise = self.mechanism_run.realization
        compose_privacy_record(self, new_privacy_unit=new_privacy_unit, noise=noise, **kwargs)  # ε continues
        out = super().make_private(*args, **kwargs)
        if self.mechanism_run is not None:
            self.mechanism_run.install(out[1])
        setattr(out[1], CERTIFICATE_ATTR, self.noise_certificate)  # certificate_of(optimizer)
        refuse_copies(out[1])  # a copy would break Opacus' DPOptimizer class for the whole process (.copies)
        if isinstance(out[1].original_optimizer, DPAdamBC):  # told each step's noise variance (.optimizers.adam_bc)
            attach_noise_variance(out[1])
        self._sample_rate = 1 / len(out[-1])  # exactly Opacus' sample_rate for the accountant hook
        pipeline = dict(
            on_error=on_denoiser_error,
            oracle=oracle,
            max_output_ratio=max_output_ratio,
            on_nonfinite_grad=on_nonfinite_grad,
        )
        self._install(out, kwargs, doctor=doctor, batch_check=batch_check, post_hooks=post_hooks, pipeline=pipeline)
        return out

    def make_private_with_epsilon(  # type: ignore[override]
        self,
        *args: Any,
        post_hooks: Sequence[DenoiserSpec] | None = None,
        on_denoiser_error: OnError = "raise",
        oracle: bool = False,
        max_output_ratio: float | None = DEFAULT_MAX_OUTPUT_RATIO,
        on_nonfinite_grad: OnNonFinite = "raise",
        doctor: DoctorSetting = True,
        batch_check: BatchCheckSetting = "raise",
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """``opacus.PrivacyEngine.make_private_with_epsilon`` plus ``post_hooks``, ``doctor`` and ``batch_check`` (kept
        out of Opacus' kwargs, which also reach ``get_noise_multiplier``): ``make_private`` with the calibrated σ,
        which installs them. σ comes from :func:`~opacus_spectral.accounting.calibration.noise_multiplier_for`
        (Opacus' search, bounded; refuses ``gdp``, a ``target_delta`` ≥ 1/N and a target outside its range); without
        Poisson sampling it is calibrated to the un-amplified bound (one Gaussian mechanism per epoch,
        :mod:`~opacus_spectral.accounting.sampling`)."""
        accepted = self._keywords(kwargs) | set(CALIBRATION_KEYWORDS)
        refuse_unknown_keywords("make_private_with_epsilon", kwargs, accepted)
        _check_max_grad_norm(kwargs.get("max_grad_norm", 1.0))
        check_adam_bc(kwargs.get("optimizer"), post_hooks)
        self._drop_previous_pipeline(kwargs.get("optimizer"))
        options = dict(
            post_hooks=post_hooks,
            on_denoiser_error=on_denoiser_error,
            oracle=oracle,
            max_output_ratio=max_output_ratio,
            on_nonfinite_grad=on_nonfinite_grad,
            doctor=doctor,
            batch_check=batch_check,
        )
        return self._private_with_epsilon(*args, **options, **kwargs)

    def _keywords(self, kwargs: dict[str, Any]) -> set[str]:
        """The keywords ``make_private`` uses: its own, Opacus' (the class this engine subclasses, whatever
        ``opacus.PrivacyEngine`` names now), and those Opacus passes on to the optimizer class it builds for these
        arguments (AdaClip's)."""
        upstream = super().make_private
        return _keywords_of(type(self).make_private) | _keywords_of(upstream) | _optimizer_keywords(kwargs)

    def _install(
        self,
        out: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        doctor: DoctorSetting | None,
        batch_check: BatchCheckSetting | None,
        post_hooks: Sequence[DenoiserSpec] | None,
        pipeline: dict[str, Any],
    ) -> None:
        """What rides on the DPOptimizer ``make_private`` built (the one install routine of both ``make_private``
        variants): the doctor, the guards of DESIGN invariant 8, and the denoiser pipeline — after Opacus'
        ``make_private`` returned, as the accountant's step hook is attached last inside it (docs/upstream.md §1.3)."""
        if self.doctor is not None:
            self.doctor.remove()
        setting = True if doctor is None else doctor
        self.doctor = install_doctor(out[1], out[0], accountant=self.accountant, mode=setting, data_loader=out[-1])
        self._install_guards(out, "raise" if batch_check is None else batch_check, kwargs)
        if post_hooks is not None:
            self.post_hooks = install_post_hooks(out[1], post_hooks, module=out[0], registry=self.registry, **pipeline)
            if self.mechanism_run is not None:
                self.mechanism_run.check_denoisers(self.post_hooks.denoisers)

    def _create_mechanism(self, spec: Any, steps: Any, epochs: Any, poisson_sampling: bool) -> Any:
        """:attr:`mechanism_run` for ``make_private(noise_mechanism=spec)`` (None: Opacus' own noise); returns its
        mechanism (``docs/mechanisms.md``)."""
        self.mechanism_run = MechanismRun.create(
            self.registry or get_registry(),
            spec,
            steps=steps,
            epochs=epochs,
            seed=self.noise_source.partition_seed,
            poisson_sampling=poisson_sampling,
            accountant=self.accountant.mechanism(),
        )
        return None if self.mechanism_run is None else self.mechanism_run.mechanism

    def _private_with_epsilon(
        self, *args: Any, target_epsilon: float, target_delta: float, epochs: float, **kwargs: Any
    ) -> tuple[Any, ...]:
        """Opacus' ``make_private_with_epsilon`` with the σ of
        :func:`~opacus_spectral.accounting.record.noise_multiplier_after`: the target holds for everything the
        accountant will have counted — its own earlier steps and the model's privacy record
        (:func:`~opacus_spectral.accounting.calibration.noise_multiplier_for` when there are none)."""
        refuse_gdp(self.accountant.mechanism(), "make_private_with_epsilon")
        loader = kwargs["data_loader"]
        check_delta(target_delta, len(loader.dataset), "target_delta")
        poisson = kwargs.get("poisson_sampling", True) or sampler_kind(loader) == "poisson"
        sample_rate = 1 / len(loader) if poisson else 1.0  # shuffled: one Gaussian mechanism per epoch
        steps = int(epochs / sample_rate) if poisson else math.ceil(epochs)
        spec, scale = kwargs.get("noise_mechanism"), 1.0
        if spec is not None and spec != "gaussian":  # calibrated through the accounting of its realized strategy
            mechanism = (self.registry or get_registry()).create_mechanism(spec)
            kwargs.update(noise_mechanism=mechanism, steps=steps)
            realized = realize(mechanism, steps=steps, sample_rate=sample_rate, dataset_size=len(loader.dataset))
            accounting = realized.accounting(1.0, sample_rate)
            sample_rate, steps = accounting.sample_rate, math.ceil(steps / accounting.every)
            scale = accounting.noise_multiplier  # charged σ′ = σ × scale (BandMF: 1/κ)
        # what the accountant will already hold: its own steps, then the model's privacy record (.privacy_record)
        prior = [*self.accountant.history, *prior_history(self, kwargs.get("module"), **_unit(kwargs))]
        sigma = noise_multiplier_after(
            prior,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=self.accountant.mechanism(),
            epsilon_tolerance=kwargs.pop("epsilon_tolerance", 0.01),
        )
        return self.make_private(*args, noise_multiplier=sigma / scale, **kwargs)

    def _install_guards(self, out: tuple[Any, ...], batch_check: BatchCheckSetting, kwargs: dict[str, Any]) -> None:
        """DESIGN invariant 8 on the user's set-up: clipping in float32 under autocast
        (:mod:`~opacus_spectral.step.precision`) and the batch-independence check
        (:mod:`~opacus_spectral.doctor.batch_check`); the previous make_private's are removed."""
        for old in (self.precision_guard, self.batch_check):
            if old is not None:
                old.remove()
        mode = kwargs.get("grad_sample_mode", "hooks")
        self.precision_guard = install_precision_guard(out[1], _forward_module(out[0]), mode=mode)
        self.batch_check = install_batch_check(
            out[0], out[-1], batch_check, batch_first=kwargs.get("batch_first", True)
        )

    def sampler_generator(self, *, distributed: bool = False) -> torch.Generator | None:
        """The generator for a Poisson sampler this engine builds: Opacus' ``secure_rng`` in ``secure_mode``,
        otherwise a new one from :attr:`noise_source` (per DDP rank when ``distributed``)."""
        if self.secure_mode:
            return self.secure_rng
        rank = torch.distributed.get_rank() if distributed and torch.distributed.is_initialized() else 0
        generator = self.noise_source.sampler_generator(rank)
        self._generators.append((generator, "sampler", rank))
        return generator

    # Opacus samples with the DataLoader's generator, else the global RNG: give it ours unless the caller chose one.
    # Whatever the loader, the accountant's hook charges what this sampling spends (.shuffled_sampling).
    def _prepare_data_loader(
        self,
        data_loader: Any,
        *,
        poisson_sampling: bool,
        distributed: bool,
        batch_first: bool = True,
        rand_on_empty: bool = False,
    ) -> Any:
        sampling = self._sampling_of(data_loader, poisson_sampling=poisson_sampling, distributed=distributed)
        if self.secure_mode or not poisson_sampling or data_loader.generator is not None:
            out = super()._prepare_data_loader(
                data_loader,
                poisson_sampling=poisson_sampling,
                distributed=distributed,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        else:
            # poisson_sampling=False outside secure_mode only records the dataset (Opacus' per-dataset warning)
            super()._prepare_data_loader(data_loader, poisson_sampling=False, distributed=distributed)
            out = DPDataLoader.from_data_loader(
                data_loader,
                generator=self.sampler_generator(distributed=distributed),
                distributed=distributed,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        if self.mechanism_run is not None:
            out = self.mechanism_run.build_loader(out, distributed=distributed)
        self._hook_accountant(out, sampling)
        return out

    def _sampling_of(self, data_loader: Any, *, poisson_sampling: bool, distributed: bool) -> str:
        """``"poisson"`` or ``"shuffle"`` (the un-amplified bound); refuses a loader without a computable bound and
        warns where ε is not what the user may expect (gdp, an ignored sampler, shuffled sampling)."""
        gdp = self.accountant.mechanism() == "gdp"
        if gdp:
            warnings.warn(
                f"PrivacyEngine(accountant='gdp'): {GDP_WHY}. get_epsilon reports PRV's upper bound on the same steps "
                "instead; use accountant='prv' or 'rdp' to say so.",
                ApproximateEpsilonWarning,
                stacklevel=external_stacklevel(),
            )
        kind = sampler_kind(data_loader)
        if poisson_sampling or kind == "poisson":
            if poisson_sampling:
                warn_ignored_sampler(kind, data_loader)
            return "poisson"
        if gdp or distributed:
            why = (
                "the gdp accountant cannot hold (it keeps one (sigma, q)); use accountant='prv' or 'rdp'"
                if gdp
                else "cannot be bounded across DDP ranks (DistributedSampler pads shards by repeating records); use "
                "poisson_sampling=True"
            )
            raise ValueError(
                "make_private(poisson_sampling=False) is accounted by the un-amplified bound (one Gaussian mechanism "
                f"per pass over the data), which {why}"
            )
        refuse_unbounded(kind, data_loader)
        warnings.warn(UNAMPLIFIED, ShuffledSamplingWarning, stacklevel=external_stacklevel())
        return "shuffle"

    def _hook_accountant(self, data_loader: Any, sampling: str) -> None:
        """The accountant's step hook for the ``make_private`` under way (it asks ``get_optimizer_hook_fn`` once,
        right after this): Opacus' Poisson hook plus the engine's step count, or the un-amplified bound's."""
        accountant, state = self.accountant, self._accounting()
        state.sampling = sampling
        tracker = None
        if sampling == "shuffle":
            tracker = PassTracker(data_loader.batch_sampler.sampler, prefetching=data_loader.num_workers > 0)
        accountant.__dict__.pop("get_optimizer_hook_fn", None)
        opacus_factory = accountant.get_optimizer_hook_fn

        def factory(sample_rate: float) -> Any:
            accountant.__dict__.pop("get_optimizer_hook_fn", None)  # one make_private, one hook
            if self.mechanism_run is not None:
                return self._certified(self.mechanism_run.accountant_hook(accountant, state.count))
            if tracker is not None:
                return self._certified(shuffled_hook(accountant, tracker, state.count))
            return self._certified(counted_hook(accountant, opacus_factory(sample_rate=sample_rate), state.count))

        accountant.get_optimizer_hook_fn = factory

    def _certified(self, hook: Any) -> Any:
        """``hook`` (the accountant's: it charges the step), then the noise certificate of the step
        (:mod:`~opacus_spectral.mechanisms.certificate`): what was released against what was charged, before the
        update. The certificate whitens with the run's strategy (DP-SGD's c = (1,) without a mechanism)."""
        run = self.mechanism_run
        certificate = NoiseCertificate((1.0,) if run is None else run.realization.coefficients)
        self.noise_certificate = certificate
        if run is not None:  # a resume's fresh stream restarts the certificate's strategy too
            run.certificate = certificate

        def certified(optim: Any) -> None:
            hook(optim)
            certificate.check(optim)

        return certified

    @property
    def dp_steps(self) -> int:
        """The noisy DP steps this engine's optimizers took, across its ``make_private`` calls (a resumed checkpoint's
        included): under Poisson sampling the steps its accountant counted, under shuffled sampling more."""
        return self._accounting().dp_steps

    def _accounting(self) -> EngineCount:
        """This engine's own count of the DP steps its optimizers took and the steps they charged (checkpoints)."""
        state = self.__dict__.get("_accounting_count")
        if state is None:
            state = self.__dict__["_accounting_count"] = EngineCount()
        return state

    def _dataset_size(self) -> int | None:
        """N, the records the loader of the last ``make_private`` samples from (``None`` before one)."""
        dataset = getattr(self, "dataset", None)
        return len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None

    def get_epsilon(self, delta: float) -> float:  # type: ignore[override]
        """ε spent so far at ``delta`` — Opacus' ``get_epsilon``, as an upper bound or an error
        (:func:`~opacus_spectral.accounting.bounds.bounded_epsilon`): ``delta`` must be below 1/N once ``make_private``
        knows the dataset; an empty history is 0.0, a step without noise ∞; a negative numerical ε is 0.0; the gdp
        accountant (an approximation) warns :class:`~opacus_spectral.accounting.bounds.ApproximateEpsilonWarning`."""
        check_delta(delta, self._dataset_size(), "delta")
        mechanism = self.accountant.mechanism()
        history = [(float(s), float(q), int(n)) for s, q, n in self.accountant.history]
        finite = [e for e in history if e[0] != math.inf]  # infinite noise releases nothing
        if not finite:
            return 0.0
        if any(s == 0 for s, _, _ in finite):
            return math.inf
        if mechanism == "gdp":  # Opacus' gdp ε is an approximation: report PRV's upper bound on the same steps
            return epsilon_from_history(finite, delta, "prv")
        if len(finite) < len(history):
            return epsilon_from_history(finite, delta, mechanism)
        return bounded_epsilon(finite, delta, mechanism, lambda: super(PrivacyEngine, self).get_epsilon(delta))

    @staticmethod
    def _check_noise(noise_multiplier: Any, allow_non_private: bool, post_hooks: Sequence[Any] | None) -> None:
        """Noise 0 trains as in Opacus with one :class:`NonPrivateWarning` (``allow_non_private=True`` silences it);
        with denoisers it is refused unless opted in: they are calibrated to a noise level that is then 0."""
        if noise_multiplier is None or noise_multiplier != 0 or allow_non_private:
            return
        if post_hooks:
            raise ValueError(
                f"{NON_PRIVATE}, and the denoisers in post_hooks are calibrated to a noise std that is then 0 "
                "(they would edit a clean gradient). Use noise_multiplier > 0, drop post_hooks, or pass "
                "allow_non_private=True for a clipping-only reference run."
            )
        warnings.warn(
            f"{NON_PRIVATE}. Pass allow_non_private=True to make_private to silence this for a clipping-only "
            "reference run.",
            NonPrivateWarning,
            stacklevel=3,
        )

    def _drop_previous_pipeline(self, optimizer: Any) -> None:
        """A new make_private on an optimizer that already carries a pipeline starts without it (whatever
        ``post_hooks`` says now): the old pipeline would otherwise keep running on the new DPOptimizer."""
        if self.post_hooks is not None:
            self.post_hooks.remove()
            self.post_hooks = None
        remove_pipeline(optimizer)

    # Opacus' checkpoint helpers, plus the pipeline's state (stateful denoisers, step counter).
    def save_checkpoint(self, *, checkpoint_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        checkpoint_dict = dict(checkpoint_dict or {})
        if self.post_hooks is not None:
            checkpoint_dict[CHECKPOINT_KEY] = self.post_hooks.state_dict()
        checkpoint_dict[COUNT_KEY] = self._count_record()
        if self.mechanism_run is not None:  # its name, partition seed and step: never the noise buffers
            checkpoint_dict[MECHANISM_KEY] = self.mechanism_run.state_dict()
        super().save_checkpoint(checkpoint_dict=checkpoint_dict, **kwargs)

    def _count_record(self) -> dict[str, Any]:
        """The engine's step count saved beside the accountant history (``load_checkpoint`` cross-checks it)."""
        state, steps = self._accounting(), accounted_steps(self.accountant)
        if steps < state.charged:
            raise ValueError(
                f"save_checkpoint: the accountant's history counts {steps} steps, but this engine's accountant hooks "
                f"charged {state.charged}: the history was emptied or replaced since, and saving it would restart "
                "epsilon. Restore the full history before saving."
            )
        return {
            "dp_steps": state.dp_steps,
            "charged_steps": state.charged,
            "history_steps": steps,
            "sampling": state.sampling or "poisson",
        }

    def load_checkpoint(  # type: ignore[override]
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Any = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
        trusted: bool = False,
        noise_multiplier: float | None = None,
        sample_rate: float | None = None,
    ) -> dict[str, Any]:
        """Opacus' ``load_checkpoint`` without executing code from the file, refusing DP state that disagrees.

        Opacus 1.6 always unpickles with ``torch.load(..., weights_only=False)`` (``docs/upstream.md`` §1.6): a
        crafted checkpoint runs arbitrary code. Here the file is read with ``weights_only=True`` (tensors, numbers,
        strings and containers — everything this engine saves), and anything else raises
        ``pickle.UnpicklingError``.
        ``trusted=True`` restores the unrestricted unpickler, for files you created yourself.

        Before anything is loaded, the accountant's history must agree with the run
        (:func:`~opacus_spectral.accounting.checkpoint.verify_accountant_history`): σ with
        ``optimizer.noise_multiplier`` (or ``noise_multiplier=``; not checked with a ``noise_scheduler``, except under a
        mechanism charged once every b > 1 steps, such as BandMF, where it is required), q with this
        engine's last ``make_private`` (or ``sample_rate=``), and its step count with the engine's own count saved
        beside it (every optimizer, SGD included; a file without it is refused) and with the optimizer state's and the
        pipeline's step counters. Otherwise ``ValueError`` naming the mismatch, and nothing is loaded. These checks
        catch accidental and naive edits; a forger who rewrites the history and every count consistently is not
        detected.
        """
        checkpoint = load_checkpoint_file(path, trusted=trusted, **(torch_load_kwargs or {}))
        self._verify_dp_state(checkpoint, optimizer, noise_scheduler, noise_multiplier, sample_rate, where=str(path))
        steps = checkpoint[COUNT_KEY]["dp_steps"]  # DP steps, not the history's (BandMF charges one every b)
        for generator, purpose, rank in self._generators:  # the resumed steps never replay earlier steps' noise
            self.noise_source.reseed_for_resume(generator, purpose, steps, rank)
        module.load_state_dict(checkpoint["module_state_dict"], **(module_load_dict_kwargs or {}))
        self.accountant.load_state_dict(checkpoint["privacy_accountant_state_dict"])
        count, state = checkpoint.pop(COUNT_KEY), self._accounting()
        state.dp_steps, state.charged, state.sampling = count["dp_steps"], count["charged_steps"], count["sampling"]
        mechanism = checkpoint.pop(MECHANISM_KEY, None)
        if self.mechanism_run is not None:  # the same partition, the group cycle continued, a fresh noise stream
            self.mechanism_run.load_state_dict(mechanism, where=str(path))
        optimizer_state = checkpoint.pop("optimizer_state_dict", {})
        if optimizer is not None and optimizer_state:
            optimizer.load_state_dict(optimizer_state)
        elif (optimizer is not None) != bool(optimizer_state):
            warnings.warn(
                f"optimizer_state_dict has {len(optimizer_state)} items but an optimizer was "
                f"{'' if optimizer is not None else 'not '}given",
                RuntimeWarning,
                stacklevel=2,
            )
        for key, target in (
            ("noise_scheduler_state_dict", noise_scheduler),
            ("grad_clip_scheduler_state_dict", grad_clip_scheduler),
        ):
            state = checkpoint.pop(key, {})
            if target is not None and state:
                target.load_state_dict(state)
        state = checkpoint.pop(CHECKPOINT_KEY, None)
        if state is not None:
            self.post_hooks.load_state_dict(state)  # type: ignore[union-attr]  # checked in _verify_dp_state
        return checkpoint

    def _verify_dp_state(
        self,
        checkpoint: Any,
        optimizer: Any,
        noise_scheduler: Any,
        noise_multiplier: Any,
        sample_rate: Any,
        *,
        where: str,
    ) -> int:
        """The checks of :meth:`load_checkpoint`, before anything is loaded; returns the history's step count."""
        if isinstance(checkpoint, dict) and checkpoint.get(CHECKPOINT_KEY) is not None and self.post_hooks is None:
            raise ValueError(
                "the checkpoint holds post-hook (denoiser) state but this engine has no post_hooks; call "
                "make_private(..., post_hooks=[...]) with the same denoisers before load_checkpoint"
            )
        accountant = checkpoint.get("privacy_accountant_state_dict") if isinstance(checkpoint, dict) else None
        if not isinstance(accountant, dict) or "history" not in accountant:
            raise ValueError("load_checkpoint: the file holds no accountant state (privacy_accountant_state_dict)")
        where = f"load_checkpoint({where})"
        count = read_engine_count(checkpoint.get(COUNT_KEY), where=where)
        shuffle = count["sampling"] == "shuffle"
        current = self._accounting().sampling
        if current is not None and current != count["sampling"]:
            raise ValueError(
                f"{where}: the checkpoint's steps were charged for {count['sampling']} sampling, but this engine's "
                f"last make_private samples by {current}: load it into a run sampled the same way"
            )
        multiplier, q = _stated(optimizer, noise_multiplier, self._sample_rate, sample_rate, where)
        q = 1.0 if shuffle else q
        banded = (
            q is not None
            and self.mechanism_run is not None
            and self.mechanism_run.realization.accounting(1.0, q).every > 1
        )
        if (multiplier is None and (noise_scheduler is None or banded)) or q is None:
            raise ValueError(
                "load_checkpoint cannot check the checkpoint's privacy accounting without the run's noise multiplier "
                "and sample rate: call make_private first and pass its DPOptimizer as optimizer=, or pass "
                "noise_multiplier= and sample_rate= (the values the run was trained with)"
            )
        saved = checkpoint.get(MECHANISM_KEY)
        if (saved is None) != (self.mechanism_run is None):
            name = "gaussian" if saved is None else saved.get("name") if isinstance(saved, dict) else "malformed"
            raise ValueError(
                f"{where}: the checkpoint's noise mechanism ({name!r}) is not this run's: call make_private with the "
                "same noise_mechanism before load_checkpoint"
            )
        if self.mechanism_run is not None:  # the same mechanism and groups; mid-band, the same σ, C and rate
            clip = getattr(optimizer, "max_grad_norm", None)
            self.mechanism_run.check_state(saved, where, facts={"noise_multiplier": multiplier, "max_grad_norm": clip})
        pipeline = checkpoint.get(CHECKPOINT_KEY)
        counters = [count["charged_steps"]]
        if not shuffle and self.mechanism_run is None:  # these count DP steps, one history step each
            counters.append(optimizer_step_count(checkpoint.get("optimizer_state_dict", {})))
            if isinstance(pipeline, dict) and isinstance(pipeline.get("step"), int):
                counters.append(pipeline["step"])
        if multiplier is not None and self.mechanism_run is not None:  # the history holds the charged σ′
            multiplier = self.mechanism_run.realization.accounting(multiplier, q).noise_multiplier
        steps = verify_accountant_history(
            accountant["history"],
            # one charge for every b steps: the band spanning the resume may not change σ, scheduler or not
            noise_multiplier=None if noise_scheduler is not None and not banded else multiplier,
            sample_rate=q,
            min_steps=max(counters),
            where=where,
            sigma_divisors=shuffle,
        )
        if steps != count["history_steps"]:
            raise ValueError(
                f"{where}: the accountant history counts {steps} DP steps, but it counted {count['history_steps']} "
                "when the engine saved it: refusing an edited history"
            )
        return steps


def _stated(optimizer: Any, noise_multiplier: Any, engine_rate: Any, sample_rate: Any, where: str) -> tuple[Any, Any]:
    """The σ and q a resume is checked against: the optimizer's own σ and the engine's own loader rate. A stated
    ``noise_multiplier=`` / ``sample_rate=`` is used only where those are unknown, and refused where it disagrees."""
    own = getattr(optimizer, "noise_multiplier", None)
    for name, stated, known in (("noise_multiplier", noise_multiplier, own), ("sample_rate", sample_rate, engine_rate)):
        if stated is not None and known is not None and not math.isclose(float(stated), float(known), rel_tol=1e-12):
            raise ValueError(
                f"{where}: {name}={stated!r} was passed, but the run uses {known!r} (the "
                f"{'optimizer' if name == 'noise_multiplier' else 'loader make_private built'}'s own): the check "
                f"compares the checkpoint with what the run does, so drop {name}= or make the run match it"
            )
    return (own if own is not None else noise_multiplier), (engine_rate if engine_rate is not None else sample_rate)
