"""Which records a denoiser acts on: role sets and parameter-name filters, validated the same way everywhere.

A denoiser declares a :class:`Selector` (its ``selector`` attribute); the pipeline applies it, once, for every
denoiser (the model is PEFT's ``check_target_module_exists``): a denoiser is handed only the records it selects.
A plain string is one entry (``roles="weight"`` is ``{"weight"}``, ``params="encoder"`` is ``("encoder",)``),
never a set of characters. A selector that matches none of the optimizer's parameters is reported once at
installation (:meth:`~opacus_spectral.step.pipeline.PostNoisePipeline.check_selection`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ParamFilter",
    "Selector",
    "declared_selector",
    "describe_param_filter",
    "resolve_param_filter",
    "resolve_roles",
]

#: ``params=``: a name substring, substrings (any match selects), or a predicate on the qualified name.
ParamFilter = str | Sequence[str] | Callable[[str], bool] | None


def resolve_roles(roles: str | Iterable[str] | None, default: Iterable[str]) -> frozenset[str]:
    """The role set of ``roles=``: ``None`` → ``default``; a string → that one role; else strings only."""
    if roles is None:
        return frozenset(default)
    if isinstance(roles, str):
        return frozenset((roles,))
    try:
        items = tuple(roles)
    except TypeError:
        raise TypeError(f"roles must be a role name or an iterable of role names, got {roles!r}") from None
    bad = [r for r in items if not isinstance(r, str)]
    if bad:
        raise TypeError(f"roles must be strings, got {bad!r} in {roles!r}")
    return frozenset(items)


def resolve_param_filter(params: ParamFilter) -> Callable[[str], bool]:
    """Turn ``params=`` into a predicate on qualified parameter names."""
    if params is None:
        return lambda name: True
    if isinstance(params, str):
        params = (params,)
    if callable(params):
        return params
    try:
        subs = tuple(params)
    except TypeError:
        subs = (params,)  # not iterable: reported below
    if not all(isinstance(p, str) for p in subs):
        raise TypeError(f"params must be a callable, a name substring or a list of them, got {params!r}")
    return lambda name: any(p in name for p in subs)


def describe_param_filter(params: ParamFilter) -> str:
    """How a selector is shown in messages (``params=('encoder',)``)."""
    if params is None:
        return "params=None"
    if isinstance(params, str):
        return f"params={(params,)!r}"
    if callable(params):
        return f"params={getattr(params, '__name__', type(params).__name__)}"
    return f"params={tuple(params)!r}"


@dataclass(frozen=True)
class Selector:
    """The records a denoiser acts on: a role set (``None``: every role) and a ``params=`` name filter.

    ``Selector()`` selects everything. Build one from user arguments with :meth:`build`; the constructor
    validates too (a string role is one role, a ``params=`` that is neither a substring, substrings nor a
    predicate is a ``TypeError``).
    """

    roles: frozenset[str] | None = None
    params: ParamFilter = None
    _name_matches: Callable[[str], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.roles is not None:
            object.__setattr__(self, "roles", resolve_roles(self.roles, ()))
        object.__setattr__(self, "_name_matches", resolve_param_filter(self.params))

    @classmethod
    def build(
        cls,
        roles: str | Iterable[str] | None = None,
        params: ParamFilter = None,
        default_roles: Iterable[str] | None = None,
    ) -> Selector:
        """From ``roles=``/``params=`` arguments: ``roles=None`` → ``default_roles`` (``None``: every role)."""
        if roles is None:
            return cls(None if default_roles is None else frozenset(default_roles), params)
        return cls(resolve_roles(roles, ()), params)

    def matches(self, name: str, role: str) -> bool:
        """Whether the parameter ``name`` with ``role`` is selected."""
        return (self.roles is None or role in self.roles) and bool(self._name_matches(name))

    @property
    def everything(self) -> bool:
        """Whether it selects every record (no role set, no name filter)."""
        return self.roles is None and self.params is None

    def __str__(self) -> str:
        roles = "all roles" if self.roles is None else f"roles={sorted(self.roles)}"
        return f"{roles}, {describe_param_filter(self.params)}"


def declared_selector(d: object) -> Selector | None:
    """The :class:`Selector` the pipeline applies for the denoiser ``d`` (its ``selector`` attribute); ``None`` hands
    it every record (a plain callable declares none)."""
    selector = getattr(d, "selector", None)
    return selector if isinstance(selector, Selector) else None
