"""Spectrum reports on gradients: spectral entropy, an oracle cosine report, and a spectrum plot.

These run off the hot path (benchmarks, notebooks, ``RMTDenoiser(per_matrix_stats=True)``). :func:`cosine_report`
needs the clean clipped gradient, which only an oracle/benchmark setting has — never feed it back into training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..step.oracle import cosine
from .rmt.spectral import bulk_edge

__all__ = ["cosine_report", "plot_spectrum", "spectral_entropy"]

Tensors = Mapping[str, Tensor] | Sequence[Tensor]


def spectral_entropy(singular_values: Tensor, normalized: bool = False) -> Tensor:
    """Shannon entropy of the energy distribution ``p_i = λ_i² / Σ_j λ_j²`` over the last dim.

    ``H = −Σ p_i log p_i`` (nats); ``normalized=True`` divides by ``log k`` (k = number of values), so a flat
    spectrum (white noise-like) gives 1 and a rank-1 matrix gives 0. An all-zero spectrum gives 0.
    """
    energy = singular_values.double().square()
    total = energy.sum(-1, keepdim=True)
    p = torch.where(total > 0, energy / total.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(energy))
    h = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)
    if normalized:
        k = singular_values.shape[-1]
        h = h / math.log(k) if k > 1 else torch.zeros_like(h)
    return h.to(singular_values.dtype if singular_values.is_floating_point() else torch.float64)


def _as_dict(x: Tensors) -> dict[str, Tensor]:
    if isinstance(x, Mapping):
        return dict(x)
    return {str(i): t for i, t in enumerate(x)}


def cosine_report(noisy: Tensors, denoised: Tensors, clean: Tensors) -> dict[str, Any]:
    """Oracle report: cosine(noisy, clean) vs cosine(denoised, clean), per tensor and global.

    Args: three mappings name → tensor (or sequences, keyed by position) with the same keys and shapes.
    Returns ``{"per_tensor": {name: {"noisy", "denoised", "gain"}}, "global": {"noisy", "denoised",
    "gain"}}`` where ``global`` is the cosine over the concatenation of all tensors (float64) and
    ``gain = denoised − noisy``. A cosine with a zero vector is NaN.
    """
    nz, dn, cl = _as_dict(noisy), _as_dict(denoised), _as_dict(clean)
    if not (nz.keys() == dn.keys() == cl.keys()):
        raise ValueError("noisy, denoised and clean must have the same names")
    per: dict[str, dict[str, float]] = {}
    flat: dict[str, list[Tensor]] = {"noisy": [], "denoised": [], "clean": []}
    for name in nz:
        a, b, c = (t.detach().reshape(-1).double().cpu() for t in (nz[name], dn[name], cl[name]))
        if not (a.shape == b.shape == c.shape):
            raise ValueError(f"{name}: shapes differ: {nz[name].shape}, {dn[name].shape}, {cl[name].shape}")
        cn, cd = cosine([a], [c]), cosine([b], [c])
        per[name] = {"noisy": cn, "denoised": cd, "gain": cd - cn}
        flat["noisy"].append(a)
        flat["denoised"].append(b)
        flat["clean"].append(c)
    gn, gd = (cosine(flat[k], flat["clean"]) if per else float("nan") for k in ("noisy", "denoised"))
    return {"per_tensor": per, "global": {"noisy": gn, "denoised": gd, "gain": gd - gn}}


def plot_spectrum(
    clean: Tensor | None,
    noisy: Tensor,
    denoised: Tensor,
    sigma: float,
    path: str | os.PathLike[str],
    title: str | None = None,
    kappa: float | None = 1.02,
) -> str:
    """Write a PNG of the singular values of one gradient: clean vs noisy vs denoised.

    Marks the noise bulk edge ``s(√m+√n)`` (and the gate ``κ·edge`` when ``kappa`` is given). Tensors
    with more than 2 dims are viewed as ``(shape[0], -1)``; ``clean`` may be ``None``. Needs matplotlib
    (extra ``[plot]``), imported lazily with the Agg backend. Returns the path written.
    """
    import matplotlib  # noqa: PLC0415 - optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    def svals(t: Tensor) -> Tensor:
        mat = t.detach().double().cpu()
        mat = mat.reshape(mat.shape[0], -1) if mat.dim() > 2 else mat
        if mat.dim() != 2:
            raise ValueError(f"need a >=2-D tensor, got shape {tuple(t.shape)}")
        return torch.linalg.svdvals(mat)

    series = [("noisy", noisy, "tab:red"), ("denoised", denoised, "tab:green")]
    if clean is not None:
        series.insert(0, ("clean", clean, "tab:blue"))
    m, n = noisy.shape[0], int(noisy.numel() // max(noisy.shape[0], 1))
    edge = float(bulk_edge(float(sigma), m, n))
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    try:
        for label, t, color in series:
            sv = svals(t)
            idx = torch.arange(1, sv.numel() + 1)
            keep = sv > 0
            ax.semilogy(idx[keep].numpy(), sv[keep].numpy(), ".-", ms=3, lw=0.8, label=label, color=color)
        if edge > 0:
            ax.axhline(edge, color="k", ls="--", lw=0.8, label=f"bulk edge s(√m+√n) = {edge:.3g}")
            if kappa is not None:
                ax.axhline(kappa * edge, color="gray", ls=":", lw=0.8, label=f"gate κ = {kappa}")
        ax.set_xlabel("index i")
        ax.set_ylabel("singular value")
        ax.set_title(title or f"spectrum ({m}×{n}, s = {sigma:.3g})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)
    return os.fspath(path)
