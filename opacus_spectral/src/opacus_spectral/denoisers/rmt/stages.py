"""Batched RMT denoising in stages — pure tensor math (``docs/math.md`` §1; the stages in ``docs/architecture.md``).

:func:`rmt_denoise` runs, for a batch ``(B, m, n)`` with per-matrix noise std ``s``:

1. :func:`prepare` — the compute form of the batch (``m ≤ n`` orientation, compute dtype) and the gate
   threshold τ (§1.7), with ``τ_eff² = max(τ², edge²)`` (a spike needs ``λ~₁`` above the bulk edge too);
2. :func:`frobenius` — ``‖G~‖_F`` (finiteness, norm correction, ρ); :func:`screen_gate` — the exact gate
   decision by a certified screen (§1.12): the candidates ``λ~₁ ≥ τ_eff``;
3. :func:`spikes` — every eigenpair above the edge of the candidates, their shrunk values η (§1.3–§1.4) and the
   final gate ``λ~₁ > τ and η₁ > 0``;
4. :func:`reconstruct` — ``Ĝ = ρX + U diag(η/λ~ − ρ) Uᵀ X`` for the gated matrices (§1.11, §1.12.5), then
   :func:`norm_correct` (§1.8). :func:`full_path` is the reference (a batched full SVD) for all of 2–4.

The stage results come back in :class:`DenoiseResult` (τ, gates, spike counts, screen work), so callers read
them instead of recomputing. No per-matrix host–device synchronisation: the decisions are masks; the screens
synchronise once per batch (to skip all work when no matrix passes), once per Krylov check and once to select
the gated matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .screen import BlockLanczos, cholesky_certificate, eigenpairs_above, gram_panel, krylov_screen
from .settings import RMTSettings
from .spectral import bulk_edge, gate_threshold, shrink_singular_values

__all__ = ["EIGH_MAX", "Batch", "DenoiseResult", "rmt_denoise"]

#: candidates of the Cholesky screen with a small side up to this get their spikes from ``eigh`` of the Gram
#: matrix (exact, no certificate needed); larger ones from a block Krylov space (``docs/math.md`` §1.12.4)
EIGH_MAX = 512


class DenoiseResult(NamedTuple):
    """Output of :func:`rmt_denoise` (all batched over the leading dim)."""

    tensor: Tensor  #: (B, m, n), input dtype; bitwise equal to the input where ``gated`` is False
    gated: Tensor  #: (B,) bool: the matrix was replaced by its denoised version
    finite: Tensor  #: (B,) bool: the input was finite (non-finite matrices are never touched)
    top: Tensor  #: (B,) λ~₁ of the candidates (0 for matrices the screen shut without decomposing them)
    touched: bool  #: False when the result is known to equal the input (nothing gated)
    work: dict[str, int] | None = None  #: screen statistics (see :func:`rmt_denoise`), host integers
    tau: Tensor | None = None  #: (B,) the gate threshold τ used (compute dtype; for ``s ≤ 0``: τ at s = 1)
    spikes: Tensor | None = None  #: (B,) int64: components kept with η > 0 (0 where the gate stayed shut)


@dataclass
class Batch:
    """Stage 1: the batch in compute form and its thresholds (``docs/math.md`` §1.7)."""

    g: Tensor  #: (B, m0, n0) the input
    xo: Tensor  #: the input in the compute dtype, original orientation
    x: Tensor  #: ``xo`` with m ≤ n (a transposed view when ``transposed``)
    transposed: bool
    s: Tensor  #: (B,) noise std; ``s_safe``: 1 where ``s ≤ 0`` (those matrices are never active)
    s_safe: Tensor
    tau: Tensor  #: (B,) τ
    edge2: Tensor  #: (B,) bulk edge² ``s²(√m+√n)²``
    tau2: Tensor  #: (B,) ``max(τ², edge²)``
    path: str  #: ``"gram"``, ``"truncated"`` or ``"full"``
    use_krylov: bool

    @property
    def m(self) -> int:
        return self.x.shape[1]

    @property
    def n(self) -> int:
        return self.x.shape[2]


def _noise_std(sigma: Tensor | float, bsz: int, cdt: torch.dtype, dev: torch.device) -> Tensor:
    """``s`` of shape (B,); a float becomes a device-side fill (no host→device copy, no sync)."""
    if isinstance(sigma, Tensor):
        s = sigma.to(device=dev, dtype=cdt)
    else:
        s = torch.full((bsz,), float(sigma), dtype=cdt, device=dev)
    if s.dim() == 0:
        s = s.expand(bsz)
    if s.shape != (bsz,):
        raise ValueError(f"sigma must be a scalar or shape ({bsz},), got {tuple(s.shape)}")
    return s


def compute_dtype(settings: RMTSettings, dtype: torch.dtype) -> torch.dtype:
    """The settings' compute dtype promoted with the input's (float32 or float64)."""
    cdt = torch.promote_types(settings.compute_dtype, dtype)
    return cdt if cdt in (torch.float32, torch.float64) else torch.float32


def prepare(g: Tensor, s: Tensor, settings: RMTSettings) -> Batch:
    """Stage 1 for a non-empty batch ``g`` (B, m0, n0) with noise std ``s`` (B,) in the compute dtype."""
    xo = g.to(s.dtype)  # original orientation; no copy for float32 input in float32 compute
    transposed = g.shape[1] > g.shape[2]
    x = xo.mT if transposed else xo  # work with m ≤ n (the shrinker is symmetric in m, n)
    m, n = x.shape[1], x.shape[2]
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    st = settings
    tau = gate_threshold(s_safe, m, n, st.gate, st.kappa, st.false_alarm, st.tw_centering)
    edge2 = bulk_edge(s_safe, m, n).square()  # type: ignore[union-attr]
    path = st.method
    if path == "auto":
        path = "gram" if m <= st.gram_max else "truncated"
    use_krylov = path == "truncated" and (st.screen == "krylov" or (st.screen == "auto" and m >= st.krylov_min))
    tau2 = torch.maximum(tau.square(), edge2)  # η₁ > 0 needs λ~₁ above the edge too
    return Batch(g, xo, x, transposed, s, s_safe, tau, edge2, tau2, path, use_krylov)


def frobenius(b: Batch) -> tuple[Tensor, Tensor | None]:
    """``‖X‖_F`` (B,) and, on the Cholesky-screen path, its verdict ``λ~₁ < τ_eff`` (B,) computed alongside.

    Off the Gram diagonal in the Cholesky screen, else one streaming read without a full-size temporary. A
    non-finite norm (inf/nan, or ``|x|`` > ~1e19 in float32) leaves a matrix unchanged."""
    if b.path == "truncated" and not b.use_krylov:
        traces: list[Tensor] = []
        screened = cholesky_certificate(b.x, b.tau2, norm2=traces)
        return traces[0].clamp_min(0.0).sqrt(), screened
    return torch.linalg.vector_norm(b.x, dim=(1, 2)), None


class Screened(NamedTuple):
    """Stage 2: the candidates (B,) bool and what the spikes stage reuses."""

    cand: Tensor
    gram: Tensor | None  #: (B, m, m) Gram matrices (the Gram path)
    lanczos: BlockLanczos | None  #: the Krylov screen's spaces
    lanczos_rows: Tensor | None  #: their batch rows (None: all of them)


def screen_gate(
    b: Batch, active: Tensor, screened: Tensor | None, st: RMTSettings, gen: torch.Generator, work: dict[str, int]
) -> Screened:
    """Stage 2: the gate, exactly: the ``active`` matrices with ``λ~₁ ≥ τ_eff`` (``docs/math.md`` §1.12.1–3)."""
    no_flags = torch.zeros_like(active)
    if b.path == "gram":
        gram = torch.bmm(b.x, b.x.mT)  # (B, m, m), m = small side: tiny
        shifted = (b.tau2[:, None, None] * torch.eye(b.m, dtype=b.x.dtype, device=b.x.device)).sub_(gram)
        return Screened(active & (torch.linalg.cholesky_ex(shifted).info != 0), gram, None, None)
    if not b.use_krylov:
        assert screened is not None
        return Screened(active & ~screened, None, None, None)
    rows = active.nonzero().squeeze(-1)  # the screen only sees finite matrices with noise
    all_active = rows.numel() == active.shape[0]
    xw = b.x if all_active else b.x.index_select(0, rows)
    tau2w = b.tau2.index_select(0, rows)
    opened, undecided, lanczos = krylov_screen(
        xw, tau2w, block=st.oversample, max_steps=st.max_iter, false_shut=st.false_shut, generator=gen
    )
    und = undecided.nonzero().squeeze(-1)
    work["krylov_steps"], work["undecided"] = lanczos.steps, und.numel()
    if und.numel():  # the exact re-check of the borderline ones
        exact_open = ~cholesky_certificate(xw.index_select(0, und), tau2w.index_select(0, und))
        opened = opened.index_copy(0, und, exact_open)
    return Screened(no_flags.index_copy(0, rows, opened), None, lanczos, None if all_active else rows)


def spikes(
    b: Batch, sc: Screened, idx: Tensor, st: RMTSettings, gen: torch.Generator, work: dict[str, int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stage 3: for the candidates ``idx``, every eigenpair of ``X Xᵀ`` above the edge (§1.12.4), shrunk (§1.3–4).

    Returns ``u`` (C, m, k), ``sv`` = λ~ (C, k, ascending), ``eta`` (C, k) and the gate ``λ~₁ > τ and η₁ > 0`` (C,).
    """
    every = idx.numel() == b.x.shape[0]
    m, n = b.m, b.n
    xc = b.x if every else b.x.index_select(0, idx)
    edge2c = b.edge2.index_select(0, idx)
    gram, lanczos = sc.gram, sc.lanczos
    if gram is not None or (lanczos is None and m <= EIGH_MAX):  # small side: eigh of the Gram matrix is cheaper
        if gram is None:
            gram = gram_panel(xc, 0, m)
        elif not every:
            gram = gram.index_select(0, idx)
        w, u = torch.linalg.eigh(gram)
        k = max(int((w > edge2c[:, None]).sum(-1).max()), 1)
        theta, u = w[:, -k:], u[:, :, -k:]
    else:
        if lanczos is None:
            lanczos = BlockLanczos(xc, st.oversample, st.oversample * (st.max_iter + 1), gen)
        else:  # reuse the screen's Krylov spaces (candidates ⊂ screened rows)
            pos = idx if sc.lanczos_rows is None else torch.searchsorted(sc.lanczos_rows, idx)
            if pos.numel() != lanczos.x.shape[0]:
                lanczos = lanczos.select(pos, xc)
        tol = (1e-5 if b.x.dtype == torch.float32 else 1e-9) if st.tol is None else st.tol
        theta, u, fallback = eigenpairs_above(xc, lanczos, edge2c, tol=tol, max_steps=st.max_iter)
        work["krylov_steps"], work["fallback"] = max(work["krylov_steps"], lanczos.steps), int(fallback.sum())
    sv = theta.clamp_min(0.0).sqrt()
    eta = shrink_singular_values(sv, b.s_safe.index_select(0, idx)[:, None], m, n)
    gated = (sv[:, -1] > b.tau.index_select(0, idx)) & (eta.amax(-1) > 0)
    return u, sv, eta, gated


def residual_factor(
    norm2: Tensor, sv: Tensor, eta: Tensor, sigma: Tensor, m: int, n: int, residual: float | str
) -> Tensor:
    """ρ (B,): the constant, or the James–Stein factor ``max(0, 1 − (m−k)(n−k)s²/‖R‖²)`` (§1.11; ``norm2`` = ‖X‖²)."""
    if residual != "james_stein":
        return torch.full_like(sigma, float(residual))
    spike = eta > 0
    k = spike.sum(-1).to(sv.dtype)
    r2 = (norm2 - torch.where(spike, sv.square(), torch.zeros_like(sv)).sum(-1)).clamp_min(0.0)
    dof = (m - k) * (n - k)
    rho = 1.0 - dof * sigma.square() / r2.clamp_min(torch.finfo(sv.dtype).tiny)
    return rho.clamp(0.0, 1.0)


def project_lowrank(xo: Tensor, u: Tensor, coef: Tensor, rho: Tensor | None, transposed: bool, out: Tensor) -> Tensor:
    """Ĝ = ρX + U diag(coef) Uᵀ X in ``O(mnk)`` (``docs/math.md`` §1.12.5), written into ``out``.

    ``xo`` is the matrix in its original orientation; ``X = xo`` (m ≤ n) or ``X = xoᵀ`` (``transposed``), so
    the projector acts from the left (``U C (Uᵀ xo)``) or from the right (``(xo U) C Uᵀ``). ``out`` may be
    ``xo`` itself: the small factor is formed before it is overwritten."""
    if transposed:
        small = torch.bmm(xo, u) * coef.unsqueeze(1)  # (B, m0, k)
        left, right = small, u.mT
    else:
        small = torch.bmm(u.mT, xo)  # (B, k, n)
        left, right = u * coef.unsqueeze(1), small
    if rho is None:
        return torch.bmm(left, right, out=out)
    if out is not xo:
        out.copy_(xo)
    return out.mul_(rho[:, None, None]).baddbmm_(left, right)


def reconstruct(
    b: Batch, sel: Tensor, norm_x: Tensor, u: Tensor, sv: Tensor, eta: Tensor, st: RMTSettings, direct: bool
) -> Tensor:
    """Stage 4: ``Ĝ = ρX + U diag(η/λ~ − ρ)_spikes Uᵀ X`` for the gated rows ``sel`` (§1.11, §1.12.5), norm-corrected.

    ``direct``: every matrix is gated and the result is written into the input itself."""
    sg = b.s_safe.index_select(0, sel)
    coef = torch.where(eta > 0, eta / sv.clamp_min(torch.finfo(sv.dtype).tiny), torch.zeros_like(eta))
    rho: Tensor | None = None
    if st.residual != 0.0:
        rho = residual_factor(norm_x.index_select(0, sel).square(), sv, eta, sg, b.m, b.n, st.residual)
        coef = torch.where(eta > 0, coef - rho[:, None], torch.zeros_like(coef))
    src = b.xo if sel.numel() == b.xo.shape[0] else b.xo.index_select(0, sel)
    den = project_lowrank(src, u, coef, rho, b.transposed, out=src if direct else torch.empty_like(src))
    return norm_correct(norm_x.index_select(0, sel), den, torch.ones_like(sel, dtype=torch.bool), st, sg)


def norm_correct(norm_x: Tensor, den: Tensor, gated: Tensor, st: RMTSettings, sigma: Tensor) -> Tensor:
    """Rescale the ``gated`` denoised matrices in place (``docs/math.md`` §1.8): to the noisy norm ``‖G~‖_F``
    (``"noisy"``, ``norm_x``), to the clean-norm estimate ``sqrt(max(‖G~‖² − mn·s², 0))`` (``"clean_estimate"``),
    or not at all (``"none"``)."""
    if st.norm_correction == "none":
        return den
    nx = norm_x
    if st.norm_correction == "clean_estimate":
        m, n = den.shape[1], den.shape[2]
        nx = (nx.square() - m * n * sigma.square()).clamp_min(0.0).sqrt()
    nd = torch.linalg.vector_norm(den, dim=(1, 2))
    scale = torch.where(gated & (nd > 0), nx / nd.clamp_min(torch.finfo(nd.dtype).tiny), torch.ones_like(nd))
    return den.mul_(scale[:, None, None])


def full_path(
    b: Batch, norm_x: Tensor, finite: Tensor, active: Tensor, st: RMTSettings, inplace: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stages 2–4 by a full SVD of every matrix (the reference): ``(out, gated, top, spikes)``."""
    x, m, n, s = b.x, b.m, b.n, b.s_safe
    xf = torch.where(finite[:, None, None], x, torch.zeros_like(x))
    u, sv, vh = torch.linalg.svd(xf, full_matrices=False)
    eta = shrink_singular_values(sv, s[:, None], m, n)
    if st.residual == 0.0:
        den = u @ (eta.unsqueeze(-1) * vh)
    else:
        rho = residual_factor(xf.square().sum((1, 2)), sv, eta, s, m, n, st.residual)
        # ρX + Σ_spikes (η − ρλ~) u vᵀ: the spikes shrunk by RMT, everything else scaled by ρ
        coef = torch.where(eta > 0, eta - rho[:, None] * sv, torch.zeros_like(eta))
        den = rho[:, None, None] * xf + u @ (coef.unsqueeze(-1) * vh)
    top = sv[:, 0]
    gated = active & (top > b.tau) & (eta.amax(-1) > 0)
    den = norm_correct(norm_x, den, gated, st, s)
    if b.transposed:
        den = den.transpose(1, 2)
    g = b.g
    out = torch.where(gated[:, None, None], den.to(g.dtype), g, out=g if inplace else den.to(g.dtype))
    n_spikes = torch.where(gated, (eta > 0).sum(-1), torch.zeros_like(gated, dtype=torch.int64))
    return out, gated, top, n_spikes


def _settings(settings: RMTSettings | None, options: dict[str, Any]) -> RMTSettings:
    if settings is None:
        return RMTSettings(**options)
    if options:
        raise TypeError(f"rmt_denoise: pass either settings= or keyword options, not both (got {sorted(options)})")
    if not isinstance(settings, RMTSettings):
        raise TypeError(f"settings must be an RMTSettings, got {type(settings).__name__}")
    return settings


def _check_input(g: Tensor) -> None:
    if g.dim() != 3:
        raise ValueError(f"expected (B, m, n) or (m, n), got shape {tuple(g.shape)}")
    if not g.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {g.dtype}")


def rmt_denoise(
    g: Tensor, sigma: Tensor | float, settings: RMTSettings | None = None, *, inplace: bool = False, **options: Any
) -> DenoiseResult:
    """Denoise a batch of noisy gradient matrices (``docs/math.md`` §1): gate, spikes and shrinkage,
    reconstruction, norm correction (the stages above).

    Args:
        g: (B, m, n) or (m, n) noisy matrices of any float dtype.
        sigma: per-entry noise std, a float or a (B,) tensor; matrices with ``sigma <= 0`` are untouched.
        settings: an :class:`~opacus_spectral.denoisers.rmt.RMTSettings`; or its fields as keyword ``options``
            (``gate=``, ``norm_correction=``, ``method=``, …; the defaults are :class:`RMTSettings`'s — note
            ``gate="tracy_widom", norm_correction="clean_estimate"``, paper A's setting is
            ``gate="kappa", norm_correction="noisy"``). The ``"truncated"`` path screens the gate first
            (``screen="cholesky"``: exact, ``λ~₁ < τ`` iff the Cholesky factorisation of ``τ²I − X Xᵀ``
            succeeds; ``"krylov"``: block Lanczos of block size ``oversample``, *shut* wrong with probability at
            most ``false_shut``, undecided ones re-checked exactly; ``"auto"``: Krylov from
            ``min(m, n) >= krylov_min``), then finds the spikes of the matrices that pass (at most ``max_iter``
            Lanczos steps, residual ``tol``, a full ``eigh`` as the fallback; §1.12). In float32 the Gram paths
            lose accuracy near the edge once ``λ~₁/edge`` exceeds ~10³: use float64 or ``method="full"`` there.
        inplace: write the result into ``g`` (saves one full-size buffer; ``g`` must not be needed after).

    Returns:
        :class:`DenoiseResult`; ``tensor`` has the input's dtype and equals the input bitwise where the
        gate is closed, sigma is 0 or the input is non-finite; ``work``: ``krylov_steps``, ``undecided``,
        ``candidates``, ``gated``, ``fallback`` (not for ``method="full"``).
    """
    st = _settings(settings, options)
    squeeze = g.dim() == 2
    g = g.unsqueeze(0) if squeeze else g
    _check_input(g)
    bsz, dev = g.shape[0], g.device
    s = _noise_std(sigma, bsz, compute_dtype(st, g.dtype), dev)
    no_flags = torch.zeros(bsz, dtype=torch.bool, device=dev)
    zeros, no_spikes = torch.zeros(bsz, dtype=s.dtype, device=dev), torch.zeros(bsz, dtype=torch.int64, device=dev)

    def result(out: Tensor, gated: Tensor, finite: Tensor, top: Tensor, touched: bool, **extra: Any) -> DenoiseResult:
        return DenoiseResult(out.squeeze(0) if squeeze else out, gated, finite, top, touched, **extra)

    if bsz == 0 or g.shape[1] == 0 or g.shape[2] == 0:
        return result(g, no_flags, ~no_flags, zeros, False, tau=zeros, spikes=no_spikes)
    b = prepare(g, s, st)
    norm_x, screened = frobenius(b)
    finite = torch.isfinite(norm_x)
    active = finite & (s > 0)
    if b.path == "full":
        out, gated, top, n_spikes = full_path(b, norm_x, finite, active, st, inplace)
        return result(out, gated, finite, top, True, tau=b.tau, spikes=n_spikes)
    gen = torch.Generator(device=dev)
    gen.manual_seed(st.seed)
    work = {"krylov_steps": 0, "undecided": 0, "candidates": 0, "gated": 0, "fallback": 0}
    sc = screen_gate(b, active, screened, st, gen, work)
    idx = sc.cand.nonzero().squeeze(-1)  # the one sync of the screen (per batch, not per matrix)
    work["candidates"] = idx.numel()
    if idx.numel() == 0:
        return result(g, no_flags, finite, zeros, False, work=work, tau=b.tau, spikes=no_spikes)
    u, sv, eta, gated_c = spikes(b, sc, idx, st, gen, work)
    gidx = gated_c.nonzero().squeeze(-1)
    top = zeros.index_copy(0, idx, sv[:, -1])
    gated = no_flags.index_copy(0, idx, gated_c)
    work["gated"] = gidx.numel()
    if gidx.numel() == 0:
        return result(g, gated, finite, top, False, work=work, tau=b.tau, spikes=no_spikes)
    sel = idx.index_select(0, gidx)
    u, sv, eta = (t.index_select(0, gidx) for t in (u, sv, eta))
    n_spikes = no_spikes.index_copy(0, sel, (eta > 0).sum(-1))
    # write straight into the input when it is the compute tensor, in place and every matrix is replaced
    direct = inplace and sel.numel() == bsz and b.xo.data_ptr() == g.data_ptr() and b.xo.dtype == g.dtype
    direct = direct and g.is_contiguous()
    den = reconstruct(b, sel, norm_x, u, sv, eta, st, direct)
    if direct:
        out = g
    else:
        out = g if inplace else g.clone()
        out.index_copy_(0, sel, den.to(g.dtype))
    return result(out, gated, finite, top, True, work=work, tau=b.tau, spikes=n_spikes)
