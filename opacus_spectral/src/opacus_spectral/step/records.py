"""What a denoiser receives: one record per noisy gradient tensor.

A record carries the noisy, scaled (and, under DDP, all-reduced) gradient and metadata only. It never
holds a ``Parameter``, ``grad_sample``, ``summed_grad`` (the clean clipped sum) or data: a denoiser sees
privatized data only (``docs/upstream.md`` §1.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

#: Roles the built-in role resolution assigns. Plugins may add their own strings.
ROLE_WEIGHT = "weight"  #: a >=2-D tensor that is not a LoRA factor (Linear/Conv1D/conv kernel)
ROLE_BIAS = "bias"  #: a 1-D (or 0-D) tensor: bias, LayerNorm scale, ...
ROLE_EMBEDDING = "embedding"  #: an nn.Embedding weight (rows = vocabulary)
ROLE_LORA_A = "lora_A"  #: LoRA down-projection A, shape (r, in_features)
ROLE_LORA_B = "lora_B"  #: LoRA up-projection B, shape (out_features, r)

#: What noise a record's tensor carries (``NoisyGradient.noise``; ``docs/math.md`` §4):
NOISE_ISOTROPIC = "isotropic"  #: i.i.d. Gaussian entries with the known per-entry std ``sigma`` (DP-SGD's noise)
NOISE_COLORED = "colored"  #: Gaussian but correlated across entries (e.g. after a spatial low-pass filter)
NOISE_UNKNOWN = "unknown"  #: changed by a denoiser that did not declare how (``sigma`` is then only indicative)
NOISE_KINDS = (NOISE_ISOTROPIC, NOISE_COLORED, NOISE_UNKNOWN)


class ParameterRole(NamedTuple):
    """The role of one parameter as told by a role plugin (``opacus_spectral_parameter_roles``)."""

    role: str
    layer: str | None = None  #: qualified name of the layer the parameter belongs to (e.g. LoRA base layer)


@dataclass(eq=False, slots=True)
class NoisyGradient:
    """One noisy gradient handed to a denoiser.

    Attributes:
        name: qualified parameter name in the user's model (no ``_module.`` wrapper prefix).
        role: ``"weight"``, ``"bias"``, ``"embedding"``, ``"lora_A"``, ``"lora_B"`` or a plugin's role.
        tensor: the noisy gradient G~ = G + s·Z (``docs/math.md`` §1.1). Edit it in place, or return a replacement.
        sigma: s, the per-entry standard deviation of the noise in ``tensor``: ``noise_std`` for the first
            denoiser, then as the earlier denoisers declared it (:meth:`~opacus_spectral.Denoiser.output_noise`).
        step: logical optimizer step (0-based) this gradient belongs to.
        layer: owning layer's qualified name when a role plugin knows it (LoRA pairs share it).
        noise: ``"isotropic"`` (i.i.d. entries of std ``sigma``: what RMT assumes), ``"colored"`` or
            ``"unknown"``; spectral denoisers act only on isotropic records.
    """

    name: str
    role: str
    tensor: torch.Tensor
    sigma: float
    step: int
    layer: str | None = None
    noise: str = NOISE_ISOTROPIC

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape
