"""The plugin registry: denoisers and role providers loaded from the ``opacus_spectral`` entry points.

Built-ins register through the same entry-point group as third parties. Loading is guarded per plugin:
pluggy's ``load_setuptools_entrypoints`` stops at the first broken plugin (``docs/upstream.md`` §3.1), so
entry points are iterated here, and each plugin is imported, registered and called inside its own guard (a
failure is one warning plus a :class:`LoadError` in :func:`load_errors`; the other plugins still load). The
guard catches every ``BaseException`` but ``KeyboardInterrupt`` — a plugin calling ``sys.exit()`` at import
does not end the host.
A hook implementation whose name matches no hookspec (a typo such as ``opacus_spectral_denoiser``) is
reported as a load error (pluggy's ``check_pending`` rule, per plugin); answers of the wrong shape (a role
that is not a string or a ``(role, layer)`` pair) drop that plugin's answer, with a load error.
A factory that raises (or returns something that is not callable) when ``post_hooks`` is built gives a
:class:`DenoiserBuildError` naming the denoiser, its plugin and distribution, chained to the factory's error.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import inspect
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
from torch import nn

from .. import hookspecs
from ..denoisers.base import DenoiserProtocol
from ..errors import DenoiserBuildError
from ..step.records import ParameterRole

ENTRY_POINT_GROUP = "opacus_spectral"

#: one item of ``post_hooks``: a registered denoiser name, a ``(name, kwargs)`` pair or a denoiser callable
DenoiserSpec = str | tuple[str, Mapping[str, Any]] | DenoiserProtocol


@dataclass(frozen=True)
class DenoiserInfo:
    """A denoiser available by name."""

    name: str
    factory: Callable[..., Any]
    plugin: str  #: plugin (entry point) name
    distribution: str | None  #: distribution that installed the entry point (None: registered at runtime)


@dataclass(frozen=True)
class LoadError:
    """Why a plugin (or one of its hooks) was skipped."""

    plugin: str
    distribution: str | None
    stage: str  #: "import", "register", "denoisers" or "roles"
    error: str


class Registry:
    """A pluggy ``PluginManager`` plus per-plugin guarded loading and the merged denoiser table."""

    def __init__(self, group: str = ENTRY_POINT_GROUP, entry_points: Callable[[], Iterable[Any]] | None = None):
        self.group = group
        self._entry_points = entry_points or (lambda: md.entry_points(group=group))
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._dist: dict[str, str | None] = {}
        self._errors: list[LoadError] = []
        self._denoisers: dict[str, DenoiserInfo] | None = None
        self._mechanisms: dict[str, DenoiserInfo] | None = None
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading ---------------------------------------------------------------------------------------
    def load(self) -> None:
        """Import and register every entry point of the group once (idempotent)."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True

            def order(ep: Any) -> tuple[bool, str]:  # built-ins first, so a plugin can never shadow them
                return (getattr(getattr(ep, "dist", None), "name", None) != "opacus-spectral", ep.name)

            for ep in sorted(self._entry_points(), key=order):
                dist = getattr(getattr(ep, "dist", None), "name", None)
                try:
                    plugin = ep.load()
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # noqa: BLE001 - any plugin failure (even sys.exit) must not break the host
                    self._fail(ep.name, dist, "import", exc)
                    continue
                self.register(plugin, name=ep.name, distribution=dist)

    def register(self, plugin: object, *, name: str, distribution: str | None = None) -> bool:
        """Register a plugin object/module at runtime (tests, notebooks). Returns False if it was refused."""
        with self._lock:
            try:
                self.pm.register(plugin, name=name)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - pluggy.PluginValidationError, ValueError (dup name), ...
                self._fail(name, distribution, "register", exc)
                return False
            self._dist[name] = distribution
            self._denoisers = self._mechanisms = None
            for unknown in self._unknown_hooks(plugin):
                self._fail(
                    name,
                    distribution,
                    "register",
                    LookupError(
                        f"unknown hook {unknown!r} (no such hookspec in opacus_spectral.hookspecs; a typo?) — ignored"
                    ),
                )
            return True

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """Names of ``plugin``'s hook implementations that match no hookspec (and are not ``optionalhook``)."""
        unknown = []
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.has_spec():
                continue
            if any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls()):
                unknown.append(caller.name)
        return sorted(unknown)

    def unregister(self, name: str) -> None:
        with self._lock:
            self.pm.unregister(name=name)
            self._dist.pop(name, None)
            self._denoisers = self._mechanisms = None

    def _fail(self, plugin: str, dist: str | None, stage: str, exc: BaseException) -> None:
        err = LoadError(plugin, dist, stage, f"{type(exc).__name__}: {exc}")
        self._errors.append(err)
        src = f" (distribution {dist})" if dist else ""
        warnings.warn(
            f"opacus_spectral: skipping plugin {plugin!r}{src} at {stage}: {err.error}", RuntimeWarning, stacklevel=3
        )

    def _impls(self, hook_name: str) -> list[Any]:
        """One hook's implementations, oldest registration first — the one order every hook is called in (pluggy
        *calls* them LIFO; we don't)."""
        self.load()
        return list(getattr(self.pm.hook, hook_name).get_hookimpls())

    def first_answer(self, hook_name: str, **kwargs: Any) -> Any | None:
        """The first non-``None`` answer of a ``firstresult`` hook, oldest registration first. Not guarded: the hook's
        exception is the implementation refusing the set-up it was asked about, and reaches the caller."""
        for impl in self._impls(hook_name):
            res = impl.function(**{a: kwargs[a] for a in impl.argnames})
            if res is not None:
                return res
        return None

    def _call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call one hook's implementations one by one, oldest registration first, each guarded."""
        results: list[tuple[str, Any]] = []
        for impl in self._impls(hook_name):
            plugin_name = impl.plugin_name
            try:
                res = impl.function(**{a: kwargs[a] for a in impl.argnames})
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - same guard as loading
                self._fail(plugin_name, self._dist.get(plugin_name), hook_name.rsplit("_", 1)[-1], exc)
                continue
            if res is not None:
                results.append((plugin_name, res))
        return results

    def _is_builtin(self, plugin_name: str) -> bool:
        """Whether ``plugin_name`` is this library's own built-ins module (however it was registered)."""
        from . import builtins  # noqa: PLC0415 - the built-ins module imports this one's package

        return self.pm.get_plugin(plugin_name) is builtins

    # -- denoisers -------------------------------------------------------------------------------------
    def denoisers(self) -> dict[str, DenoiserInfo]:
        with self._lock:
            if self._denoisers is None:
                self._denoisers = self._table("opacus_spectral_denoisers", "denoiser")
            return dict(self._denoisers)

    def mechanisms(self) -> dict[str, DenoiserInfo]:
        """The noise mechanisms the plugins provide (``opacus_spectral_noise_mechanisms``), ``{name: info}``."""
        with self._lock:
            if self._mechanisms is None:
                self._mechanisms = self._table("opacus_spectral_noise_mechanisms", "noise mechanism")
            return dict(self._mechanisms)

    def _table(self, hook_name: str, kind: str) -> dict[str, DenoiserInfo]:
        """``{name: factory}`` answers of one hook, each checked; a duplicate name is a load error naming both
        sources, and the first is kept — the built-ins' first whatever the import or registration order, so no
        plugin can replace a built-in name."""
        stage = hook_name.removeprefix("opacus_spectral_")
        table: dict[str, DenoiserInfo] = {}
        answers = sorted(self._call_each(hook_name), key=lambda answer: not self._is_builtin(answer[0]))
        for plugin_name, provided in answers:
            dist = self._dist.get(plugin_name)
            if not isinstance(provided, Mapping):
                self._fail(plugin_name, dist, stage, TypeError("hook must return {name: factory}"))
                continue
            for name, factory in provided.items():
                if not isinstance(name, str) or not callable(factory):
                    self._fail(plugin_name, dist, stage, TypeError(f"bad entry {name!r}: {factory!r}"))
                elif name in table:
                    other = table[name]
                    self._fail(
                        plugin_name,
                        dist,
                        stage,
                        ValueError(
                            f"{kind} name {name!r} is provided by plugin {other.plugin!r} "
                            f"({_source(other.distribution)}) and by plugin {plugin_name!r} ({_source(dist)}): "
                            f"{other.plugin!r}'s is kept"
                            + (" (a built-in name cannot be replaced)" if self._is_builtin(other.plugin) else "")
                        ),
                    )
                else:
                    table[name] = DenoiserInfo(name, factory, plugin_name, dist)
        return table

    def create_mechanism(self, spec: Any) -> Any:
        """Build the noise mechanism of ``make_private(noise_mechanism=spec)``: a registered name, ``(name, kwargs)``
        or a :class:`~opacus_spectral.mechanisms.base.NoiseMechanism` object."""
        from ..mechanisms.base import NoiseMechanism  # noqa: PLC0415 - the mechanisms import torch

        if isinstance(spec, NoiseMechanism):
            return spec
        if isinstance(spec, str):
            name, kwargs = spec, {}
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
            name, kwargs = spec[0], dict(spec[1])
        else:
            raise TypeError(f"noise_mechanism must be a name, (name, {{kwargs}}) or a NoiseMechanism, got {spec!r}")
        table = self.mechanisms()
        if name not in table:
            guess = _closest(name, table)
            hint = f". Did you mean {guess!r}?" if guess else ""
            raise ValueError(f"unknown noise mechanism {name!r}; available: {', '.join(sorted(table)) or 'none'}{hint}")
        mechanism = _build(table[name], kwargs, kind="noise mechanism")
        if not isinstance(mechanism, NoiseMechanism):
            raise DenoiserBuildError(f"noise mechanism {name!r} built {mechanism!r}, not a NoiseMechanism")
        return mechanism

    def errors(self) -> list[LoadError]:
        self.load()
        return list(self._errors)

    def create(self, spec: DenoiserSpec) -> DenoiserProtocol:
        """Build one denoiser from a ``post_hooks`` item: a name, ``(name, kwargs)`` or an instance."""
        if isinstance(spec, str):
            name, kwargs = spec, {}
        elif isinstance(spec, tuple):
            if len(spec) != 2 or not isinstance(spec[0], str) or not isinstance(spec[1], Mapping):
                raise TypeError(f"post_hooks item {spec!r} must be (name, {{kwargs}})")
            name, kwargs = spec[0], dict(spec[1])
        elif isinstance(spec, type):
            raise TypeError(f"post_hooks item {spec.__name__} is a class; pass an instance or a registered name")
        elif callable(spec):
            return spec
        else:
            raise TypeError(f"post_hooks items are names, (name, kwargs) pairs or callables; got {spec!r}")
        table = self.denoisers()
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            hint = ""
            broken = [e.plugin for e in self._errors]
            if broken:
                hint = f"; plugins that failed to load: {', '.join(sorted(set(broken)))}"
            guess = _closest(name, table)
            hint += f". Did you mean {guess!r}?" if guess else ""
            raise ValueError(f"unknown denoiser {name!r}; available: {known}{hint}")
        return _build(table[name], kwargs)

    # -- roles -----------------------------------------------------------------------------------------
    def roles(self, module: nn.Module) -> dict[str, ParameterRole]:
        """Merge every plugin's role answer; the first-registered plugin wins on a conflict (with a warning).

        A malformed answer (not a mapping, or an entry that is neither a role string nor a ``(role, layer)``
        pair of strings) drops that plugin's whole answer, with a load error: half an answer is worse than none.
        """
        merged: dict[str, tuple[ParameterRole, str]] = {}
        for plugin_name, answer in self._call_each("opacus_spectral_parameter_roles", module=module):
            try:
                parsed = _parse_roles(answer)
            except (TypeError, ValueError) as exc:
                self._fail(plugin_name, self._dist.get(plugin_name), "roles", exc)
                continue
            for pname, role in parsed.items():
                if pname in merged and merged[pname][0] != role:
                    warnings.warn(
                        f"opacus_spectral: plugins {merged[pname][1]!r} and {plugin_name!r} disagree on the role of "
                        f"{pname!r} ({merged[pname][0].role} vs {role.role}); keeping the first",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                merged.setdefault(pname, (role, plugin_name))
        return {k: v[0] for k, v in merged.items()}


def _parse_roles(answer: Any) -> dict[str, ParameterRole]:
    """A role hook's answer as ``{name: ParameterRole}``; ``TypeError`` naming the first bad entry."""
    if not isinstance(answer, Mapping):
        raise TypeError(f"hook must return a mapping {{param name: role}}, got {type(answer).__name__}")
    out: dict[str, ParameterRole] = {}
    for pname, role in answer.items():
        if isinstance(role, str):
            role = (role,)
        ok = (
            isinstance(pname, str)
            and isinstance(role, tuple)
            and len(role) in (1, 2)
            and isinstance(role[0], str)
            and (len(role) == 1 or role[1] is None or isinstance(role[1], str))
        )
        if not ok:
            raise TypeError(f"bad role entry {pname!r}: {role!r} (expected a role string or a (role, layer) pair)")
        out[pname] = ParameterRole(*role)
    return out


def _closest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name closest to a misspelt one (``None``: none is close)."""
    close = difflib.get_close_matches(name, sorted(valid), n=1)
    return close[0] if close else None


def factory_keywords(factory: Callable[..., Any]) -> list[str] | None:
    """The keywords a denoiser factory takes, from its signature; ``None`` when it takes any (``**kwargs``) or has
    no signature to read."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _build(info: DenoiserInfo, kwargs: Mapping[str, Any], *, kind: str = "denoiser") -> Any:
    """``info.factory(**kwargs)``; a keyword the factory does not take, and any failure (``sys.exit()`` too), as a
    :class:`DenoiserBuildError`."""
    src = f"plugin {info.plugin!r}" + (f", distribution {info.distribution!r}" if info.distribution else "")
    where = f"building {kind} {info.name!r} ({src}) with {dict(kwargs)!r}"
    valid = factory_keywords(info.factory)
    unknown = sorted(set(kwargs) - set(valid)) if valid is not None else []
    if valid is not None and unknown:
        guess = _closest(unknown[0], valid)
        text = f"{where}: {info.name!r} has no keyword {unknown[0]!r}" + (
            f"; did you mean {guess!r}?" if guess else "."
        )
        raise DenoiserBuildError(f"{text} Its keywords: {', '.join(valid)}")
    try:
        denoiser = info.factory(**kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a plugin's factory must not end the host
        raise DenoiserBuildError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if kind == "denoiser" and (not callable(denoiser) or isinstance(denoiser, type)):
        raise DenoiserBuildError(f"{where} returned {denoiser!r}, not a denoiser (a callable on the records)")
    return denoiser


_default: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (loaded lazily from the installed entry points)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry()
        return _default


def reload_registry() -> Registry:
    """Forget the process-wide registry and load the entry points afresh (after ``pip install`` of a plugin)."""
    global _default
    with _default_lock:
        _default = None
    return get_registry()


def available_denoisers() -> dict[str, DenoiserInfo]:
    """Denoisers available by name, with the plugin and distribution that provide them."""
    return get_registry().denoisers()


def load_errors() -> list[LoadError]:
    """Plugins (or hooks) that were skipped, and why."""
    return get_registry().errors()


def alternation_controller(trainer: Any) -> Any | None:
    """The alternation controller a plugin attaches to ``trainer`` (the ``opacus_spectral_alternation_controller``
    hook), or ``None``: :meth:`Registry.first_answer`, in the order every hook is called in; a controller refusing the
    set-up raises to the user."""
    return get_registry().first_answer("opacus_spectral_alternation_controller", trainer=trainer)


def create_denoisers(hooks: Sequence[DenoiserSpec] | None, registry: Registry | None = None) -> list[DenoiserProtocol]:
    """Build the denoisers of a ``post_hooks`` list, keeping the user's order (never pluggy's LIFO order)."""
    if hooks is None:
        return []
    if isinstance(hooks, (str, tuple)) or callable(hooks):
        raise TypeError("post_hooks must be a list, e.g. post_hooks=['rmt']")
    reg = registry or get_registry()
    return [reg.create(h) for h in hooks]


def _source(distribution: str | None) -> str:
    return f"distribution {distribution}" if distribution else "registered at run time"
