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
give the same result (:func:`rmt_denoise`, ``method=``; costs in §1.10):

* ``"gram"`` — thin matrices: eigen-decomposition of the small ``k×k`` Gram matrix, ``k = min(m, n)``;
* ``"truncated"`` — large matrices: gate first, exactly and SVD-free (``λ~₁ < τ`` iff the Cholesky
  factorisation of ``τ²I − X Xᵀ`` succeeds; one GEMM + one batched Cholesky), then for the few matrices
  that pass, a block subspace iteration on ``X Xᵀ`` that resolves just the spikes above the edge, grown
  until it holds them all and converged (full ``eigh`` fallback);
* ``"full"`` — a batched full SVD (reference).

No per-matrix host–device synchronisation: gate decisions are masks applied with ``torch.where``. The
truncated path synchronises once per batch to skip all work when no matrix passes the gate, and once per
refinement iteration of the (rare) matrices that pass.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

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
NormCorrection = Literal["noisy", "clean_estimate", "none"]
NORM_CORRECTIONS: tuple[str, ...] = ("noisy", "clean_estimate", "none")


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
    top: Tensor  #: (B,) λ~₁ (0 for matrices the truncated path screened out without decomposing them)
    touched: bool  #: False when the result is known, without a sync, to equal the input (nothing gated)


def _residual_factor(x: Tensor, sv: Tensor, eta: Tensor, sigma: Tensor, m: int, n: int, residual: float | str
                     ) -> Tensor:  # fmt: skip
    """ρ per matrix (B,): the constant, or the James–Stein factor ``max(0, 1 − dof·s²/‖R‖²)`` of the residual
    ``R = X − Σ_spikes λ~_i u_i v_iᵀ`` (``‖R‖² = ‖X‖² − Σ_spikes λ~_i²``, ``dof = (m−k)(n−k)``)."""
    if residual != "james_stein":
        return torch.full_like(sigma, float(residual))
    spike = eta > 0
    k = spike.sum(-1).to(x.dtype)
    r2 = (x.square().sum((1, 2)) - torch.where(spike, sv.square(), torch.zeros_like(sv)).sum(-1)).clamp_min(0.0)
    dof = (m - k) * (n - k)
    rho = 1.0 - dof * sigma.square() / r2.clamp_min(torch.finfo(x.dtype).tiny)
    return rho.clamp(0.0, 1.0)


def _shrink_full(x: Tensor, sigma: Tensor, m: int, n: int, residual: float | str = 0.0
                 ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    eta = shrink_singular_values(sv, sigma[:, None], m, n)
    if residual == 0.0:
        return u @ (eta.unsqueeze(-1) * vh), sv[:, 0], eta
    rho = _residual_factor(x, sv, eta, sigma, m, n, residual)
    # ρX + Σ_spikes (η − ρλ~) u vᵀ: the spikes shrunk by RMT, everything else scaled by ρ
    coef = torch.where(eta > 0, eta - rho[:, None] * sv, torch.zeros_like(eta))
    return rho[:, None, None] * x + u @ (coef.unsqueeze(-1) * vh), sv[:, 0], eta


def _project(x: Tensor, u: Tensor, sv: Tensor, eta: Tensor, sigma: Tensor, m: int, n: int, residual: float | str
             ) -> Tensor:  # fmt: skip
    """Ĝ = P X with the small (m × m) ``P = ρI + U diag(η/λ~ − ρ)_spikes Uᵀ`` (ρ = 0: the paper's rank-k
    estimate): one full-size product, one full-size result."""
    tiny = torch.finfo(sv.dtype).tiny
    coef = torch.where(eta > 0, eta / sv.clamp_min(tiny), torch.zeros_like(eta))
    if residual == 0.0:
        return (u * coef.unsqueeze(1)) @ u.transpose(1, 2) @ x
    rho = _residual_factor(x, sv, eta, sigma, m, n, residual)
    coef = torch.where(eta > 0, coef - rho[:, None], torch.zeros_like(coef))
    p = (u * coef.unsqueeze(1)) @ u.transpose(1, 2)
    p.diagonal(dim1=1, dim2=2).add_(rho[:, None])
    return p @ x


def _shrink_gram(
    x: Tensor, sigma: Tensor, m: int, n: int, gram: Tensor | None = None, residual: float | str = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """x: (B, m, n) with m ≤ n. Ĝ from the eigen-decomposition of X Xᵀ (:func:`_project`)."""
    w, u = torch.linalg.eigh(x @ x.transpose(1, 2) if gram is None else gram)
    sv = w.clamp_min(0.0).sqrt()
    eta = shrink_singular_values(sv, sigma[:, None], m, n)
    return _project(x, u, sv, eta, sigma, m, n, residual), sv[:, -1], eta


def _spikes_from_gram(
    a: Tensor, x: Tensor, sigma: Tensor, m: int, n: int, *, oversample: int, max_iter: int, tol: float,
    generator: torch.Generator, residual: float | str = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated eigen-decomposition of ``A = X Xᵀ`` resolving only the eigenvalues above ``edge²``.

    Block subspace iteration with Rayleigh–Ritz. Accepted when (i) each Ritz pair above the edge has a
    relative residual ``‖Au − θu‖/θ`` below ``tol`` and (ii) a certificate shows no spike is missing:
    with the k Ritz pairs above the edge deflated, ``edge²·I − (A − U_k Θ_k U_kᵀ)`` is positive definite
    (Cholesky succeeds), so ``λ_{k+1}(A) < edge²`` by Weyl's inequality. The block doubles while its
    smallest Ritz value is above the edge. Falls back to a full ``eigh`` when the block would exceed half
    of ``m`` or after ``max_iter`` iterations. Returns (denoised X, λ~₁, η) like :func:`_shrink_gram`.
    """
    bsz = a.shape[0]
    edge2 = bulk_edge(sigma, m, n).square()  # type: ignore[union-attr]
    eye = torch.eye(m, dtype=a.dtype, device=a.device)
    block = min(oversample, m)
    y = torch.randn(bsz, m, block, generator=generator, device=a.device, dtype=a.dtype)
    for _ in range(max_iter):
        if 2 * block > m:
            break
        y, _ = torch.linalg.qr(torch.bmm(a, y))
        ay = torch.bmm(a, y)
        theta, w = torch.linalg.eigh(torch.bmm(y.transpose(1, 2), ay))  # ascending
        u = torch.bmm(y, w)
        res = (torch.bmm(ay, w) - u * theta.unsqueeze(1)).norm(dim=1)
        spike = theta > edge2.unsqueeze(-1)
        spike_theta = torch.where(spike, theta, torch.zeros_like(theta))
        deflated = a - u @ (spike_theta.unsqueeze(-1) * u.transpose(1, 2))
        cert = torch.linalg.cholesky_ex(edge2[:, None, None] * eye - deflated).info == 0
        flags = torch.stack(
            [spike[:, 0].any(), (spike & (res > tol * theta.abs())).any(), (~cert).any()]
        ).tolist()  # one sync per iteration, for the whole batch
        if flags[0]:  # even the smallest Ritz value is above the edge: grow the block
            extra = torch.randn(bsz, m, block, generator=generator, device=a.device, dtype=a.dtype)
            block = min(2 * block, m)
            y = torch.cat([u.flip(-1), extra], dim=-1)[:, :, :block]
            continue
        if flags[1] or flags[2]:
            y = u
            continue
        sv = theta.clamp_min(0.0).sqrt()
        eta = shrink_singular_values(sv, sigma[:, None], m, n)
        return _project(x, u, sv, eta, sigma, m, n, residual), sv[:, -1], eta
    return _shrink_gram(x, sigma, m, n, gram=a, residual=residual)


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
    oversample: int = 8,
    max_iter: int = 60,
    tol: float | None = None,
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
        method: ``"auto"`` (Gram path if ``min(m,n) <= gram_max`` else truncated), or force one.
        oversample, max_iter, tol: truncated path. Gate first, exactly and without an SVD: a Cholesky
            factorisation of ``τ²I − X Xᵀ`` (``X Xᵀ`` on the small side) succeeds iff ``λ~₁ < τ``. Only
            the matrices that pass (usually few) get a block subspace iteration on ``X Xᵀ`` (block =
            ``oversample``, doubled while its smallest Ritz value is above the edge), iterated until each
            spike's relative residual is below ``tol`` (default 1e-5 in float32, 1e-9 in float64);
            full ``eigh`` when the block would exceed half the small side or after ``max_iter``.
        compute_dtype: float32 (default) or float64; promoted with the input dtype. The Gram-based paths
            square the singular values: in float32, components near the bulk edge lose accuracy once
            ``λ~₁/edge`` exceeds ~10³ (almost noiseless gradients); their weight is then ~1e-3 of the
            result. Use float64 (or ``method="full"``) where that matters.
        seed: seed of the subspace iteration's start block (deterministic, identical on every rank).
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
    if bsz == 0 or m0 == 0 or n0 == 0:
        out = g.squeeze(0) if squeeze else g
        return DenoiseResult(out, no_flags, ~no_flags, torch.zeros(bsz, dtype=cdt, device=dev), False)

    x = g.to(cdt)  # no copy for float32 input in float32 compute
    transposed = m0 > n0
    if transposed:  # work with m ≤ n (the shrinker is symmetric in m, n)
        x = x.transpose(1, 2)
    m, n = x.shape[1], x.shape[2]
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    tau = gate_threshold(s_safe, m, n, gate, kappa, false_alarm, tw_centering)
    path = method
    if path == "auto":
        path = "gram" if m <= gram_max else "truncated"

    if path == "full":
        finite = torch.isfinite(x).all(-1).all(-1)
        x = torch.where(finite[:, None, None], x, torch.zeros_like(x))
        a = None
    else:
        a = x @ x.transpose(1, 2)  # (B, m, m), m = small side: one GEMM, smaller than the gradient
        # diag(X Xᵀ) = squared row norms: non-finite iff a row holds inf/nan (or overflows, |x| > ~1e19 in
        # float32, then also left unchanged) — detected without a full-size boolean temporary
        finite = torch.isfinite(a.diagonal(dim1=1, dim2=2)).all(-1)
        if path == "gram":  # eigh must not see inf/nan; the truncated path never decomposes them
            a = torch.where(finite[:, None, None], a, torch.zeros_like(a))
    active = finite & (s > 0)

    if path == "truncated":
        assert a is not None
        # (the Gram matrix is recomputed for the few candidates below; its buffer is reused here)
        # Gate first, exactly: λ~₁ < τ_eff  ⇔  τ_eff²·I − X Xᵀ is positive definite ⇔ its Cholesky succeeds.
        tau_eff = torch.maximum(tau, bulk_edge(s_safe, m, n))  # η₁ > 0 needs λ~₁ above the edge too
        a.neg_().diagonal(dim1=1, dim2=2).add_(tau_eff.square().unsqueeze(-1))  # τ²I − X Xᵀ, in place
        info = torch.empty(bsz, dtype=torch.int32, device=dev)
        # factor in place; the matrix is symmetric, so its column-major view ``a.mT`` is the same matrix and
        # LAPACK needs no layout copy (no second m×m buffer per matrix)
        a_f = a.mT
        torch.linalg.cholesky_ex(a_f, out=(a_f, info))
        del a, a_f
        cand = active & (info != 0)
        idx = cand.nonzero().squeeze(-1)  # the one sync of the screen (per batch, not per matrix)
        if idx.numel() == 0:
            out = g.squeeze(0) if squeeze else g
            return DenoiseResult(out, no_flags, finite, torch.zeros(bsz, dtype=cdt, device=dev), False)
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        eps_tol = (1e-5 if cdt == torch.float32 else 1e-9) if tol is None else tol
        xc = x[idx]
        den_c, top_c, eta_c = _spikes_from_gram(
            xc @ xc.transpose(1, 2), xc, s_safe[idx], m, n,
            oversample=oversample, max_iter=max_iter, tol=eps_tol, generator=gen, residual=residual,
        )
        # the Cholesky screen already certified λ~₁ ≥ max(τ, edge) for these; η₁ > 0 confirms it
        gated_c = eta_c.amax(-1) > 0
        den_c = _finish(xc, den_c, gated_c, norm, s_safe[idx])
        if transposed:
            den_c = den_c.transpose(1, 2)
        # only the candidates are rewritten: one copy of the input for the output, nothing else full-size
        sel = torch.where(gated_c[:, None, None], den_c.to(g.dtype), g[idx])
        out = g.index_copy_(0, idx, sel) if inplace else g.index_copy(0, idx, sel)
        gated = no_flags.index_copy(0, idx, gated_c)
        top = torch.zeros(bsz, dtype=cdt, device=dev).index_copy(0, idx, top_c)
    else:
        if path == "gram":
            den, top, eta = _shrink_gram(x, s_safe, m, n, gram=a, residual=residual)
        else:
            den, top, eta = _shrink_full(x, s_safe, m, n, residual=residual)
        gated = active & (top > tau) & (eta.amax(-1) > 0)
        den = _finish(x, den, gated, norm, s_safe)
        if transposed:
            den = den.transpose(1, 2)
        den = den.to(g.dtype)
        mask = gated[:, None, None]
        # elementwise with full overlap of output and one input: safe; no further full-size buffer
        out = torch.where(mask, den, g, out=g if inplace else den)
    if squeeze:
        out = out.squeeze(0)
    return DenoiseResult(out, gated, finite, top, True)


def _finish(x: Tensor, den: Tensor, gated: Tensor, norm: str, sigma: Tensor) -> Tensor:
    """Norm correction of gated matrices (the caller discards the others; ``docs/math.md`` §1.8): to the noisy
    norm ``‖G~‖_F`` (``"noisy"``), to the clean-norm estimate ``sqrt(max(‖G~‖² − mn·s², 0))``
    (``"clean_estimate"``), or none."""
    if norm == "none":
        return den
    nx = torch.linalg.vector_norm(x, dim=(1, 2))
    if norm == "clean_estimate":
        m, n = x.shape[1], x.shape[2]
        nx = (nx.square() - m * n * sigma.square()).clamp_min(0.0).sqrt()
    nd = torch.linalg.vector_norm(den, dim=(1, 2))
    scale = torch.where(gated & (nd > 0), nx / nd.clamp_min(torch.finfo(nd.dtype).tiny), torch.ones_like(nd))
    return den.mul_(scale[:, None, None])
