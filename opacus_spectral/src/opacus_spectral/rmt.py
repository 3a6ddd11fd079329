"""``"rmt"``: random-matrix-theory spectral denoising (paper A: Dadsetan & Rudzicz, arXiv 2510.01137) as a denoiser.

The math lives in :mod:`opacus_spectral.spectral`; this module selects the records it acts on, views them
as matrices, groups same-shape matrices into one batched call and publishes cheap diagnostics.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .denoiser import Denoiser
from .records import NOISE_ISOTROPIC, ROLE_LORA_A, ROLE_LORA_B, ROLE_WEIGHT, NoisyGradient
from .selection import ParamFilter, describe_param_filter, resolve_param_filter, resolve_roles
from .spectral import (
    Gate,
    Method,
    NormCorrection,
    Screen,
    gate_threshold,
    resolve_norm_correction,
    resolve_residual,
    rmt_denoise,
    tracy_widom_quantile,
)

__all__ = ["RMTDenoiser", "ParamFilter", "matrix_view", "resolve_param_filter", "resolve_dtype"]

DEFAULT_ROLES: tuple[str, ...] = (ROLE_WEIGHT, ROLE_LORA_A, ROLE_LORA_B)
#: chunks are never bounded below this by ``max_extra_memory`` (below it, batching matters more than bytes)
MIN_CHUNK_BYTES = 2**20


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` / ``torch.float64``, also accepted as strings (config files)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)  # type: ignore[assignment]
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {dtype!r}")
    return dtype  # type: ignore[return-value]


def matrix_view(t: Tensor) -> Tensor | None:
    """The matrix a gradient is denoised as: 2-D as-is, ≥3-D (conv kernels) as ``(out, in·k·k)``
    (``docs/math.md`` §1.9).

    ``None`` for 0-D/1-D and empty tensors (left untouched).
    """
    if t.dim() < 2 or t.numel() == 0:
        return None
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


#: paper A's setting (κ = 1.02 gate, rescale to the noisy norm): ``RMTDenoiser(**PAPER_SETTING)`` = ``"rmt_paper"``
PAPER_SETTING: dict[str, Any] = {"gate": "kappa", "kappa": 1.02, "norm_correction": "noisy"}


class RMTDenoiser(Denoiser):
    """Spectral denoising of every selected ≥2-D noisy gradient (paper A; ``docs/math.md`` §1).

    Per matrix ``G~`` (m × n) with noise std ``s`` = ``record.sigma`` (never a user argument): invert
    the singular-value inflation, shrink optimally (Shabalin–Nobel), zero everything inside the noise
    bulk, apply only if the gate opens (a Tracy–Widom gate at a false-alarm rate, or paper A's
    ``λ~₁ > κ·s(√m+√n)``; §1.7), and rescale (``norm_correction``, §1.8). Defaults (``docs/denoisers.md``, measured
    in ``docs/results.md`` §7): Tracy–Widom gate at 1e-3 and the clean-norm estimate; paper A's setting (κ = 1.02,
    the noisy norm ``‖G~‖_F``) is ``gate="kappa", norm_correction="noisy"`` or the registered name ``"rmt_paper"``.
    Records with ``sigma == 0``, 0-/1-D or empty
    tensors, roles or names not selected are left alone; a non-finite matrix is left unchanged and counted
    (the engine validates outputs).

    Args:
        kappa: gate factor for ``gate="kappa"`` (paper A: 1.02).
        gate: ``"tracy_widom"`` (default) or ``"kappa"`` (paper A).
        false_alarm: the Tracy–Widom gate's false-alarm rate on pure noise, in [1e-8, 0.5].
        tw_centering: ``"johnstone"`` (Johnstone 2001, conservative on thin shapes) or ``"ma"`` (Ma 2012).
        norm_correction: ``"noisy"`` / ``True`` (paper A: rescale each denoised matrix to its noisy Frobenius
            norm), ``"clean_estimate"`` (default: to ``sqrt(max(‖G~‖² − mn·s², 0))``, the unbiased clean-norm
            estimate) or ``"none"`` / ``False`` (``docs/math.md`` §1.8).
        residual: the sub-threshold part of a gated matrix: ``0`` (paper A: dropped), a factor ``ρ ∈ (0, 1]``
            (kept, scaled by ρ; only the spikes are shrunk by RMT) or ``"james_stein"`` (ρ estimated per matrix);
            ``docs/math.md`` §1.11.
        warn_after: after this many calls, warn once if no matrix was ever gated (the denoiser is then a no-op
            at this noise level) or if most gates were marginal (top singular value within 5 % of the threshold:
            likely false gates on noise). One host sync at that call only; ``0`` disables.
        roles: roles to act on (default: ``weight``, ``lora_A``, ``lora_B``; e.g. ``("lora_A", "lora_B")``; a
            plain string is one role).
        params: optional name filter: a substring, substrings (any match) or a predicate on the qualified name.
        compute_dtype: ``torch.float32`` (default) or ``torch.float64``.
        method, gram_max, screen, krylov_min, oversample, max_iter, tol, false_shut: fast-path controls, see
            :func:`opacus_spectral.spectral.rmt_denoise` (``"auto"``: Gram path for ``min(m,n) <= gram_max``,
            else a certified screen — Cholesky, or Krylov from ``min(m,n) >= krylov_min`` — then the spikes of
            the matrices that pass; ``docs/math.md`` §1.12).
        max_batch: at most this many matrices per batched call; ``None`` = all of a shape group.
        max_chunk_bytes: at most this many bytes of stacked input per batched call (default 32 MiB; at
            least one matrix); ``None`` = no limit.
        max_extra_memory: bound the stacked chunks to this fraction of the selected gradients' bytes, divided
            by 3 (the stacked copy, the screen's work buffer and the gated matrices' results each take at most
            one chunk), so that one call's peak extra memory stays near this fraction (default 0.5). A chunk of
            one matrix is not copied: the denoiser works on a view of the gradient. Chunks of up to 1 MiB are always
            allowed. ``None`` = no bound.
        diagnostics: also record per-matrix spectral entropy before/after and norms (costs an extra
            ``svdvals`` per matrix; off by default).
        seed: seed of the truncated path's start block (deterministic on every rank).
        inplace: write results into the records' tensors and return ``None`` (default; the only extra
            memory is one stacked copy per shape group plus the transient work buffers), or return
            replacement tensors (views of one batched buffer per group).

    ``self.diagnostics`` after a call: ``matrices`` (int), ``gated`` and ``nonfinite`` (0-D int64
    tensors on the gradients' device, never synced), and with ``diagnostics=True`` a ``per_matrix``
    dict ``{name: {"gated", "top", "entropy_before", "entropy_after", "norm_before", "norm_after"}}``.
    """

    name = "rmt"
    needs_isotropic_noise = True  # the pipeline warns once if an undeclared callable before it switches it off

    def __init__(
        self,
        *,
        kappa: float = 1.02,
        gate: Gate = "tracy_widom",
        false_alarm: float = 1e-3,
        tw_centering: str = "johnstone",
        norm_correction: bool | NormCorrection = "clean_estimate",
        residual: float | str = 0.0,
        roles: str | Iterable[str] | None = None,
        params: ParamFilter = None,
        compute_dtype: torch.dtype | str = torch.float32,
        method: Method = "auto",
        gram_max: int = 64,
        screen: Screen = "auto",
        krylov_min: int = 2048,
        oversample: int = 16,
        max_iter: int = 60,
        tol: float | None = None,
        false_shut: float = 1e-12,
        max_batch: int | None = None,
        max_chunk_bytes: int | None = 32 * 2**20,
        max_extra_memory: float | None = 0.5,
        diagnostics: bool = False,
        seed: int = 0,
        inplace: bool = True,
        warn_after: int = 100,
    ) -> None:
        super().__init__()
        if not (isinstance(kappa, (int, float)) and math.isfinite(kappa) and kappa > 0):
            raise ValueError(f"kappa must be a positive finite number, got {kappa!r}")
        if gate not in ("kappa", "tracy_widom"):
            raise ValueError(f"gate must be 'kappa' or 'tracy_widom', got {gate!r}")
        tracy_widom_quantile(false_alarm)  # validates the range
        if tw_centering not in ("johnstone", "ma"):
            raise ValueError(f"tw_centering must be 'johnstone' or 'ma', got {tw_centering!r}")
        if method not in ("auto", "gram", "truncated", "full"):
            raise ValueError(f"method must be 'auto', 'gram', 'truncated' or 'full', got {method!r}")
        if screen not in ("auto", "krylov", "cholesky"):
            raise ValueError(f"screen must be 'auto', 'krylov' or 'cholesky', got {screen!r}")
        if not (isinstance(false_shut, float) and 0.0 < false_shut < 1e-3):
            raise ValueError(f"false_shut must be a float in (0, 1e-3), got {false_shut!r}")
        if max_extra_memory is not None and not (isinstance(max_extra_memory, (int, float)) and max_extra_memory > 0):
            raise ValueError(f"max_extra_memory must be a positive number or None, got {max_extra_memory!r}")
        for key, val in (
            ("gram_max", gram_max),
            ("krylov_min", krylov_min),
            ("oversample", oversample),
            ("max_iter", max_iter),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{key} must be a positive int, got {val!r}")
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        if max_chunk_bytes is not None and (not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1):
            raise ValueError(f"max_chunk_bytes must be a positive int or None, got {max_chunk_bytes!r}")
        self.kappa = float(kappa)
        self.gate = gate
        self.false_alarm = float(false_alarm)
        self.tw_centering = tw_centering
        self.norm_correction = resolve_norm_correction(norm_correction)
        self.residual = resolve_residual(residual)
        if not isinstance(warn_after, int) or warn_after < 0:
            raise ValueError(f"warn_after must be an int >= 0, got {warn_after!r}")
        self.warn_after = warn_after
        self._calls = 0
        self._run_gated: Tensor | None = None  #: gated / marginal counts since the start, on the device
        self._run_marginal: Tensor | None = None
        self._selected: set[int] = set()
        self.roles: frozenset[str] = resolve_roles(roles, DEFAULT_ROLES)
        self.params = params
        self._select_name = resolve_param_filter(params)
        self.compute_dtype = resolve_dtype(compute_dtype)
        self.method: Method = method
        self.gram_max = gram_max
        self.screen: Screen = screen
        self.krylov_min = krylov_min
        self.oversample = oversample
        self.max_iter = max_iter
        self.tol = tol
        self.false_shut = false_shut
        self.max_batch = max_batch
        self.max_chunk_bytes = max_chunk_bytes
        self.max_extra_memory = max_extra_memory
        self.collect = bool(diagnostics)
        self.seed = int(seed)
        self.inplace = bool(inplace)

    def selects(self, name: str, role: str) -> bool:
        return role in self.roles and bool(self._select_name(name))

    def selector(self) -> str:
        return f"roles={sorted(self.roles)}, {describe_param_filter(self.params)}"

    def select(self, rec: NoisyGradient) -> Tensor | None:
        """The matrix view of ``rec`` if this denoiser acts on it, else ``None`` (also for noise that is not
        isotropic with a known std: the random-matrix model does not hold for it)."""
        if not self.selects(rec.name, rec.role) or rec.noise != NOISE_ISOTROPIC:
            return None
        sigma = rec.sigma
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"{rec.name}: record sigma must be a finite number >= 0, got {sigma!r}")
        if sigma == 0 or not rec.tensor.is_floating_point():
            return None
        return matrix_view(rec.tensor)

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[Tensor | None] | None:
        out: list[Tensor | None] = [None] * len(grads)
        groups: dict[tuple[Any, ...], list[tuple[int, Tensor]]] = {}
        skipped_noise = 0
        for i, rec in enumerate(grads):
            mat = self.select(rec)
            if mat is not None:
                groups.setdefault((tuple(mat.shape), mat.dtype, mat.device), []).append((i, mat))
            elif rec.noise != NOISE_ISOTROPIC and self.selects(rec.name, rec.role) and rec.tensor.dim() >= 2:
                skipped_noise += 1
        self._selected = {i for members in groups.values() for i, _ in members}
        marginal_total: Tensor | None = None
        gated_total: Tensor | None = None
        nonfinite_total: Tensor | None = None
        per_matrix: dict[str, dict[str, Tensor]] = {}
        n_matrices = 0
        chunk_cap = self.max_chunk_bytes
        if self.max_extra_memory is not None:
            total = sum(mat.numel() * mat.element_size() for members in groups.values() for _, mat in members)
            cap = max(int(self.max_extra_memory * total / 3), MIN_CHUNK_BYTES)
            chunk_cap = cap if chunk_cap is None else min(chunk_cap, cap)
        for (shape, dtype, device), members in groups.items():
            step = self.max_batch or len(members)
            if chunk_cap is not None:  # bound the stacked copy (and the work buffers that scale with it)
                per = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                step = max(1, min(step, chunk_cap // max(per, 1)))
            for lo in range(0, len(members), step):
                chunk = members[lo : lo + step]
                n_matrices += len(chunk)
                # one matrix: a view of the gradient itself (no copy); several: one stacked copy
                first = chunk[0][1]
                single = (
                    len(chunk) == 1
                    and self.inplace
                    and not self.collect
                    and first.is_contiguous()
                    and first.data_ptr() == grads[chunk[0][0]].tensor.data_ptr()
                )
                stacked = first.unsqueeze(0) if single else torch.stack([mat for _, mat in chunk])
                sigmas = [float(grads[i].sigma) for i, _ in chunk]
                # one noise level for the whole chunk (the usual case) stays a float: no host→device copy
                sigma: float | Tensor = (
                    sigmas[0] if len(set(sigmas)) == 1 else torch.tensor(sigmas, dtype=torch.float64).to(device)
                )
                before = self._spectra(stacked) if self.collect else None
                res = rmt_denoise(
                    stacked,
                    sigma,
                    gate=self.gate,
                    kappa=self.kappa,
                    false_alarm=self.false_alarm,
                    tw_centering=self.tw_centering,  # type: ignore[arg-type]
                    norm_correction=self.norm_correction,
                    residual=self.residual,
                    method=self.method,
                    gram_max=self.gram_max,
                    screen=self.screen,
                    krylov_min=self.krylov_min,
                    oversample=self.oversample,
                    max_iter=self.max_iter,
                    tol=self.tol,
                    false_shut=self.false_shut,
                    compute_dtype=self.compute_dtype,
                    seed=self.seed,
                    inplace=True,
                )
                n_gated = res.gated.sum()
                n_bad = (~res.finite).sum()
                m, n = shape
                tau = gate_threshold(
                    torch.as_tensor(sigma, dtype=res.top.dtype, device=res.top.device),
                    m,
                    n,
                    self.gate,
                    self.kappa,
                    self.false_alarm,
                    self.tw_centering,
                )  # type: ignore[arg-type]
                n_marginal = (res.gated & (res.top < 1.05 * tau)).sum()
                marginal_total = n_marginal if marginal_total is None else marginal_total + n_marginal
                gated_total = n_gated if gated_total is None else gated_total + n_gated.to(gated_total.device)
                nonfinite_total = (
                    n_bad if nonfinite_total is None else nonfinite_total + n_bad.to(nonfinite_total.device)
                )
                if res.touched and not single:  # only gated matrices changed: copy those back (one sync)
                    for b in res.gated.nonzero().flatten().tolist():
                        i = chunk[b][0]
                        t = grads[i].tensor
                        if self.inplace:
                            t.copy_(stacked[b].reshape(t.shape))
                        else:
                            out[i] = stacked[b].reshape(t.shape)
                if before is not None:
                    self._collect(per_matrix, grads, chunk, before, self._spectra(stacked), res.gated, res.top)
                del stacked, res  # free this chunk's buffers before the next one is stacked
        zero = torch.zeros((), dtype=torch.int64)
        self.diagnostics = {
            "matrices": n_matrices,
            "gated": gated_total if gated_total is not None else zero,
            "marginal": marginal_total if marginal_total is not None else zero,
            "nonfinite": nonfinite_total if nonfinite_total is not None else zero,
            "skipped_noise": skipped_noise,
        }
        self._watch(self.diagnostics["gated"], self.diagnostics["marginal"], n_matrices)
        if self.collect:
            self.diagnostics["per_matrix"] = per_matrix
        return None if self.inplace else out

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        """Records this call acted on: ``"unknown"`` (shrunk, or left as they were when the gate stayed closed —
        which is not known here without a sync); every other record: unchanged (gain 1)."""
        return ["unknown" if i in self._selected else 1.0 for i in range(len(grads))]

    def _watch(self, gated: Tensor, marginal: Tensor, n_matrices: int) -> None:
        """Accumulate gate counts on the device; at call ``warn_after`` read them once and warn if useless."""
        if self.warn_after == 0 or n_matrices == 0:
            return
        self._calls += 1
        self._run_gated = gated if self._run_gated is None else self._run_gated + gated.to(self._run_gated.device)
        self._run_marginal = (
            marginal if self._run_marginal is None else self._run_marginal + marginal.to(self._run_marginal.device)
        )
        if self._calls != self.warn_after:
            return
        n_gated, n_marginal = int(self._run_gated), int(self._run_marginal)  # the one sync
        if n_gated == 0:
            warnings.warn(
                f"rmt gated no matrix in its first {self.warn_after} steps: at this noise level no singular value "
                "rose above the noise edge, so it changes nothing (a larger batch, or denoising a temporal "
                "average such as post_hooks=['ema', 'rmt'], raises the signal-to-noise ratio)",
                RuntimeWarning,
                stacklevel=4,
            )
        elif n_marginal > 0.5 * n_gated:
            warnings.warn(
                f"{n_marginal} of the {n_gated} gates rmt opened in its first {self.warn_after} steps were "
                "marginal (top singular value within 5 % of the threshold): likely noise crossing the gate. "
                + (
                    "Consider the defaults gate='tracy_widom' (a stated false-alarm rate) and "
                    "norm_correction='clean_estimate'"
                    if self.gate == "kappa" or self.norm_correction == "noisy"
                    else "the signal sits at the noise edge, where denoising gains little"
                ),
                RuntimeWarning,
                stacklevel=4,
            )

    def reset(self) -> None:
        self._calls = 0
        self._run_gated = self._run_marginal = None

    def _spectra(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(spectral entropy, Frobenius norm) per matrix of a batch, in the compute dtype (diagnostics only)."""
        from .diagnostics import spectral_entropy  # noqa: PLC0415 - optional path

        xc = x.to(self.compute_dtype)
        finite = torch.isfinite(xc).flatten(1).all(1)
        xc = torch.where(finite[:, None, None], xc, torch.zeros_like(xc))
        return spectral_entropy(torch.linalg.svdvals(xc)), xc.flatten(1).norm(dim=1)

    def _collect(
        self,
        per_matrix: dict[str, dict[str, Tensor]],
        grads: Sequence[NoisyGradient],
        chunk: list[tuple[int, Tensor]],
        before: tuple[Tensor, Tensor],
        after: tuple[Tensor, Tensor],
        gated: Tensor,
        top: Tensor,
    ) -> None:
        for b, (i, _) in enumerate(chunk):
            per_matrix[grads[i].name] = {
                "gated": gated[b],
                "top": top[b],
                "entropy_before": before[0][b],
                "entropy_after": after[0][b],
                "norm_before": before[1][b],
                "norm_after": after[1][b],
            }

    def __repr__(self) -> str:
        gate = f"kappa={self.kappa}" if self.gate == "kappa" else f"tracy_widom, false_alarm={self.false_alarm}"
        return (
            f"RMTDenoiser({gate}, norm_correction={self.norm_correction!r}, residual={self.residual!r}, "
            f"roles={sorted(self.roles)})"
        )
