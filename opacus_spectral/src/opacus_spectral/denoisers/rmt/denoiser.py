"""``"rmt"``: random-matrix-theory spectral denoising (paper A: Dadsetan & Rudzicz, arXiv 2510.01137) as a denoiser.

The math is :func:`~opacus_spectral.denoisers.rmt.rmt_denoise` (its stages in
:mod:`opacus_spectral.denoisers.rmt.stages`); this module views the records it acts on as matrices, groups same-shape
matrices into bounded batched calls and publishes cheap per-step numbers in :attr:`RMTDenoiser.stats`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ...step.records import NOISE_ISOTROPIC, ROLE_LORA_A, ROLE_LORA_B, ROLE_WEIGHT, NoisyGradient
from ...step.selection import ParamFilter, Selector, resolve_roles
from ..base import Denoiser
from .settings import FIELDS, RMTSettings
from .stages import rmt_denoise

__all__ = ["DEFAULT_ROLES", "MIN_CHUNK_BYTES", "RMTDenoiser", "matrix_view"]

DEFAULT_ROLES: tuple[str, ...] = (ROLE_WEIGHT, ROLE_LORA_A, ROLE_LORA_B)
#: chunks are never bounded below this by ``max_extra_memory`` (below it, batching matters more than bytes)
MIN_CHUNK_BYTES = 2**20


Chunk = list[tuple[int, Tensor]]  #: (record index, its matrix view) of one batched call


def matrix_view(t: Tensor) -> Tensor | None:
    """The matrix a gradient is denoised as: 2-D as-is, ≥3-D (conv kernels) as ``(out, in·k·k)``
    (``docs/math.md`` §1.9).

    ``None`` for 0-D/1-D and empty tensors (left untouched).
    """
    if t.dim() < 2 or t.numel() == 0:
        return None
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _check_limits(max_batch: Any, max_chunk_bytes: Any, max_extra_memory: Any, warn_after: Any) -> None:
    if max_extra_memory is not None and not (isinstance(max_extra_memory, (int, float)) and max_extra_memory > 0):
        raise ValueError(f"max_extra_memory must be a positive number or None, got {max_extra_memory!r}")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
    if max_chunk_bytes is not None and (not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1):
        raise ValueError(f"max_chunk_bytes must be a positive int or None, got {max_chunk_bytes!r}")
    if not isinstance(warn_after, int) or warn_after < 0:
        raise ValueError(f"warn_after must be an int >= 0, got {warn_after!r}")


def _sum(total: Tensor | None, part: Tensor) -> Tensor:
    return part if total is None else total + part.to(total.device)


class RMTDenoiser(Denoiser):
    """Spectral denoising of every selected ≥2-D noisy gradient (paper A; ``docs/math.md`` §1).

    Per matrix ``G~`` (m × n) with noise std ``s`` = ``record.sigma`` (never a user argument): invert
    the singular-value inflation, shrink optimally (Shabalin–Nobel), zero everything inside the noise
    bulk, apply only if the gate opens (§1.7), and rescale (§1.8) — as set by ``settings``
    (:class:`~opacus_spectral.denoisers.rmt.RMTSettings`: a Tracy–Widom gate at 1e-3 and the clean-norm estimate by
    default; paper A's setting is :data:`~opacus_spectral.denoisers.rmt.PAPER_SETTING`, registered as ``"rmt_paper"``).
    Instead of ``settings=`` its fields may be given as keyword arguments (``RMTDenoiser(gate="kappa")``).
    The pipeline hands it the records its :attr:`selector` picks; of those, records with ``sigma == 0``, 0-/1-D or
    empty tensors, or noise that is not isotropic are left alone; a non-finite matrix is left unchanged and counted
    (the engine validates outputs).

    Args:
        settings: the :class:`~opacus_spectral.denoisers.rmt.RMTSettings` (default: its defaults).
        roles: roles to act on (default: ``weight``, ``lora_A``, ``lora_B``; a plain string is one role).
        params: optional name filter: a substring, substrings (any match) or a predicate on the qualified name.
        max_batch: at most this many matrices per batched call; ``None`` = all of a shape group.
        max_chunk_bytes: at most this many bytes of stacked input per batched call (default 32 MiB; at
            least one matrix); ``None`` = no limit.
        max_extra_memory: bound the stacked chunks to this fraction of the selected gradients' bytes, divided
            by 3 (the stacked copy, the screen's work buffer and the gated matrices' results each take at most
            one chunk), so that one call's peak extra memory stays near this fraction (default 0.5). A chunk of
            one matrix is not copied: the denoiser works on a view of the gradient. Chunks of up to 1 MiB are
            always allowed. ``None`` = no bound.
        per_matrix_stats: also record per-matrix spectral entropy before/after and norms in ``stats`` (an extra
            ``svdvals`` per matrix; off by default).
        inplace: write results into the records' tensors and return ``None`` (default; the only extra
            memory is one stacked copy per shape group plus the transient work buffers), or return
            replacement tensors (views of one batched buffer per group).
        warn_after: after this many calls, warn once if no matrix was ever gated (the denoiser is then a no-op
            at this noise level) or if most gates were marginal (top singular value within 5 % of the threshold:
            likely false gates on noise). One host sync at that call only; ``0`` disables.

    ``self.stats`` after a call: ``matrices`` and ``skipped_noise`` (ints), ``gated``, ``marginal`` and
    ``nonfinite`` (0-D int64 tensors on the gradients' device, never synced), and with ``per_matrix_stats=True``
    a ``per_matrix`` dict ``{name: {"gated", "top", "entropy_before", "entropy_after", "norm_before",
    "norm_after"}}``. The settings' fields read as attributes (``denoiser.gate``).
    """

    name = "rmt"
    needs_isotropic_noise = True  # the pipeline warns once if an undeclared callable before it switches it off

    def __init__(
        self,
        *,
        settings: RMTSettings | None = None,
        roles: str | Iterable[str] | None = None,
        params: ParamFilter = None,
        max_batch: int | None = None,
        max_chunk_bytes: int | None = 32 * 2**20,
        max_extra_memory: float | None = 0.5,
        per_matrix_stats: bool = False,
        inplace: bool = True,
        warn_after: int = 100,
        **options: Any,
    ) -> None:
        super().__init__()
        if settings is None:
            settings = RMTSettings(**options)  # an unknown keyword is a TypeError, as in any signature
        elif options:
            raise TypeError(
                f"RMTDenoiser: pass either settings= or its fields as keywords, not both ({sorted(options)})"
            )
        elif not isinstance(settings, RMTSettings):
            raise TypeError(f"settings must be an RMTSettings, got {type(settings).__name__}")
        _check_limits(max_batch, max_chunk_bytes, max_extra_memory, warn_after)
        self.settings = settings
        #: the records the pipeline hands this denoiser (the isotropic-noise and ≥2-D conditions are its own,
        #: checked in :meth:`select` on what it is handed)
        self.selector = Selector(roles=resolve_roles(roles, DEFAULT_ROLES), params=params)
        self.max_batch = max_batch
        self.max_chunk_bytes = max_chunk_bytes
        self.max_extra_memory = max_extra_memory
        self.per_matrix_stats = bool(per_matrix_stats)
        self.inplace = bool(inplace)
        self.warn_after = warn_after
        self._calls = 0
        self._run_gated: Tensor | None = None  #: gated / marginal counts since the start, on the device
        self._run_marginal: Tensor | None = None
        self._selected: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        """The settings' fields as read-only attributes (``denoiser.gate``, ``denoiser.kappa``, …)."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in FIELDS:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def roles(self) -> frozenset[str]:
        return self.selector.roles  # type: ignore[return-value]

    @property
    def params(self) -> ParamFilter:
        return self.selector.params

    def select(self, rec: NoisyGradient) -> Tensor | None:
        """The matrix view of a record it was handed (the pipeline selects by :attr:`selector`), or ``None`` where
        the random-matrix model does not hold: noise that is not isotropic with a known std, σ = 0, not a ≥2-D
        floating-point tensor."""
        if rec.noise != NOISE_ISOTROPIC:
            return None
        sigma = rec.sigma
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"{rec.name}: record sigma must be a finite number >= 0, got {sigma!r}")
        if sigma == 0 or not rec.tensor.is_floating_point():
            return None
        return matrix_view(rec.tensor)

    def _groups(self, grads: Sequence[NoisyGradient]) -> tuple[dict[tuple[Any, ...], Chunk], int]:
        """The selected matrices by (shape, dtype, device), and how many were skipped for non-isotropic noise."""
        groups: dict[tuple[Any, ...], Chunk] = {}
        skipped_noise = 0
        for i, rec in enumerate(grads):
            mat = self.select(rec)
            if mat is not None:
                groups.setdefault((tuple(mat.shape), mat.dtype, mat.device), []).append((i, mat))
            elif rec.noise != NOISE_ISOTROPIC and rec.tensor.dim() >= 2:
                skipped_noise += 1
        return groups, skipped_noise

    def _chunks(self, groups: dict[tuple[Any, ...], Chunk]) -> Iterator[tuple[tuple[int, int], Chunk]]:
        """The batched calls: each group cut by ``max_batch``, ``max_chunk_bytes`` and ``max_extra_memory``."""
        chunk_cap = self.max_chunk_bytes
        if self.max_extra_memory is not None:
            total = sum(mat.numel() * mat.element_size() for members in groups.values() for _, mat in members)
            cap = max(int(self.max_extra_memory * total / 3), MIN_CHUNK_BYTES)
            chunk_cap = cap if chunk_cap is None else min(chunk_cap, cap)
        for (shape, dtype, _), members in groups.items():
            step = self.max_batch or len(members)
            if chunk_cap is not None:  # bound the stacked copy (and the work buffers that scale with it)
                per = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                step = max(1, min(step, chunk_cap // max(per, 1)))
            for lo in range(0, len(members), step):
                yield shape, members[lo : lo + step]

    def __call__(self, grads: Sequence[NoisyGradient]) -> list[Tensor | None] | None:
        out: list[Tensor | None] = [None] * len(grads)
        groups, skipped_noise = self._groups(grads)
        self._selected = {i for members in groups.values() for i, _ in members}
        totals: dict[str, Tensor | None] = {"gated": None, "marginal": None, "nonfinite": None}
        per_matrix: dict[str, dict[str, Tensor]] = {}
        n_matrices = 0
        for _, chunk in self._chunks(groups):
            n_matrices += len(chunk)
            self._denoise_chunk(grads, chunk, out, totals, per_matrix)
        zero = torch.zeros((), dtype=torch.int64)
        counts = {k: zero if v is None else v for k, v in totals.items()}  # gated, marginal, nonfinite
        self.stats = {"matrices": n_matrices, **counts, "skipped_noise": skipped_noise}
        self._watch(self.stats["gated"], self.stats["marginal"], n_matrices)
        if self.per_matrix_stats:
            self.stats["per_matrix"] = per_matrix
        return None if self.inplace else out

    def _denoise_chunk(
        self,
        grads: Sequence[NoisyGradient],
        chunk: Chunk,
        out: list[Tensor | None],
        totals: dict[str, Tensor | None],
        per_matrix: dict[str, dict[str, Tensor]],
    ) -> None:
        """One batched :func:`rmt_denoise` call; gated results written back, counts added to ``totals``."""
        first = chunk[0][1]
        # one matrix: a view of the gradient itself (no copy); several: one stacked copy
        single = (
            len(chunk) == 1
            and self.inplace
            and not self.per_matrix_stats
            and first.is_contiguous()
            and first.data_ptr() == grads[chunk[0][0]].tensor.data_ptr()
        )
        stacked = first.unsqueeze(0) if single else torch.stack([mat for _, mat in chunk])
        sigmas = [float(grads[i].sigma) for i, _ in chunk]
        # one noise level for the whole chunk (the usual case) stays a float: no host→device copy
        sigma: float | Tensor = (
            sigmas[0] if len(set(sigmas)) == 1 else torch.tensor(sigmas, dtype=torch.float64).to(first.device)
        )
        before = self._spectra(stacked) if self.per_matrix_stats else None
        res = rmt_denoise(stacked, sigma, settings=self.settings, inplace=True)
        assert res.tau is not None
        totals["marginal"] = _sum(totals["marginal"], (res.gated & (res.top < 1.05 * res.tau)).sum())
        totals["gated"] = _sum(totals["gated"], res.gated.sum())
        totals["nonfinite"] = _sum(totals["nonfinite"], (~res.finite).sum())
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

    def output_noise(self, grads: Sequence[NoisyGradient]) -> list[float | str]:
        """Records this call acted on: ``"unknown"`` (shrunk, or left as they were when the gate stayed closed —
        which is not known here without a sync); every other record: unchanged (gain 1)."""
        return ["unknown" if i in self._selected else 1.0 for i in range(len(grads))]

    def _watch(self, gated: Tensor, marginal: Tensor, n_matrices: int) -> None:
        """Accumulate gate counts on the device; at call ``warn_after`` read them once and warn if useless."""
        if self.warn_after == 0 or n_matrices == 0:
            return
        self._calls += 1
        self._run_gated = _sum(self._run_gated, gated)
        self._run_marginal = _sum(self._run_marginal, marginal)
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
            paper_like = self.settings.gate == "kappa" or self.settings.norm_correction == "noisy"
            warnings.warn(
                f"{n_marginal} of the {n_gated} gates rmt opened in its first {self.warn_after} steps were "
                "marginal (top singular value within 5 % of the threshold): likely noise crossing the gate. "
                + (
                    "Consider the defaults gate='tracy_widom' (a stated false-alarm rate) and "
                    "norm_correction='clean_estimate'"
                    if paper_like
                    else "the signal sits at the noise edge, where denoising gains little"
                ),
                RuntimeWarning,
                stacklevel=4,
            )

    def reset(self) -> None:
        self._calls = 0
        self._run_gated = self._run_marginal = None

    def _spectra(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(spectral entropy, Frobenius norm) per matrix of a batch, in the compute dtype (per-matrix stats)."""
        from ..spectrum_report import spectral_entropy  # noqa: PLC0415 - optional path

        xc = x.to(self.settings.compute_dtype)
        finite = torch.isfinite(xc).flatten(1).all(1)
        xc = torch.where(finite[:, None, None], xc, torch.zeros_like(xc))
        return spectral_entropy(torch.linalg.svdvals(xc)), xc.flatten(1).norm(dim=1)

    def _collect(
        self,
        per_matrix: dict[str, dict[str, Tensor]],
        grads: Sequence[NoisyGradient],
        chunk: Chunk,
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
        st = self.settings
        gate = f"kappa={st.kappa}" if st.gate == "kappa" else f"tracy_widom, false_alarm={st.false_alarm}"
        return (
            f"RMTDenoiser({gate}, norm_correction={st.norm_correction!r}, residual={st.residual!r}, "
            f"roles={sorted(self.roles)})"
        )
