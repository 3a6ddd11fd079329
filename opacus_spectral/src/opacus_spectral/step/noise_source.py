"""Where DP-SGD's randomness comes from: the Gaussian noise and the Poisson sample.

Opacus without ``secure_mode`` draws both from torch's global RNG, which anyone who knows the program's seed
(``torch.manual_seed``, a Trainer's ``TrainingArguments.seed``) can replay — and then subtract the noise.
:class:`NoiseSource` hands out fresh generators instead: seeded from OS entropy (``secrets``) by default, never
stored, saved or logged; or, when the user asks for it by name (``noise_seed=``), derived from that seed for
experiments, with a :class:`ReproducibleNoiseWarning` (``docs/engine.md``, "Noise, seeds and reproducibility").
"""

from __future__ import annotations

import hashlib
import secrets
import warnings
from typing import Any

import torch

from ..errors import ReproducibleNoiseWarning

__all__ = ["NoiseSource", "ReproducibleNoiseWarning", "parameter_device", "warn_reproducible"]

REPRODUCIBLE = (
    "noise_seed is set: the DP noise and the Poisson sample are a deterministic function of this seed, so the "
    "training is NOT differentially private against anyone who knows or guesses the seed (they can regenerate "
    "and subtract the noise). Use it for experiments and bit-exact comparisons only; leave noise_seed=None "
    "(the default, OS-entropy seeds) for models you release."
)


class NoiseSource:
    """Fresh ``torch.Generator`` objects for the noise (on the parameters' device) and the sampler (CPU).

    ``seed=None``: each generator is seeded with ``secrets.randbits(63)``. ``seed=<int>``: the i-th noise
    (sampler) generator is seeded from a hash of ``(seed, purpose, i, rank)``, so noise and sampling are separate
    streams, every ``make_private`` of one engine gets new ones, and DDP ranks sample independently.
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"noise_seed must be an int or None, got {seed!r} ({type(seed).__name__})")
        self._seed = seed
        self._drawn = {"noise": 0, "sampler": 0, "partition": 0}

    @property
    def reproducible(self) -> bool:
        """``True`` when generators come from the user's ``noise_seed`` (not private against its holder)."""
        return self._seed is not None

    def noise_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for the Gaussian noise, on ``device`` (Opacus draws with ``torch.normal(device=...)``)."""
        device = torch.device(device)
        if device.type == "meta":  # nothing is ever drawn on meta tensors; the doctor names the problem
            device = torch.device("cpu")
        return torch.Generator(device=device).manual_seed(self._next_seed("noise", 0))

    def partition_seed(self) -> int:
        """The seed of a cyclic-Poisson partition (``docs/mechanisms.md``): as secret as the sampler's (the ε holds for
        add/remove adjacency while the groups are unknown), saved with the DP state, the same on every DDP rank."""
        return self._next_seed("partition", 0)

    def sampler_generator(self, rank: int = 0) -> torch.Generator:
        """A CPU generator for the Poisson sample (Opacus' uniform samplers call ``torch.rand(generator=...)``)."""
        return torch.Generator().manual_seed(self._next_seed("sampler", rank))

    def reseed_for_resume(self, generator: torch.Generator, purpose: str, steps: int, rank: int = 0) -> None:
        """Move a generator this source handed out to a stream of its own for a run resumed after ``steps`` DP
        steps: with ``noise_seed`` a resumed run would otherwise replay the first steps' noise and batches (noise
        that the difference of two releases cancels). OS-entropy generators get fresh entropy."""
        if self._seed is None:
            generator.manual_seed(secrets.randbits(63))
            return
        tag = f"{self._seed}/{purpose}/resumed-at/{steps}/{rank}"
        generator.manual_seed(int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "big") >> 1)

    def _next_seed(self, purpose: str, rank: int) -> int:
        index = self._drawn[purpose]
        self._drawn[purpose] += 1
        if self._seed is None:
            return secrets.randbits(63)
        digest = hashlib.blake2b(f"{self._seed}/{purpose}/{index}/{rank}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1


def warn_reproducible(stacklevel: int = 3) -> None:
    warnings.warn(REPRODUCIBLE, ReproducibleNoiseWarning, stacklevel=stacklevel)


def parameter_device(optimizer: Any) -> torch.device:
    """The one device of the optimizer's parameters; several devices raise (one generator cannot serve them)."""
    inner = getattr(optimizer, "original_optimizer", optimizer)
    devices = {p.device for group in inner.param_groups for p in group["params"]}
    if len(devices) > 1:
        raise ValueError(
            f"the optimizer's parameters live on several devices ({sorted(map(str, devices))}): the DP noise is drawn "
            "from one generator on the parameters' device. Put the trainable parameters on one device, or pass "
            "noise_generator= yourself"
        )
    return next(iter(devices), torch.device("cpu"))
