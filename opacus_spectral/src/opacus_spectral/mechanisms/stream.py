"""The BandMF noise stream (``docs/mechanisms.md``): x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j}) / c_0 per tensor, from the
i.i.d. Gaussian z_t Opacus draws (:mod:`.bandmf_math`, Algorithm 9 of arXiv 2306.08153).

It keeps the b − 1 previous outputs of every tensor it has seen, on the tensor's device: (b − 1) × the trainable
parameters of memory. The buffers are as secret as the noise (with the released models they reveal clean
gradients): they are never saved, and a resumed run starts a fresh stream (M stays b-banded with unit columns, so the
ε is unchanged). With b = 1 (c_0 = 1) the stream returns z itself: DP-SGD, bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["BandStream"]


class _Ring:
    """One tensor's b − 1 previous outputs, flattened into the rows of one ``(b − 1, n)`` buffer (zeros before the
    stream has that many: x_{t−j} = 0 for t − j < 0), and the weights that line its rows up with c_1 … c_{b−1}. Kept in
    at least float32: coefficients rounded to a half type would put κ off 1 by ~2⁻⁸."""

    def __init__(self, coefficients: Sequence[float], z: torch.Tensor) -> None:
        k = len(coefficients) - 1
        dtype = torch.promote_types(z.dtype, torch.float32)
        self.rows = torch.zeros(k, z.numel(), dtype=dtype, device=z.device)
        c = torch.tensor(coefficients[1:], dtype=dtype, device=z.device)
        # weights[s, r] = c_j with j − 1 = (s − r) mod k: when x_{t−1} sits in row s, row r holds x_{t−j}
        rows = torch.arange(k, device=z.device)
        self.weights = c[(rows[:, None] - rows[None, :]) % k]
        self.newest = k - 1  # the row of x_{t−1}; the first output goes to row 0


class BandStream:
    """Correlates each tensor's noise across steps with coefficients ``c`` (κ = 1). ``advance(key, z)`` returns x_t for
    that tensor; call it once per step for every tensor, frozen ones included (their x_t is discarded by the caller).
    One step of one tensor is one matrix-vector product over its b − 1 buffers (no per-band kernel launches)."""

    def __init__(self, coefficients: Sequence[float]) -> None:
        c = [float(x) for x in coefficients]
        if not c or c[0] <= 0:
            raise ValueError(f"BandStream needs c_0 > 0, got {c}")
        self.coefficients = tuple(c)
        self._history: dict[Hashable, _Ring] = {}

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def advance(self, key: Hashable, z: torch.Tensor) -> torch.Tensor:
        """x_t for tensor ``key`` from this step's i.i.d. draw ``z``, in z's dtype (computed in at least float32)."""
        if self.bands == 1:  # x_t = z_t / c_0; c_0 = 1 is DP-SGD, bit for bit
            return z if self.coefficients[0] == 1.0 else z / self.coefficients[0]
        ring = self._history.get(key)
        if ring is None:
            ring = self._history[key] = _Ring(self.coefficients, z)
        # x_t = (z_t − Σ_j c_j x_{t−j}) / c_0, the sum as one product with the rows' weights
        flat = z.reshape(-1).to(ring.rows.dtype)
        x = torch.addmv(flat, ring.rows.t(), ring.weights[ring.newest], alpha=-1.0)
        x.div_(self.coefficients[0])
        ring.newest = (ring.newest + 1) % (self.bands - 1)
        ring.rows[ring.newest].copy_(x)
        return x.to(z.dtype).view_as(z)

    def reset(self) -> None:
        """Forget every buffer (a resumed run's fresh stream)."""
        self._history.clear()

    def memory_bytes(self) -> int:
        return sum(r.rows.numel() * r.rows.element_size() for r in self._history.values())
