"""Which records a denoiser acts on: role sets and parameter-name filters, validated the same way everywhere.

A plain string is one entry (``roles="weight"`` is ``{"weight"}``, ``params="encoder"`` is ``("encoder",)``),
never a set of characters. A selector that matches none of the optimizer's parameters is reported once at
installation (:meth:`~opacus_spectral.pipeline.PostNoisePipeline.check_selection`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["ParamFilter", "describe_param_filter", "resolve_param_filter", "resolve_roles"]

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
    subs = tuple(params)
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
