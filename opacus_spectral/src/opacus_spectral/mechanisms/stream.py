"""The BandMF noise stream (``docs/mechanisms.md``): x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j}) / c_0 per tensor, from the
i.i.d. Gaussian z_t Opacus draws (:mod:`.bandmf_math`, Algorithm 9 of arXiv 2306.08153).

It keeps the b − 1 previous outputs of every tensor it has seen, on the tensor's device: (b − 1) × the trainable
parameters of memory. The buffers are as secret as the noise (with the released models they reveal clean
gradients): they are never saved, and a resumed run starts a fresh stream (M stays b-banded with unit columns, so the
ε is unchanged). With b = 1 (c_0 = 1) the stream returns z itself: DP-SGD, bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

import torch

__all__ = ["BandStream"]


class BandStream:
    """Correlates each tensor's noise across steps with coefficients ``c`` (κ = 1). ``advance(key, z)`` returns x_t for
    that tensor; call it once per step for every tensor, frozen ones included (their x_t is discarded by the caller)."""

    def __init__(self, coefficients: Sequence[float]) -> None:
        c = [float(x) for x in coefficients]
        if not c or c[0] <= 0:
            raise ValueError(f"BandStream needs c_0 > 0, got {c}")
        self.coefficients = tuple(c)
        self._history: dict[Hashable, deque[torch.Tensor]] = {}

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def advance(self, key: Hashable, z: torch.Tensor) -> torch.Tensor:
        """x_t for tensor ``key`` from this step's i.i.d. draw ``z`` (float math in z's dtype)."""
        if self.bands == 1:
            return z
        past = self._history.setdefault(key, deque(maxlen=self.bands - 1))
        x = z.clone()
        for j, previous in enumerate(past, start=1):  # past[0] is x_{t−1}
            x.sub_(previous, alpha=self.coefficients[j])
        x.div_(self.coefficients[0])
        past.appendleft(x)
        return x

    def reset(self) -> None:
        """Forget every buffer (a resumed run's fresh stream)."""
        self._history.clear()

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for past in self._history.values() for t in past)
