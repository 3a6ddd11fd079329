"""The mechanism contract (``docs/mechanisms.md``, "Writing a mechanism"): what ``make_private(...,
noise_mechanism=...)`` accepts from a plugin — a *strategy*, never noise or accounting of its own.

A :class:`NoiseMechanism` answers one question, :meth:`NoiseMechanism.strategy`: the banded Toeplitz strategy
(:class:`~.strategy.BandedToeplitz`) for a run of ``steps`` steps at the loader's rate. The engine realizes it
(:mod:`.realization`): it draws the noise from its own generator, runs the stream, builds the cyclic Poisson sampler,
computes κ and charges the accountant, and certifies every step's released noise (:mod:`.certificate`). A subclass that
defines any of the old contract's members (``noise``, ``accounting``, ``sampler``, ...) is refused: the engine would
ignore them, and a plugin must not believe they matter.
"""

from __future__ import annotations

from typing import Any

from .strategy import BandedToeplitz

__all__ = ["FORBIDDEN", "GaussianMechanism", "NoiseMechanism", "check_contract"]

#: members of the old contract (a mechanism's own noise, sampler and accounting): a subclass defining one is refused
FORBIDDEN = (
    "noise",
    "accounting",
    "sampler",
    "std_factor",
    "end_step",
    "setup",
    "sample_rate_factor",
    "reset",
    "correlated",
    "kappa",
)


class NoiseMechanism:
    """The base: DP-SGD's strategy (c = (1,), one band: i.i.d. noise, Poisson sampling). Subclasses override
    :meth:`strategy` (and :meth:`describe` for their public settings), nothing else."""

    name = "gaussian"

    def strategy(self, *, steps: int | None, sample_rate: float, dataset_size: int) -> BandedToeplitz:
        """The strategy for a run of ``steps`` DP steps (``None``: not given) at the loader's rate ``sample_rate``
        = B/N over ``dataset_size`` records. Called by the engine once per ``make_private``."""
        return BandedToeplitz((1.0,))

    def describe(self) -> dict[str, Any]:
        """Public settings the privacy record and the DP state save (``{"name": ...}`` at least; no secrets)."""
        return {"name": self.name}


class GaussianMechanism(NoiseMechanism):
    """DP-SGD as Opacus does it (the default): i.i.d. N(0, (σC)²) per step, Poisson sampling."""


def check_contract(mechanism: Any) -> NoiseMechanism:
    """``mechanism`` itself, after checking it follows the contract: a :class:`NoiseMechanism` with a string name
    that defines none of :data:`FORBIDDEN` (``TypeError`` naming them otherwise)."""
    if not isinstance(mechanism, NoiseMechanism):
        raise TypeError(f"a noise mechanism must be a NoiseMechanism, got {type(mechanism).__name__}")
    name = getattr(mechanism, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"a noise mechanism's name must be an identifier string, got {name!r}")
    defined = sorted({m for k in type(mechanism).__mro__[:-1] for m in FORBIDDEN if m in vars(k)})
    defined += sorted(m for m in FORBIDDEN if m in vars(mechanism))
    if defined:
        raise TypeError(
            f"noise mechanism {name!r} ({type(mechanism).__name__}) defines {', '.join(defined)}: a mechanism "
            "contributes strategy() only — the engine draws the noise, builds the sampler and computes the accounting "
            "from the strategy itself (docs/mechanisms.md, 'Writing a mechanism')"
        )
    return mechanism
