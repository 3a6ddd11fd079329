"""Random-matrix-theory spectral denoising of noisy gradient matrices — pure, batched tensor math.

The method of paper A (Dadsetan & Rudzicz, arXiv 2510.01137); formulas and sources in ``docs/math.md`` §1.
Noise model (§1.1): one noisy gradient ``G~ = G + s·Z`` of shape ``(m, n)``, ``Z`` i.i.d. N(0, 1), ``s`` the
per-entry noise std. Everything here works on batches ``(B, m, n)`` with a per-matrix ``s`` of shape ``(B,)``:

* bulk edge ``s(√m + √n)`` (largest singular value of ``s·Z``), BBP threshold ``s(mn)^{1/4}`` (§1.2);
* the closed-form inversion of the singular-value inflation ``λ~ = sqrt((λ + s²n/λ)(λ + s²m/λ))``
  (:func:`invert_inflation`, larger root of ``t² + (s²(m+n) − λ~²)t + s⁴mn = 0``, ``t = λ²``; §1.3);
* Shabalin & Nobel (2013) optimal shrinkage (:func:`optimal_shrinkage`, §1.4);
* gates (§1.7): ``"kappa"`` (``λ~₁ > κ·s(√m+√n)``, paper A) and ``"tracy_widom"`` (finite-size gate at a
  false-alarm rate from the Tracy–Widom law of the largest eigenvalue of a white Wishart matrix,
  Johnstone 2001; optional Ma 2012 second-order centering);
* norm correction ``(‖G~‖_F / ‖Ĝ‖_F)·Ĝ`` (§1.8).

Only singular triplets above the bulk edge survive shrinkage (§1.6), so three interchangeable decompositions
give the same result (:func:`rmt_denoise`, ``method=``; costs in §1.10, the screens in §1.12):

* ``"gram"`` — thin matrices: Cholesky screen of the small ``k×k`` Gram matrix (``k = min(m, n)``), then its
  eigen-decomposition for the matrices that pass;
* ``"truncated"`` — large matrices: the gate first, by a certified screen (:mod:`opacus_spectral.screen`):
  the exact Cholesky certificate (``λ~₁ < τ`` iff the Cholesky factorisation of ``τ²I − X Xᵀ`` succeeds), or
  for large matrices the Krylov screen (block Lanczos, ``O(mn·b)`` per step; borderline matrices re-checked
  with the Cholesky certificate, so the decision is the exact one); then, for the matrices that pass, the
  spikes from the same Krylov space, proved complete by a Cholesky certificate on the deflated matrix
  (capped steps, full ``eigh`` fallback) — or, for a small side up to :data:`EIGH_MAX`, from ``eigh`` of the
  Gram matrix — and the projection in ``O(mnk)``;
* ``"full"`` — a batched full SVD (reference).

No per-matrix host–device synchronisation: gate decisions are masks; the screens synchronise once per batch
(to skip all work when no matrix passes), once per Krylov check and once to select the gated matrices.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .screen import BlockLanczos, cholesky_certificate, eigenpairs_above, gram_panel, krylov_screen
from .tracy_widom import TW1_LOG10_ALPHA, TW1_QUANTILES, tracy_widom_quantile, tracy_widom_threshold

__all__ = [
    "TW1_LOG10_ALPHA",
    "TW1_QUANTILES",
    "NORM_CORRECTIONS",
    "DenoiseResult",
    "bbp_threshold",
    "bulk_edge",
    "gate_threshold",
    "invert_inflation",
    "optimal_shrinkage",
    "resolve_norm_correction",
    "resolve_residual",
    "rmt_denoise",
    "shrink_singular_values",
    "tracy_widom_quantile",
    "tracy_widom_threshold",
]

Gate = Literal["kappa", "tracy_widom"]
Method = Literal["auto", "gram", "truncated", "full"]
Screen = Literal["auto", "krylov", "cholesky"]
NormCorrection = Literal["noisy", "clean_estimate", "none"]
NORM_CORRECTIONS: tuple[str, ...] = ("noisy", "clean_estimate", "none")
#: candidates of the Cholesky screen with a small side up to this get their spikes from ``eigh`` of the Gram
#: matrix (exact, no certificate needed); larger ones from a block Krylov space (``docs/math.md`` §1.12.4)
EIGH_MAX = 512


def resolve_norm_correction(value: bool | str) -> str:
    """``True`` → ``"noisy"`` (paper A), ``False`` → ``"none"``; a string must be one of :data:`NORM_CORRECTIONS`."""
    if value is True:
        return "noisy"
    if value is False:
        return "none"
    if value not in NORM_CORRECTIONS:
        raise ValueError(f"norm_correction must be one of {NORM_CORRECTIONS} (or True/False), got {value!r}")
    return str(value)


def resolve_residual(value: float | str) -> float | str:
    """``residual``: a factor in [0, 1] for the sub-threshold part, or ``"james_stein"`` (estimated per matrix)."""
    if value == "james_stein":
        return "james_stein"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"residual must be a number in [0, 1] or 'james_stein', got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------------
# Scalar RMT maps (elementwise on tensors; m, n are Python numbers)


def bulk_edge(sigma: Tensor | float, m: int, n: int) -> Tensor | float:
    """Asymptotic largest singular value of ``s·Z`` (m × n): ``s(√m + √n)``."""
    return sigma * (math.sqrt(m) + math.sqrt(n))


def bbp_threshold(sigma: Tensor | float, m: int, n: int) -> Tensor | float:
    """BBP phase transition: a signal singular value is detectable iff ``λ > s(mn)^{1/4}``."""
    return sigma * (m * n) ** 0.25


def invert_inflation(observed: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """Invert ``λ~ = sqrt((λ + s²n/λ)(λ + s²m/λ))`` in closed form (``docs/math.md`` §1.3).

    ``t = λ²`` is the larger root of ``t² + (s²(m+n) − λ~²)t + s⁴mn = 0``::

        t = [λ~² − s²(m+n) + sqrt((λ~² − s²(m+n))² − 4s⁴mn)] / 2,

    real iff ``λ~ ≥ s(√m+√n)``. Returns ``λ̂ = sqrt(t)``, and 0 inside the bulk (``λ~ < s(√m+√n)``).
    The discriminant is evaluated in the factored form ``(λ~² − s²(√m+√n)²)(λ~² − s²(√m−√n)²)``.
    ``sigma`` must be positive and broadcast against ``observed``.
    """
    x2 = (observed / sigma).square()  # normalized units, s = 1
    edge2 = (math.sqrt(m) + math.sqrt(n)) ** 2
    low2 = (math.sqrt(m) - math.sqrt(n)) ** 2
    disc = ((x2 - edge2) * (x2 - low2)).clamp_min(0.0)
    t = 0.5 * (x2 - (m + n) + disc.sqrt())
    inside = x2 < edge2
    return torch.where(inside, torch.zeros_like(t), t.clamp_min(0.0).sqrt() * sigma)


def optimal_shrinkage(lam: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """Shabalin & Nobel (2013) Frobenius-optimal shrinkage of a recovered signal value ``λ̂`` (``docs/math.md`` §1.4)::

        η = λ̂ · sqrt((λ̂⁴ − mns⁴)/(λ̂⁴ + mλ̂²s²)) · sqrt((λ̂⁴ − mns⁴)/(λ̂⁴ + nλ̂²s²)),

    ``η = 0`` if ``λ̂⁴ ≤ mns⁴`` (below the BBP threshold). Evaluated as
    ``s·(L² − mn)/sqrt(L(L+m)(L+n))`` with ``L = λ̂²/s²`` (the same expression, simplified).
    """
    big_l = (lam / sigma).square()
    num = big_l.square() - m * n
    den = (big_l * (big_l + m) * (big_l + n)).clamp_min(torch.finfo(big_l.dtype).tiny).sqrt()
    eta = sigma * num / den
    return torch.where(num > 0, eta, torch.zeros_like(eta))


def shrink_singular_values(observed: Tensor, sigma: Tensor, m: int, n: int) -> Tensor:
    """η(λ~): inversion then optimal shrinkage; 0 for components inside the bulk."""
    return optimal_shrinkage(invert_inflation(observed, sigma, m, n), sigma, m, n)


def gate_threshold(
    sigma: Tensor,
    m: int,
    n: int,
    gate: Gate = "kappa",
    kappa: float = 1.02,
    false_alarm: float = 1e-3,
    tw_centering: Literal["johnstone", "ma"] = "johnstone",
) -> Tensor:
    """τ: a matrix is denoised only if ``λ~₁ > τ`` (``"kappa"``: ``τ = κ·s(√m+√n)``; ``docs/math.md`` §1.7)."""
    if gate == "kappa":
        return kappa * bulk_edge(sigma, m, n)  # type: ignore[return-value]
    if gate == "tracy_widom":
        return tracy_widom_threshold(sigma, m, n, false_alarm, tw_centering)  # type: ignore[return-value]
    raise ValueError(f"gate must be 'kappa' or 'tracy_widom', got {gate!r}")


# --------------------------------------------------------------------------------------------------
# Batched denoising


class DenoiseResult(NamedTuple):
    """Output of :func:`rmt_denoise` (all batched over the leading dim)."""

    tensor: Tensor  #: (B, m, n), input dtype; bitwise equal to the input where ``gated`` is False
    gated: Tensor  #: (B,) bool: the matrix was replaced by its denoised version
    finite: Tensor  #: (B,) bool: the input was finite (non-finite matrices are never touched)
    top: Tensor  #: (B,) λ~₁ of the candidates (0 for matrices the screen shut without decomposing them)
    touched: bool  #: False when the result is known to equal the input (nothing gated)
    work: dict[str, int] | None = None  #: screen statistics (see :func:`rmt_denoise`), host integers


def _residual_factor(
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


def _shrink_full(
    x: Tensor, sigma: Tensor, m: int, n: int, residual: float | str = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference: a full SVD of every matrix."""
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    eta = shrink_singular_values(sv, sigma[:, None], m, n)
    if residual == 0.0:
        return u @ (eta.unsqueeze(-1) * vh), sv[:, 0], eta
    rho = _residual_factor(x.square().sum((1, 2)), sv, eta, sigma, m, n, residual)
    # ρX + Σ_spikes (η − ρλ~) u vᵀ: the spikes shrunk by RMT, everything else scaled by ρ
    coef = torch.where(eta > 0, eta - rho[:, None] * sv, torch.zeros_like(eta))
    return rho[:, None, None] * x + u @ (coef.unsqueeze(-1) * vh), sv[:, 0], eta


def _project_lowrank(xo: Tensor, u: Tensor, coef: Tensor, rho: Tensor | None, transposed: bool, out: Tensor) -> Tensor:
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


def rmt_denoise(
    g: Tensor,
    sigma: Tensor | float,
    *,
    gate: Gate = "kappa",
    kappa: float = 1.02,
    false_alarm: float = 1e-3,
    tw_centering: Literal["johnstone", "ma"] = "johnstone",
    norm_correction: bool | NormCorrection = True,
    residual: float | str = 0.0,
    method: Method = "auto",
    gram_max: int = 64,
    screen: Screen = "auto",
    krylov_min: int = 2048,
    oversample: int = 16,
    max_iter: int = 60,
    tol: float | None = None,
    false_shut: float = 1e-12,
    compute_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    inplace: bool = False,
) -> DenoiseResult:
    """Denoise a batch of noisy gradient matrices (``docs/math.md`` §1): gate, invert, shrink, norm-correct.

    Args:
        g: (B, m, n) or (m, n) noisy matrices of any float dtype.
        sigma: per-entry noise std, a float or a (B,) tensor; matrices with ``sigma <= 0`` are untouched.
        gate: ``"kappa"`` (``λ~₁ > κ·s(√m+√n)``) or ``"tracy_widom"`` (false-alarm rate ``false_alarm``).
        norm_correction: ``"noisy"`` (or ``True``, paper A): rescale the result to the input's Frobenius norm;
            ``"clean_estimate"``: to the unbiased estimate of the clean norm ``sqrt(max(‖G~‖² − mn·s², 0))``;
            ``"none"`` (or ``False``): no rescaling (``docs/math.md`` §1.8).
        residual: what happens to the part of the matrix below the noise edge (``docs/math.md`` §1.11). ``0``
            (paper A): dropped, the result has rank = number of spikes. ``ρ ∈ (0, 1]``: kept with factor ρ —
            ``Ĝ = ρ·G~ + Σ_spikes (η_i − ρ·λ~_i) u_i v_iᵀ``, i.e. only the spikes are shrunk by RMT and the rest
            is attenuated, not zeroed (ρ = 1: only the inflated spike values are deflated). ``"james_stein"``:
            ρ estimated per matrix as ``max(0, 1 − dof·s²/‖R‖²)``, ``R`` the residual, ``dof = (m−k)(n−k)``.
        method: ``"auto"`` (``"gram"`` if ``min(m,n) <= gram_max`` else ``"truncated"``), or force one:
            ``"gram"`` — Cholesky screen of the small Gram matrix, ``eigh`` of the Gram matrices that pass;
            ``"truncated"`` — a certified screen (``screen=``), then the spikes of the matrices that pass from a
            block Krylov space, proved complete (``docs/math.md`` §1.12; ``eigh`` of the Gram matrix after a
            Cholesky screen when the small side is at most :data:`EIGH_MAX`); ``"full"`` — a batched full SVD
            (the reference).
        screen: the truncated path's gate screen. ``"cholesky"``: exact and deterministic, ``λ~₁ < τ`` iff the
            Cholesky factorisation of ``τ²I − X Xᵀ`` succeeds (half a Gram product plus a Cholesky,
            ``O(m²n)``). ``"krylov"``: block Lanczos (``O(mn·b)`` per step): *open* is certain, *shut* holds
            except with probability ``false_shut`` over the seeded start block, *undecided* matrices (top
            Ritz value near τ) are re-checked with the Cholesky screen — the decision is the exact one.
            ``"auto"``: Krylov when ``min(m, n) >= krylov_min`` (where it is the cheaper one).
        oversample: block size ``b`` of the Krylov space (its start block: ``b`` Gaussian vectors).
        max_iter: cap on block Lanczos steps (screen and spikes together; the space is also capped at half
            the small side). Fallback when a matrix is not settled within it, or when its completeness
            certificate fails twice: a full ``eigh`` of its Gram matrix (the exact result, at ``O(m³)``).
        tol: spikes: relative residual ``‖Au − θu‖/θ`` of each eigenpair above the edge (default 1e-5 in
            float32, 1e-9 in float64).
        false_shut: the Krylov screen's bound on the probability of calling a gate shut that a full SVD
            would open (per matrix, over the start block; ``docs/math.md`` §1.12.3).
        compute_dtype: float32 (default) or float64; promoted with the input dtype. The Gram-based paths square
            the singular values: in float32, components near the edge lose accuracy once ``λ~₁/edge`` exceeds
            ~10³ (their weight is then ~1e-3 of the result); use float64 (or ``method="full"``) there.
        seed: seed of the Krylov start block (deterministic, identical on every rank).
        inplace: write the result into ``g`` (saves one full-size buffer; ``g`` must not be needed after).

    Returns:
        :class:`DenoiseResult`; ``tensor`` has the input's dtype and equals the input bitwise where the
        gate is closed, sigma is 0 or the input is non-finite.
    """
    squeeze = g.dim() == 2
    if squeeze:
        g = g.unsqueeze(0)
    if g.dim() != 3:
        raise ValueError(f"expected (B, m, n) or (m, n), got shape {tuple(g.shape)}")
    if not g.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {g.dtype}")
    if method not in ("auto", "gram", "truncated", "full"):
        raise ValueError(f"unknown method {method!r}")
    if screen not in ("auto", "krylov", "cholesky"):
        raise ValueError(f"screen must be 'auto', 'krylov' or 'cholesky', got {screen!r}")
    norm = resolve_norm_correction(norm_correction)
    residual = resolve_residual(residual)
    bsz, m0, n0 = g.shape
    dev = g.device
    cdt = torch.promote_types(compute_dtype, g.dtype)
    if cdt not in (torch.float32, torch.float64):
        cdt = torch.float32
    # a float becomes a device-side fill (no host→device copy, no sync)
    if isinstance(sigma, Tensor):
        s = sigma.to(device=dev, dtype=cdt)
    else:
        s = torch.full((bsz,), float(sigma), dtype=cdt, device=dev)
    if s.dim() == 0:
        s = s.expand(bsz)
    if s.shape != (bsz,):
        raise ValueError(f"sigma must be a scalar or shape ({bsz},), got {tuple(s.shape)}")
    no_flags = torch.zeros(bsz, dtype=torch.bool, device=dev)
    zeros = torch.zeros(bsz, dtype=cdt, device=dev)
    if bsz == 0 or m0 == 0 or n0 == 0:
        out = g.squeeze(0) if squeeze else g
        return DenoiseResult(out, no_flags, ~no_flags, zeros, False)

    xo = g.to(cdt)  # original orientation; no copy for float32 input in float32 compute
    transposed = m0 > n0
    x = xo.mT if transposed else xo  # work with m ≤ n (the shrinker is symmetric in m, n)
    m, n = x.shape[1], x.shape[2]
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    tau = gate_threshold(s_safe, m, n, gate, kappa, false_alarm, tw_centering)
    edge2 = bulk_edge(s_safe, m, n).square()  # type: ignore[union-attr]
    path = method
    if path == "auto":
        path = "gram" if m <= gram_max else "truncated"
    use_krylov = path == "truncated" and (screen == "krylov" or (screen == "auto" and m >= krylov_min))
    tau2 = torch.maximum(tau.square(), edge2)  # type: ignore[union-attr]  # η₁ > 0 needs λ~₁ above the edge too
    # ‖X‖_F (finiteness — inf/nan, or |x| > ~1e19 in float32, leaves a matrix unchanged —, norm correction, ρ):
    # off the Gram diagonal in the Cholesky screen, else one streaming read without a full-size temporary
    screened: Tensor | None = None
    if path == "truncated" and not use_krylov:
        traces: list[Tensor] = []
        screened = cholesky_certificate(x, tau2, norm2=traces)
        norm_x = traces[0].clamp_min(0.0).sqrt()
    else:
        norm_x = torch.linalg.vector_norm(x, dim=(1, 2))
    finite = torch.isfinite(norm_x)
    active = finite & (s > 0)

    if path == "full":
        xf = torch.where(finite[:, None, None], x, torch.zeros_like(x))
        den, top, eta = _shrink_full(xf, s_safe, m, n, residual=residual)
        gated = active & (top > tau) & (eta.amax(-1) > 0)
        den = _finish(norm_x, den, gated, norm, s_safe)
        if transposed:
            den = den.transpose(1, 2)
        out = torch.where(gated[:, None, None], den.to(g.dtype), g, out=g if inplace else den.to(g.dtype))
        return DenoiseResult(out.squeeze(0) if squeeze else out, gated, finite, top, True)

    # 1. the gate, exactly: candidates = matrices with λ~₁ ≥ τ_eff
    eps_tol = (1e-5 if cdt == torch.float32 else 1e-9) if tol is None else tol
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    lanczos: BlockLanczos | None = None
    lanczos_rows: Tensor | None = None  # batch rows of the Krylov spaces (None: all of them)
    gram: Tensor | None = None
    stats = {"krylov_steps": 0, "undecided": 0, "candidates": 0, "gated": 0, "fallback": 0}
    if path == "gram":
        gram = torch.bmm(x, x.mT)  # (B, m, m), m = small side: tiny
        shifted = (tau2[:, None, None] * torch.eye(m, dtype=cdt, device=dev)).sub_(gram)
        cand = active & (torch.linalg.cholesky_ex(shifted).info != 0)  # non-finite: never a candidate
    elif use_krylov:
        work = active.nonzero().squeeze(-1)  # the screen only sees finite matrices with noise
        all_active = work.numel() == bsz
        xw = x if all_active else x.index_select(0, work)
        opened, undecided, lanczos = krylov_screen(
            xw,
            tau2.index_select(0, work),
            block=oversample,
            max_steps=max_iter,
            false_shut=false_shut,
            generator=gen,
        )
        und = undecided.nonzero().squeeze(-1)
        stats["krylov_steps"], stats["undecided"] = lanczos.steps, und.numel()
        if und.numel():  # the exact re-check of the borderline ones
            exact_open = ~cholesky_certificate(xw.index_select(0, und), tau2.index_select(0, work).index_select(0, und))
            opened = opened.index_copy(0, und, exact_open)
        cand = no_flags.index_copy(0, work, opened)
        lanczos_rows = None if all_active else work
    else:
        assert screened is not None
        cand = active & ~screened
    idx = cand.nonzero().squeeze(-1)  # the one sync of the screen (per batch, not per matrix)
    stats["candidates"] = idx.numel()
    if idx.numel() == 0:
        out = g.squeeze(0) if squeeze else g
        return DenoiseResult(out, no_flags, finite, zeros, False, stats)

    # 2. the spikes of the candidates: every eigenpair of X Xᵀ above the edge
    every = idx.numel() == bsz
    xc = x if every else x.index_select(0, idx)
    sc, edge2c = s_safe.index_select(0, idx), edge2.index_select(0, idx)
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
            lanczos = BlockLanczos(xc, oversample, oversample * (max_iter + 1), gen)
        else:  # reuse the screen's Krylov spaces (candidates ⊂ screened rows)
            pos = idx if lanczos_rows is None else torch.searchsorted(lanczos_rows, idx)
            if pos.numel() != lanczos.x.shape[0]:
                lanczos = lanczos.select(pos, xc)
        theta, u, fallback = eigenpairs_above(xc, lanczos, edge2c, tol=eps_tol, max_steps=max_iter)
        stats["krylov_steps"], stats["fallback"] = max(stats["krylov_steps"], lanczos.steps), int(fallback.sum())
    sv = theta.clamp_min(0.0).sqrt()
    eta = shrink_singular_values(sv, sc[:, None], m, n)
    top_c = sv[:, -1]
    gated_c = (top_c > tau.index_select(0, idx)) & (eta.amax(-1) > 0)  # type: ignore[union-attr]
    gidx = gated_c.nonzero().squeeze(-1)
    top = zeros.index_copy(0, idx, top_c)
    gated = no_flags.index_copy(0, idx, gated_c)
    stats["gated"] = gidx.numel()
    if gidx.numel() == 0:
        out = g.squeeze(0) if squeeze else g
        return DenoiseResult(out, gated, finite, top, False, stats)

    # 3. Ĝ = ρX + U diag(η/λ~ − ρ)_spikes Uᵀ X for the gated ones, then the norm correction (§1.8, §1.12.5)
    sel = idx.index_select(0, gidx)
    all_gated = sel.numel() == bsz
    u, sv, eta, sg = (t.index_select(0, gidx) for t in (u, sv, eta, sc))
    coef = torch.where(eta > 0, eta / sv.clamp_min(torch.finfo(cdt).tiny), torch.zeros_like(eta))
    rho: Tensor | None = None
    if residual != 0.0:
        rho = _residual_factor(norm_x.index_select(0, sel).square(), sv, eta, sg, m, n, residual)
        coef = torch.where(eta > 0, coef - rho[:, None], torch.zeros_like(coef))
    src = xo if all_gated else xo.index_select(0, sel)
    # write straight into the input when it is the compute tensor, in place and every matrix is replaced
    direct = inplace and all_gated and xo.data_ptr() == g.data_ptr() and xo.dtype == g.dtype and g.is_contiguous()
    den = _project_lowrank(src, u, coef, rho, transposed, out=src if direct else torch.empty_like(src))
    den = _finish(norm_x.index_select(0, sel), den, torch.ones_like(gidx, dtype=torch.bool), norm, sg)
    if direct:
        out = g
    else:
        out = g if inplace else g.clone()
        out.index_copy_(0, sel, den.to(g.dtype))
    return DenoiseResult(out.squeeze(0) if squeeze else out, gated, finite, top, True, stats)


def _finish(norm_x: Tensor, den: Tensor, gated: Tensor, norm: str, sigma: Tensor) -> Tensor:
    """Norm correction of gated matrices (the caller discards the others; ``docs/math.md`` §1.8): to the noisy
    norm ``‖G~‖_F`` (``"noisy"``, ``norm_x``), to the clean-norm estimate ``sqrt(max(‖G~‖² − mn·s², 0))``
    (``"clean_estimate"``), or none."""
    if norm == "none":
        return den
    nx = norm_x
    if norm == "clean_estimate":
        m, n = den.shape[1], den.shape[2]
        nx = (nx.square() - m * n * sigma.square()).clamp_min(0.0).sqrt()
    nd = torch.linalg.vector_norm(den, dim=(1, 2))
    scale = torch.where(gated & (nd > 0), nx / nd.clamp_min(torch.finfo(nd.dtype).tiny), torch.ones_like(nd))
    return den.mul_(scale[:, None, None])
