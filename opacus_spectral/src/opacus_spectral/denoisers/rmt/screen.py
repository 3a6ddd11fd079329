"""Certified screens for the top of a spectrum — pure, batched tensor math (``docs/math.md`` §1.12).

For a batch ``X`` of shape (B, m, n) with m ≤ n and ``A = X Xᵀ`` (never formed in full here):

* :func:`cholesky_certificate` — exact and deterministic: is ``c·I − X Xᵀ + W Wᵀ`` positive definite? A
  left-looking blocked Cholesky factorisation that forms the Gram matrix one panel at a time, its lower half
  only: ``m²n + m³/3`` flops (half a Gram GEMM plus a Cholesky), about ``m²/2`` floats of work memory.
* :class:`BlockLanczos` — the block Krylov space ``K_d = span{Ω, AΩ, …, A^dΩ}`` of a Gaussian start block
  ``Ω`` (m × b), with full reorthogonalisation, from two products with ``X`` per step (``4mnb`` flops), and
  its Rayleigh–Ritz pairs with their residual norms (§1.12.2).
* :func:`krylov_gate` — the gate decision from that space (§1.12.3): *open* when a Ritz value exceeds τ²
  (Ritz values are lower bounds on λ₁: deterministic), *shut* when a Chebyshev-polynomial certificate shows
  ``λ₁ < τ²`` unless the start block was nearly orthogonal to the top eigenvector (probability at most
  ``false_shut`` over ``Ω``), otherwise *undecided* — the caller re-checks those exactly.
* :func:`eigenpairs_above` — every eigenpair of ``A`` above a level (§1.12.4), taken from the same Krylov
  space, converged to a residual tolerance and proved complete by :func:`cholesky_certificate` on the
  deflated matrix (Weyl's inequality); a capped number of steps, then a full ``eigh`` of the Gram matrix.

All decisions are per matrix and stay on the device as masks; the loops here are over Lanczos steps and
Cholesky panels, never over matrices. The functions that decide when to stop read a few flags to the host
(one small synchronisation per check, for the whole batch).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BlockLanczos",
    "GateScreen",
    "Ritz",
    "cholesky_certificate",
    "gram_panel",
    "chi2_small_ball",
    "eigenpairs_above",
    "krylov_gate",
    "krylov_screen",
    "krylov_steps_needed",
    "panel_width",
    "rounding_margin",
    "times",
    "times_t",
]


def times(x: Tensor, v: Tensor) -> Tensor:
    """``X V`` for a row-major ``x`` or a transposed view of one (the product is arranged so that the large
    operand is never the transposed first factor of ``bmm``, which CPU BLAS dispatch would copy)."""
    return torch.bmm(x, v) if x.stride(-1) == 1 else torch.bmm(v.mT, x.mT).mT


def times_t(x: Tensor, u: Tensor) -> Tensor:
    """``Xᵀ U`` (see :func:`times`)."""
    return torch.bmm(u.mT, x).mT if x.stride(-1) == 1 else torch.bmm(x.mT, u)


def gram_panel(x: Tensor, j0: int, j1: int) -> Tensor:
    """``(X Xᵀ)[j0:, j0:j1]`` (see :func:`times`; for a transposed view, rows ``j0:j1`` are copied first)."""
    if x.stride(-1) == 1:
        return torch.bmm(x[:, j0:], x[:, j0:j1].mT)
    return torch.bmm(x[:, j0:j1].contiguous(), x[:, j0:].mT).mT


def panel_width(m: int) -> int:
    """Panel width of :func:`cholesky_certificate` (measured on one CPU thread: narrow panels for small m)."""
    return 64 if m <= 1024 else 256


def cholesky_certificate(
    x: Tensor,
    level: Tensor,
    lowrank: Tensor | None = None,
    panel: int | None = None,
    *,
    norm2: list[Tensor] | None = None,
) -> Tensor:
    """``ok[i]``: ``level[i]·I − X_i X_iᵀ + W_i W_iᵀ`` is positive definite (``docs/math.md`` §1.12.1).

    With ``W = 0`` this is exactly ``λ₁(X Xᵀ) < level``; with ``W = U_k Θ_k^{1/2}`` (any k columns) it proves
    ``λ_{k+1}(X Xᵀ) < level`` (Weyl). Left-looking blocked Cholesky: panel j of the Gram matrix, rows ``j0:``,
    is formed by one product ``X[j0:] X[j0:j1]ᵀ`` and updated with the earlier panels of the factor; the
    upper half of the Gram matrix is never computed and the factor is kept panel by panel (about ``m²/2``
    floats per matrix). A non-finite matrix gives ``False``.

    Args:
        x: (B, m, n).
        level: (B,) the shift ``c``.
        lowrank: optional (B, m, k) ``W``.
        panel: panel width (default :func:`panel_width`).
        norm2: if given (an empty list), ``‖X_i‖²_F`` — the trace of the Gram matrix, read off the panels'
            diagonals (no extra pass over ``X``) — is appended to it.
    """
    bsz, m, _ = x.shape
    nb = panel or panel_width(m)
    ok = torch.ones(bsz, dtype=torch.bool, device=x.device)
    trace = x.new_zeros(bsz)  # Σ_i (X Xᵀ)_ii = ‖X‖²_F
    done: list[tuple[int, Tensor]] = []  # (j0, factor panel rows j0: × columns j0:j1)
    for j0 in range(0, m, nb):
        j1 = min(j0 + nb, m)
        w = j1 - j0
        p = gram_panel(x, j0, j1).neg().contiguous()  # −(X Xᵀ)[j0:, j0:j1]
        trace.sub_(p[:, :w].diagonal(dim1=1, dim2=2).sum(-1))
        if lowrank is not None:
            p.baddbmm_(lowrank[:, j0:], lowrank[:, j0:j1].mT)
        for i0, li in done:
            p.baddbmm_(li[:, j0 - i0 :], li[:, j0 - i0 : j1 - i0].mT, alpha=-1.0)
        p[:, :w].diagonal(dim1=1, dim2=2).add_(level[:, None])
        d, info = torch.linalg.cholesky_ex(p[:, :w])
        ok &= info == 0
        if j1 < m:  # (a failed block leaves inf/nan below it, in that matrix only; its flag is already False)
            p[:, w:] = torch.linalg.solve_triangular(d, p[:, w:].mT, upper=False).mT
        p[:, :w] = d
        done.append((j0, p))
    if norm2 is not None:
        norm2.append(trace)
    return ok


def chi2_small_ball(block: int, false_shut: float) -> float:
    """``g²`` with ``P(χ²_b < g²) ≤ false_shut`` (``docs/math.md`` §1.12.3).

    From ``P(χ²_b ≤ t) = γ(b/2, t/2)/Γ(b/2) ≤ (t/2)^{b/2}/Γ(b/2 + 1)``: ``g² = 2·(δ·Γ(b/2+1))^{2/b}``.
    """
    if not 0.0 < false_shut < 1.0:
        raise ValueError(f"false_shut must be in (0, 1), got {false_shut!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block!r}")
    return 2.0 * math.exp((2.0 / block) * (math.log(false_shut) + math.lgamma(block / 2 + 1)))


def rounding_margin(dim: int, dtype: torch.dtype) -> float:
    """Relative safety margin for decisions taken from computed Ritz values: ``32·(dim + 1)·u``."""
    return 32.0 * (dim + 1) * torch.finfo(dtype).eps


class Ritz(NamedTuple):
    """Rayleigh–Ritz pairs of ``A`` on the current Krylov space (ascending)."""

    theta: Tensor  #: (B, d) Ritz values, ascending
    coef: Tensor  #: (B, d, d) their coordinates in the basis (columns)
    residual: Tensor  #: (B, d) ``‖A y − θ y‖`` of each unit Ritz vector ``y``


class BlockLanczos:
    """Block Lanczos on ``A = X Xᵀ`` with full reorthogonalisation (``docs/math.md`` §1.12.2).

    The basis ``Q = [Q₀ … Q_s]`` (blocks of ``b`` columns) spans ``K_s = span{Ω, AΩ, …, A^sΩ}``; ``Ω`` is a
    seeded Gaussian (m × b) block, ``Q₀ R₀ = Ω``, so ``‖Ω‖₂ = ‖R₀‖₂``. Step ``s`` forms ``W = X(XᵀQ_{s−1})``,
    orthogonalises it against the basis (classical Gram–Schmidt), factors ``W = Q_s B_s`` and orthogonalises the
    normalised ``Q_s`` once more ("twice is enough"), folding the correction into the coefficients, so
    that ``A Q_{<s} = Q_{<s} T_s + Q_s B_s E_sᵀ`` holds with the computed ``T`` (block upper Hessenberg;
    symmetric block tridiagonal in exact arithmetic). Rayleigh–Ritz uses ``span Q_{<s} = K_{s−1}``, whose
    polynomial degree is ``s − 1`` (:attr:`degree`); ``Q_s`` serves the residuals.

    The space is capped at ``max_dim`` columns and at ``m/2`` (beyond that a full decomposition of the Gram
    matrix is cheaper); :meth:`extend` stops there. The buffers grow on demand.
    """

    def __init__(self, x: Tensor, block: int, max_dim: int, generator: torch.Generator) -> None:
        bsz, m, _ = x.shape
        self.x = x
        self.block = b = max(1, min(block, m))
        self.max_dim = max(b, min(max_dim, m // 2) // b * b)
        cap = min(self.max_dim, 8 * b)  # buffers grow on demand (the basis is the screen's work memory)
        self.q = x.new_empty(bsz, m, cap + b)
        self.t = x.new_zeros(bsz, cap + b, cap)
        omega = torch.randn(bsz, m, b, generator=generator, device=x.device, dtype=x.dtype)
        q0, r0 = torch.linalg.qr(omega)
        self.omega_norm2 = torch.linalg.matrix_norm(r0, ord=2).square()  # (B,)
        self.q[:, :, :b] = q0
        self.dim = 0  #: columns of the basis whose product with A is known (RR space dimension)

    @property
    def steps(self) -> int:
        return self.dim // self.block

    @property
    def degree(self) -> int:
        """Polynomial degree of the Rayleigh–Ritz space ``span Q_{<s} = K_{s−1}``."""
        return self.steps - 1

    @property
    def full(self) -> bool:
        return self.dim >= self.max_dim

    def extend(self, steps: int) -> None:
        """Run up to ``steps`` more block steps (fewer at the cap)."""
        b, x = self.block, self.x
        for _ in range(steps):
            if self.full:
                return
            j = self.dim
            if j + b > self.t.shape[2]:
                self._grow(min(self.max_dim, 2 * self.t.shape[2]))
            qj = self.q[:, :, j : j + b]
            w = times(x, times_t(x, qj))  # A Q_j: two products with X
            basis = self.q[:, :, : j + b]
            h = times_t(basis, w)
            qn, r = torch.linalg.qr(w - torch.bmm(basis, h))
            # second Gram–Schmidt pass on the normalised block ("twice is enough", robust at breakdown):
            # Q = (Q' − basis·c)·R₂⁻¹ exactly, so A Q_j = basis·(h + c r) + Q·(R₂ r) keeps T consistent
            c = times_t(basis, qn)
            qn, r2 = torch.linalg.qr(qn - torch.bmm(basis, c))
            h = h + torch.bmm(c, r)
            r = torch.bmm(r2, r)
            self.q[:, :, j + b : j + 2 * b] = qn
            self.t[:, : j + b, j : j + b] = h
            self.t[:, j + b : j + 2 * b, j : j + b] = r
            self.dim = j + b

    def _grow(self, cap: int) -> None:
        bsz, m, _ = self.q.shape
        b = self.block
        q = self.q.new_empty(bsz, m, cap + b)
        t = self.t.new_zeros(bsz, cap + b, cap)
        q[:, :, : self.dim + b] = self.q[:, :, : self.dim + b]
        t[:, : self.dim + b, : self.dim] = self.t[:, : self.dim + b, : self.dim]
        self.q, self.t = q, t

    def ritz(self) -> Ritz:
        """Ritz pairs on ``span Q_{<s}`` (symmetrised projected matrix) and their residual norms
        ``‖B_s · (last block of the coordinates)‖``."""
        d, b = self.dim, self.block
        tt = self.t[:, :d, :d]
        theta, coef = torch.linalg.eigh(0.5 * (tt + tt.mT))
        last = self.t[:, d : d + b, d - b : d]
        residual = torch.linalg.vector_norm(torch.bmm(last, coef[:, d - b : d, :]), dim=1)
        return Ritz(theta, coef, residual)

    def top_ritz_value(self) -> Tensor:
        """The largest Ritz value (B,), without vectors (what the gate needs)."""
        tt = self.t[:, : self.dim, : self.dim]
        return torch.linalg.eigvalsh(0.5 * (tt + tt.mT))[:, -1]

    def vectors(self, coef: Tensor) -> Tensor:
        """Ritz vectors ``Q_{<s} · coef`` for coordinates (B, d, k)."""
        return torch.bmm(self.q[:, :, : self.dim], coef)

    def select(self, idx: Tensor, x: Tensor) -> BlockLanczos:
        """The same spaces for the matrices ``idx`` (``x`` = their rows of the batch)."""
        out = BlockLanczos.__new__(BlockLanczos)
        out.x, out.block, out.max_dim, out.dim = x, self.block, self.max_dim, self.dim
        out.q, out.t = self.q.index_select(0, idx), self.t.index_select(0, idx)
        out.omega_norm2 = self.omega_norm2.index_select(0, idx)
        return out


class GateScreen(NamedTuple):
    """:func:`krylov_gate` at the current Krylov space (all (B,))."""

    open: Tensor  #: λ₁ > τ² for certain (a Ritz value exceeds it)
    shut: Tensor  #: λ₁ < τ² except with probability ≤ false_shut over the start block
    top: Tensor  #: the largest Ritz value (a lower bound on λ₁)
    steps_needed: Tensor  #: float: total steps the shut certificate needs at this top value (inf: never)


def _log_chebyshev(degree: int, x: Tensor) -> Tensor:
    """``log T_d(x)`` for ``x ≥ 1`` without overflow: ``d·acosh(x) + log((1 + e^{−2d·acosh x})/2)``."""
    a = degree * torch.acosh(x)
    return a + torch.log1p(torch.exp(-2.0 * a)) - math.log(2.0)


def krylov_steps_needed(top: Tensor, tau2: Tensor, omega_norm2: Tensor, g2: float, margin: float) -> Tensor:
    """Smallest block-step count ``s`` whose degree ``s − 1`` makes the shut certificate hold at Ritz value
    ``top`` (``docs/math.md`` §1.12.3); ``inf`` where ``top`` is within the margin of τ²."""
    a = (top + margin * tau2).clamp_min(1e-3 * tau2)
    rho_req = tau2 / a - 1.0
    possible = rho_req > 0
    x = (2.0 * tau2 / a - 1.0).clamp_min(1.0 + 1e-12)
    # need cosh(d·acosh x) ≥ sqrt(‖Ω‖²/(g²·ρ)) =: e^{L/2}
    half_l = (0.5 * (omega_norm2.log() - math.log(g2) - rho_req.clamp_min(1e-300).log())).clamp_min(0.0)
    deg = torch.acosh(torch.exp(half_l).clamp_min(1.0)) / torch.acosh(x)
    steps = deg.ceil() + 1.0
    return torch.where(possible, steps, torch.full_like(steps, math.inf))


def krylov_gate(lz: BlockLanczos, tau2: Tensor, false_shut: float) -> GateScreen:
    """Gate decision ``λ₁(X Xᵀ) > τ²`` from the Krylov space (``docs/math.md`` §1.12.3).

    * open: ``θ₁ > τ²(1 + γ)`` — Ritz values never exceed λ₁ (Courant–Fischer), so this is certain;
    * shut: with ``a = θ₁ + γτ²``, ``x = 2τ²/a − 1`` and ``ρ = ‖Ω‖₂² / (g² T_d(x)²)`` (``d`` the degree,
      ``g²`` from :func:`chi2_small_ball`), ``a < τ²/(1 + ρ)``. If ``λ₁ ≥ τ²`` the Krylov space would hold a
      vector with Rayleigh quotient ``≥ min(a, τ²/(1 + ρ))`` whenever ``‖Ωᵀu₁‖² ≥ g²`` — an event of
      probability ``≥ 1 − false_shut`` — contradicting ``θ₁ < a``.

    ``γ`` = :func:`rounding_margin` (the computed Ritz values are exact for a space within rounding of the
    Krylov space). Computed in float64.
    """
    dt = torch.float64
    top = lz.top_ritz_value().to(dt)
    tau2 = tau2.to(dt)
    gamma = rounding_margin(lz.dim, lz.x.dtype)
    g2 = chi2_small_ball(lz.block, false_shut)
    opened = top > tau2 * (1.0 + gamma)
    omega = lz.omega_norm2.to(dt)
    if lz.degree < 1:
        shut = torch.zeros_like(opened)
    else:
        a = (top + gamma * tau2).clamp_min(1e-3 * tau2)
        x = (2.0 * tau2 / a - 1.0).clamp_min(1.0)
        log_rho = omega.log() - math.log(g2) - 2.0 * _log_chebyshev(lz.degree, x)
        # a < τ²/(1 + ρ)  ⇔  log(1 + ρ) < log(τ²/a)
        shut = (a < tau2) & (torch.nn.functional.softplus(log_rho) < (tau2 / a).log())
    needed = krylov_steps_needed(top, tau2, omega, g2, gamma)
    return GateScreen(opened, shut & ~opened, top, needed)


def krylov_screen(
    x: Tensor, tau2: Tensor, *, block: int, max_steps: int, false_shut: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, BlockLanczos]:
    """The gate ``λ₁(X Xᵀ) > τ²`` for a batch by the Krylov screen (``docs/math.md`` §1.12.3).

    Checks at 2 and 4 block steps, then at the step count the shut certificate predicts for the undecided
    matrices (:func:`krylov_steps_needed`, from the current top Ritz value), until every matrix is decided,
    the remaining ones cannot be decided within ``max_steps`` (their top Ritz value is within the rounding
    margin of τ², or the certificate would need more steps), or the space is full.

    Returns ``(open, undecided, lanczos)``: ``open`` is certain, ``~open & ~undecided`` is shut with
    probability ``≥ 1 − false_shut`` per matrix; the caller decides ``undecided`` exactly
    (:func:`cholesky_certificate`) and reuses ``lanczos`` for the spikes (:func:`eigenpairs_above`).
    """
    lz = BlockLanczos(x, block, block * (max_steps + 1), generator)
    target = 2
    while True:
        lz.extend(target - lz.steps)
        scr = krylov_gate(lz, tau2, false_shut)
        undecided = ~(scr.open | scr.shut)
        reachable = undecided & (scr.steps_needed <= max_steps)
        need = torch.where(reachable, scr.steps_needed, torch.zeros_like(scr.steps_needed)).amax()
        flags = torch.stack([reachable.any().to(need.dtype), need]).tolist()  # one sync per check
        if not flags[0] or lz.full or lz.steps >= max_steps:
            return scr.open, undecided, lz
        target = min(max_steps, max(lz.steps + 2, 4 if lz.steps < 4 else 0, int(flags[1])))


def eigenpairs_above(
    x: Tensor,
    lz: BlockLanczos,
    level: Tensor,
    *,
    tol: float,
    max_steps: int,
    certify_rounds: int = 2,
    min_count: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every eigenpair of ``A = X Xᵀ`` with eigenvalue above ``level`` (``docs/math.md`` §1.12.4).

    The Krylov space is extended (two steps at a time) until, for every matrix, each Ritz pair above the level
    has a relative residual ``‖Ay − θy‖ ≤ tol·θ``, at least ``min_count`` of them lie above the level (the
    screen proved ``λ₁ ≥ τ² ≥ level`` for its candidates) and at least one block of Ritz values lies at or below
    it. Then :func:`cholesky_certificate` with ``W = Y diag(θ)^{1/2}`` (``Y``, ``θ``: the k Ritz pairs above
    the level) proves ``λ_{k+1}(A) < level``: no eigenvalue above the level is missing, and none is counted
    twice (Ritz values interlace, ``θ_i ≤ λ_i``). Matrices whose certificate fails get more steps and another
    certificate, ``certify_rounds`` certificates in all. The fallback — for matrices not settled by then,
    within ``max_steps`` block steps or within the space's cap — is a full ``eigh`` of their Gram matrix.

    Args:
        x: (B, m, n), finite; ``lz``: a :class:`BlockLanczos` on it (possibly already extended by a screen).
        level: (B,) the level (the bulk edge squared, for the denoiser).

    Returns:
        ``(theta, vectors, fallback)``: (B, k) eigenvalues ascending, 0 in the slots of matrices with fewer
        than k above the level; (B, m, k) unit eigenvectors; (B,) bool, the matrices that took the fallback.
    """
    bsz, m, _ = x.shape
    if lz.steps < 2:
        lz.extend(2 - lz.steps)
    order = torch.arange(bsz, device=x.device)
    found: list[tuple[Tensor, Tensor, Tensor]] = []  # (batch indices, theta, vectors)
    fallback = order[:0]
    rounds = 0
    while order.numel():
        while True:
            r = lz.ritz()
            above = r.theta > level[:, None]
            n_above = above.sum(-1)
            room = (n_above <= lz.dim - lz.block) | (lz.dim >= m)  # a block of Ritz values at or below the level
            converged = ((r.residual <= tol * r.theta.abs()) | ~above).all(-1) & room & (n_above >= min_count)
            stuck = lz.full or lz.steps >= max_steps
            if stuck or bool(converged.all()):  # one sync per check, for the whole batch
                break
            lz.extend(2)
        k = max(int(n_above.max()), 1)
        theta = r.theta[:, -k:]
        theta = torch.where(theta > level[:, None], theta, torch.zeros_like(theta))
        vec = lz.vectors(r.coef[:, :, -k:])
        ok = converged & cholesky_certificate(x, level, vec * theta.sqrt()[:, None, :])
        good = ok.nonzero().squeeze(-1)
        found.append((order.index_select(0, good), theta.index_select(0, good), vec.index_select(0, good)))
        rest = (~ok).nonzero().squeeze(-1)
        rounds += 1
        if rest.numel() == 0:
            break
        x, level, order = x.index_select(0, rest), level.index_select(0, rest), order.index_select(0, rest)
        if stuck or rounds >= certify_rounds:
            fallback = order
            w, u = torch.linalg.eigh(torch.bmm(x, x.mT))
            k = max(int((w > level[:, None]).sum(-1).max()), 1)
            theta = w[:, -k:]
            found.append((order, torch.where(theta > level[:, None], theta, torch.zeros_like(theta)), u[:, :, -k:]))
            break
        lz = lz.select(rest, x)
        lz.extend(max(2, lz.steps // 2))  # a missed eigenvalue sits near the level: grow the space by half
    k = max([t.shape[1] for _, t, _ in found] + [1])
    theta_out = x.new_zeros(bsz, k)
    vec_out = x.new_zeros(bsz, m, k)
    for idx, t, v in found:
        theta_out[idx, k - t.shape[1] :] = t
        vec_out[idx, :, k - t.shape[1] :] = v
    fb = torch.zeros(bsz, dtype=torch.bool, device=x.device)
    fb[fallback] = True
    return theta_out, vec_out, fb
