"""``"softshrink"``: entry-wise soft thresholding of the noisy gradient at ``threshold`` times its noise std.

For a released gradient entry ``g`` with per-entry noise std ``s`` (``record.sigma``):
``out = sign(g) · max(|g| − threshold·s, 0)`` — the soft-threshold estimator of a sparse signal in Gaussian noise
(Donoho & Johnstone, 1994). Post-processing: it only sees the privatized gradient and costs no privacy budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opacus_spectral import Denoiser, NoisyGradient, hookimpl

__all__ = ["SoftShrinkDenoiser", "opacus_spectral_denoisers"]


class SoftShrinkDenoiser(Denoiser):
    """Soft thresholding of every record at ``threshold · s``; publishes how many entries it set to zero."""

    name = "softshrink"
    needs_isotropic_noise = True  # the threshold is in units of the per-entry noise std s

    def __init__(self, threshold: float = 1.0) -> None:
        super().__init__()
        if not threshold >= 0:
            raise ValueError(f"softshrink: threshold must be >= 0 (a multiple of the noise std), got {threshold!r}")
        self.threshold = float(threshold)

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        zeroed, entries = [], 0
        for g in grads:
            if g.sigma <= 0:  # no noise on this record: nothing to remove
                out.append(None)
                continue
            shrunk = torch.nn.functional.softshrink(g.tensor, lambd=self.threshold * g.sigma)
            zeroed.append((shrunk == 0).sum())  # a tensor: no device sync per matrix
            entries += shrunk.numel()
            out.append(shrunk)
        # published every step in the engine's diagnostics (tensors are fine; the engine never syncs them)
        self.stats = {"zeroed": torch.stack(zeroed).sum() if zeroed else 0, "entries": entries}
        return out


@hookimpl
def opacus_spectral_denoisers():
    """The hook opacus-spectral calls through the entry point: the denoisers this distribution provides."""
    return {"softshrink": SoftShrinkDenoiser}
