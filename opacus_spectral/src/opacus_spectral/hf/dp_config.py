"""``DPTrainingArguments``: :class:`~opacus_spectral.hf.dp_trainer.DPTrainer`'s settings as ``TrainingArguments``
fields (user guide: ``docs/trainer.md``, "The arguments").

Parsed by ``HfArgumentParser`` like any ``TrainingArguments`` subclass, and saved with the run (``training_args.bin``,
``to_json_string``, the ``report_to`` integrations, which read ``to_dict``) — except the secrets: ``noise_seed``
regenerates the noise and the Poisson sample, so every saved or printed form carries :data:`REDACTED_NOISE_SEED`
instead, and a denoiser *object* in ``post_hooks`` (code, perhaps with state) is saved as a ``"<object: name>"``
marker. Arguments read back from such a form refuse to train until the seed or the object is given again.

No field shadows a ``TrainingArguments`` field with another meaning: the per-example clipping bound is
``per_sample_max_grad_norm``; the Trainer's own ``max_grad_norm`` (clipping of the batch gradient) defaults to 0 here
and any other value is refused (DP-SGD clips each example instead).
"""

import copy
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments

from ..denoisers.base import denoiser_name
from ..plugins.registry import get_registry
from .loss import TASKS
from .mechanism import check_mechanism, mechanism_spec, read_mechanism

__all__ = ["MODES", "REDACTED_NOISE_SEED", "SETTINGS", "DPTrainingArguments", "check_dp_settings"]

REDACTED_NOISE_SEED = "<NOISE_SEED>"
MODES = ("hooks", "functorch", "ghost")  #: grad_sample_mode
#: the values of ``doctor`` and ``batch_check`` (``True`` reads ``"raise"``, ``False`` ``"off"``)
SETTINGS = ("raise", "warn", "off")
#: make_private arguments DPTrainer sets itself
_SET_BY_TRAINER = (
    "module",
    "optimizer",
    "data_loader",
    "noise_multiplier",
    "wrap_model",
    "max_grad_norm",
    "poisson_sampling",
    "grad_sample_mode",
    "criterion",
    "post_hooks",
    "doctor",
    "batch_check",
    "noise_mechanism",
    "steps",
    "epochs",
)


@dataclass
class DPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus DPTrainer's differential-privacy settings (the fields below)."""

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "make_private_kwargs"]

    target_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "The privacy budget: the noise multiplier is calibrated so that the run's steps end within "
            "it; with a noise_multiplier, training stops at the last step within it."
        },
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "Required: the delta of the guarantee, in (0, 1/len(train_dataset))."}
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "Noise std / per_sample_max_grad_norm; None calibrates it from target_epsilon."},
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "C: each example's gradient is clipped to this norm before the noise is added."}
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={
            "help": "The Trainer's clipping of the batch gradient: must stay 0 under DP-SGD, which clips "
            "each example's gradient to per_sample_max_grad_norm instead."
        },
    )
    post_hooks: list[str] | None = field(
        default=None,
        metadata={
            "help": "Denoisers run on the noisy gradient of each step, in order: registered names, "
            "(name, {kwargs}) pairs (on the command line a JSON pair '[\"rmt\", {...}]') or denoiser objects."
        },
    )
    noise_mechanism: dict | str | None = field(
        default="gaussian",
        metadata={
            "help": "What is added to the clipped sum each step: 'gaussian' (DP-SGD), 'bandmf' (4 bands), or a JSON "
            'object \'{"name": "bandmf", "bands": 4}\' (docs/mechanisms.md).'
        },
    )
    grad_sample_mode: str = field(default="hooks", metadata={"help": "Per-example gradients.", "choices": list(MODES)})
    accountant: str = field(
        default="prv",
        metadata={"help": "prv or rdp (upper bounds); gdp is an approximation.", "choices": ["prv", "rdp", "gdp"]},
    )
    secure_mode: bool = field(default=False, metadata={"help": "Opacus' torchcsprng for the noise and the sample."})
    noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "None: noise and Poisson sample from OS entropy. An int: a reproducible run that is NOT "
            "private against whoever knows it (never saved, printed or logged)."
        },
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": "Each example's loss; None: from the PEFT task_type and the model class.",
            "choices": list(TASKS),
        },
    )
    doctor: str = field(
        default="raise", metadata={"help": "The doctor's silent-failure checks.", "choices": list(SETTINGS)}
    )
    alternation: bool = field(
        default=True,
        metadata={
            "help": "Let an installed plugin (peft-lalora) attach its alternation controller to a model that "
            "carries its adapter."
        },
    )
    release_nonprivate_stats: bool = field(
        default=False, metadata={"help": "Also log the loss, token and FLOP counts and timing (NOT private)."}
    )
    make_private_kwargs: dict | str | None = field(
        default=None, metadata={"help": 'Further make_private arguments, e.g. \'{"on_denoiser_error": "skip"}\'.'}
    )
    new_privacy_unit: bool = field(
        default=False,
        metadata={"help": "The data are another privacy unit than the model's earlier DP runs': epsilon from 0."},
    )
    batch_check: str = field(
        default="raise",
        metadata={
            "help": "Before the first step, check that no record's gradient depends on the other records of its batch.",
            "choices": list(SETTINGS),
        },
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> "DPTrainingArguments":
        """Refuse a keyword that names no field, with the closest field names (a ``TypeError``, as ``__init__``'s)."""
        _check_keywords(cls, kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.doctor, self.batch_check = _setting("doctor", self.doctor), _setting("batch_check", self.batch_check)
        self.post_hooks = _post_hooks(self.post_hooks)
        self.noise_mechanism = read_mechanism(self.noise_mechanism)
        check_dp_settings(self)

    # -- what leaves the process: no secrets ------------------------------------------------------------
    def _public(self) -> dict[str, Any]:
        seed = None if self.noise_seed is None else REDACTED_NOISE_SEED
        hooks = self.post_hooks
        saved = None if hooks is None else [h if isinstance(h, str | tuple) else _object_marker(h) for h in hooks]
        return {"noise_seed": seed, "post_hooks": saved}

    def to_dict(self) -> dict[str, Any]:
        """``TrainingArguments.to_dict`` (what ``to_json_string`` and the integrations read), without secrets."""
        return {**super().to_dict(), **self._public()}

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (``training_args.bin``) saves: the fields without secrets."""
        return {**self.__dict__, **self._public()}

    def __copy__(self) -> "DPTrainingArguments":
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)  # a copy in this process keeps the seed (pickling does not)
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> "DPTrainingArguments":
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def __str__(self) -> str:
        shown = "".join(f"{k}={v},\n" for k, v in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{shown})"

    __repr__ = __str__


def _check_keywords(cls: type, kwargs: Mapping[str, Any]) -> None:
    """``TypeError`` naming each keyword of ``kwargs`` that is no ``__init__`` field of ``cls``, with a "did you
    mean" of the closest field names (:func:`difflib.get_close_matches`) where there are any."""
    names = [f.name for f in fields(cls) if f.init]
    unknown = [k for k in kwargs if k not in names]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=3)
        parts.append(f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    raise TypeError(
        f"{cls.__name__} got unexpected keyword argument{'s' * (len(unknown) > 1)} {', '.join(parts)}; its fields "
        'are TrainingArguments\' and the DP settings of docs/trainer.md, "The arguments"'
    )


def _setting(name: str, value: Any) -> str:
    """``doctor`` / ``batch_check``: one of :data:`SETTINGS` (``True`` → ``"raise"``, ``False`` → ``"off"``)."""
    if value is True or value is False:
        return "raise" if value else "off"
    if value not in SETTINGS:
        raise ValueError(f"{name} must be one of {SETTINGS}, got {value!r}")
    return value


def _object_marker(obj: object) -> str:
    return f"<object: {denoiser_name(obj)}>"


def _post_hooks(hooks: Any) -> list[Any] | None:
    """The ``post_hooks`` list with every ``(name, kwargs)`` pair as a tuple: a JSON pair from the command line, or
    a ``[name, kwargs]`` list read back from ``to_json_string``."""
    if hooks is None:
        return None
    if isinstance(hooks, str | tuple) or callable(hooks) or not isinstance(hooks, list):
        raise TypeError(f"post_hooks must be a list, e.g. post_hooks=['rmt'], got {hooks!r}")
    return [_pair(h) for h in hooks]


def _pair(item: Any) -> Any:
    if isinstance(item, str) and item.lstrip().startswith("["):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"post_hooks item {item!r} is not a JSON [name, {{kwargs}}] pair: {exc}") from exc
    if isinstance(item, list | tuple):
        if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], Mapping):
            raise TypeError(f"post_hooks item {item!r} must be (name, {{kwargs}})")
        return (item[0], dict(item[1]))
    return item


def check_dp_settings(a: "DPTrainingArguments") -> None:
    """Raise naming the DP setting of ``a`` that cannot work on its own (before any model or data): run when the
    arguments are built and again when a DPTrainer is (arguments read from a file skip ``__post_init__``)."""
    if a.noise_seed == REDACTED_NOISE_SEED:
        raise ValueError(
            "noise_seed was redacted when these arguments were saved (whoever knows it can regenerate the noise): "
            "pass noise_seed=<int> again, or None for noise from OS entropy"
        )
    if a.noise_seed is not None and (isinstance(a.noise_seed, bool) or not isinstance(a.noise_seed, int)):
        raise TypeError(f"noise_seed must be an int or None, got {a.noise_seed!r}")
    for hook in a.post_hooks or []:
        if isinstance(hook, str) and hook.startswith("<object: "):
            raise ValueError(
                f"post_hooks item {hook!r} stands for a denoiser object, which is not saved with the arguments: "
                "pass the object again"
            )
    _check_noise_settings(a)
    check_mechanism(a.noise_mechanism)
    _check_hub_checkpoints(a)
    _check_make_private_kwargs(a.make_private_kwargs)


def _check_hub_checkpoints(a: "DPTrainingArguments") -> None:
    """A cyclic-Poisson mechanism's partition seed is in every checkpoint's DP state (a resume needs it); pushing
    checkpoints to a public repository would publish it, and its ε then holds for zero-out adjacency only
    (``docs/mechanisms.md``, "Adjacency")."""
    spec = mechanism_spec(a.noise_mechanism)
    if spec is None or not a.push_to_hub or a.hub_private_repo:
        return
    strategy = str(getattr(a.hub_strategy, "value", a.hub_strategy))
    mechanism = get_registry().create_mechanism(spec)
    # a strategy's bands are known once the run's length is: a mechanism that does not state one band (bandmf's
    # ``bands``) is taken to sample in groups
    if strategy in ("checkpoint", "all_checkpoints") and getattr(mechanism, "bands", None) != 1:
        raise ValueError(
            f"push_to_hub with hub_strategy={strategy!r} uploads the checkpoints, whose DP state holds the "
            f"{mechanism.name} partition seed: with the record-to-group assignment public the ε holds for zero-out "
            "adjacency only. Use hub_strategy='end' or 'every_save' (the model, not the checkpoints), or "
            "hub_private_repo=True"
        )


def _check_noise_settings(a: "DPTrainingArguments") -> None:
    if a.target_delta is None or not 0 < a.target_delta < 1:
        raise ValueError(f"target_delta in (0, 1) is required (the δ of the guarantee), got {a.target_delta}")
    if a.target_epsilon is None and a.noise_multiplier is None:
        raise ValueError("give target_epsilon (the noise multiplier is calibrated from it) or noise_multiplier")
    if a.target_epsilon is not None and not a.target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {a.target_epsilon}")
    if a.target_epsilon is not None and a.noise_multiplier == 0:
        raise ValueError(
            "noise_multiplier=0 spends epsilon = inf at the first step, so no target_epsilon can hold: "
            "drop target_epsilon for a non-private reference run, or give a noise_multiplier > 0"
        )
    bound = a.per_sample_max_grad_norm
    if isinstance(bound, bool) or not isinstance(bound, int | float) or not (math.isfinite(bound) and bound > 0):
        raise ValueError(
            f"per_sample_max_grad_norm (the per-example clipping bound C) must be finite and > 0, got {bound!r}: "
            "the noise std is noise_multiplier·C, so C sets the privacy guarantee"
        )
    if a.max_grad_norm:
        raise ValueError(
            f"max_grad_norm={a.max_grad_norm} is the Trainer's clipping of the batch gradient, which DP-SGD does not "
            "use (it would also release the clean gradient's norm): leave it at 0 and set the per-example bound "
            "with per_sample_max_grad_norm"
        )
    if a.grad_sample_mode not in MODES:
        raise ValueError(f"grad_sample_mode must be one of {MODES}, got {a.grad_sample_mode!r}")


def _check_make_private_kwargs(kwargs: Any) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"make_private_kwargs must be a dict (or a JSON object string), got {kwargs!r}")
    if "noise_generator" in kwargs:
        raise ValueError(
            "make_private_kwargs may not set noise_generator: DPTrainer draws the noise from its engine's "
            "generators; set noise_seed for a reproducible run"
        )
    taken = set(kwargs) & set(_SET_BY_TRAINER)
    if taken:
        raise ValueError(f"make_private_kwargs may not set {sorted(taken)}: DPTrainer sets them")
