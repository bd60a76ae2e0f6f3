"""Closed-form compensation of a pruned linear module from streamed input statistics.

Notation of the paper (§2): W (d_out × d_in), inputs X (d_in × N), dense output Y = W X, kept
columns K, dropped columns D, pruned output Z = W_K X_K. With G = Σ x xᵀ = X Xᵀ and s = Σ x:

    Y X_Kᵀ = W G[:,K]        M = Y Zᵀ = W G[:,K] W_Kᵀ        ‖Z‖_F² = tr(W_K G_KK W_Kᵀ)

and, since W G[:,K] = W_K G_KK + W_D G_DK, the part of Y X_Kᵀ that pruning loses is R = W_D G_DK
(d_out·|D|·k flops instead of d_out·d_in·k). With C = Σ y xᵀ, Y X_Kᵀ = C[:,K]; with S = Σ y yᵀ and
C_D = Σ y x_Dᵀ (D fixed before the pass), Z = Y − W_D X_D gives M = S − C_D W_Dᵀ.

G is a *sum* over the N calibration tokens (not a mean), as in the paper and the official code, so
the ridge λ has the paper's meaning. Every compensator takes (W, stats, kept, pruned) and returns a
``Compensation``: the new kept weight W̃_K (d_out × |K|), an optional bias, and diagnostics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from rcpu_bench.compensation.rotation import Rotation, polar, polar_columns
from rcpu_bench.finite import count_non_finite
from rcpu_bench.statistics.activations import ActivationStats, gram_of

# The paper's λ grid: 10^-6 … 10^6, 13 values.
LAMBDA_GRID: tuple[float, ...] = tuple(10.0**e for e in range(-6, 7))


@dataclass
class Compensation:
    """A compensated module: weight over the kept columns, optional output bias, and diagnostics."""

    weight: Tensor
    bias: Tensor | None = None
    info: dict[str, float | str] = field(default_factory=dict)


def _dtype(name: str) -> torch.dtype:
    allowed = {"float64": torch.float64, "float32": torch.float32}
    if name not in allowed:
        raise ValueError(f"unknown compute dtype {name!r}; allowed: {', '.join(allowed)}")
    return allowed[name]


class Problem:
    """One module's compensation problem in float64 on the statistics' device, with shared products cached.

    Only the products a compensator reads are formed, each from the cheapest statistic at hand: Y X_Kᵀ
    from C's columns K or W G[:,K] (never the full W G), M from S and C_D, ‖Y‖² from the streamed outputs,
    and the objective from the blocks G_DD, G_KK.
    """

    def __init__(self, weight: Tensor, stats: ActivationStats, kept: Tensor):
        if weight.shape[1] != stats.d_in:
            raise ValueError(f"weight has {weight.shape[1]} input columns but the statistics have d_in={stats.d_in}")
        self.weight, self.stats, self.kept = weight, stats, kept.to(stats.device)
        self.w = weight.detach().to(device=stats.device, dtype=torch.float64)
        self.wk = self.w[:, self.kept]

    @cached_property
    def dropped(self) -> Tensor:
        """D, the input columns not in K."""
        mask = torch.ones(self.stats.d_in, dtype=torch.bool, device=self.stats.device)
        mask[self.kept] = False
        return mask.nonzero().squeeze(1)

    @property
    def has_yxk(self) -> bool:
        """Whether Y X_Kᵀ follows from the statistics (C or G; S and C_D give M = Y Zᵀ only)."""
        return self.stats.cross is not None or self.stats.gram is not None

    @cached_property
    def yxk(self) -> Tensor:
        """Y X_Kᵀ (d_out × k): C[:,K] when C = Σ y xᵀ was collected, else W G[:,K]."""
        if self.stats.cross is not None:
            return self.stats.cross[:, self.kept]
        if self.stats.gram is None:
            raise ValueError("these statistics have neither the cross statistic C = Σ y xᵀ nor the Gram matrix G; "
                             "collect one for a compensator that declares needs='cross' or 'gram' (S and C_D give "
                             "only Procrustes' M = Y Zᵀ)")
        return self.w @ self.stats.gram[:, self.kept]

    def yzt(self, dtype: torch.dtype) -> Tensor:
        """M = Y Zᵀ (d_out × d_out) with products in ``dtype``: Y X_Kᵀ W_Kᵀ, or S − C_D W_Dᵀ from S and C_D."""
        if self.has_yxk:
            return self.yxk.to(dtype) @ self.wk.to(dtype).T
        s, c_d = self.stats.out_gram, self.stats.dropped_cross
        if s is None or c_d is None:
            raise ValueError("Procrustes needs M = Y Zᵀ, and these statistics have neither the cross statistic "
                             "C = Σ y xᵀ, the Gram matrix G = Σ x xᵀ, nor S = Σ y yᵀ with C_D = Σ y x_Dᵀ: collect one")
        dropped = self.stats.dropped
        assert dropped is not None
        if not torch.equal(dropped.to(self.dropped.device), self.dropped):
            raise ValueError(f"the statistics' S and C_D were collected for dropped columns {dropped.tolist()}, "
                             f"but this problem drops {self.dropped.tolist()}: collect them for this selection")
        return s.to(dtype) - c_d.to(dtype) @ self.w[:, self.dropped].to(dtype).T

    @cached_property
    def dropped_coupling(self) -> Tensor:
        """R = W_D G_DK (d_out × k): Y X_Kᵀ − W_K G_KK, what the dropped columns contributed to Y X_Kᵀ."""
        return self.w[:, self.dropped] @ self.stats.require_gram()[self.dropped[:, None], self.kept]

    @cached_property
    def gkk(self) -> Tensor:
        """X_K X_Kᵀ = G_KK."""
        return self.kept_block()

    def kept_block(self) -> Tensor:
        """A fresh copy of G_KK (k × k), for a solver to change in place."""
        return self.stats.require_gram()[self.kept[:, None], self.kept]

    @cached_property
    def gkk_diagonal_mean(self) -> float:
        """mean diag G_KK = (1/k) Σ_{j∈K} ‖X[j,:]‖²."""
        return float(self.stats.require_gram().diagonal()[self.kept].mean())

    @cached_property
    def y_norm2(self) -> Tensor:
        """‖Y‖_F²: streamed from the module's outputs, else tr(W G Wᵀ) (statistics without outputs)."""
        if self.stats.out_sq_sum is not None:
            return self.stats.out_sq_sum
        return ((self.w @ self.stats.require_gram()) * self.w).sum()

    @cached_property
    def z_norm2(self) -> Tensor:
        """‖Z‖_F² = tr(W_K G_KK W_Kᵀ) = ⟨W_K G_KK, W_K⟩.

        When Y X_Kᵀ = W G[:,K] came from G, W_K G_KK = Y X_Kᵀ − R (d_out·|D|·k flops for R instead of
        d_out·k² for W_K G_KK); from C (other rounding than G) it is formed directly.
        """
        kept_product = self.wk @ self.gkk if self.stats.cross is not None else self.yxk - self.dropped_coupling
        return (kept_product * self.wk).sum()

    @cached_property
    def dropped_gram(self) -> Tensor:
        """W_DᵀW_D (|D| × |D|)."""
        return gram_of(self.w[:, self.dropped])

    @cached_property
    def pruned_error(self) -> Tensor:
        """‖Y − W_K X_K‖_F² = ‖W_D X_D‖_F² = tr(W_D G_DD W_Dᵀ) = ⟨W_DᵀW_D, G_DD⟩: the uncompensated error, without
        cancellation."""
        return (self.dropped_gram * self.stats.require_gram()[self.dropped[:, None], self.dropped]).sum()

    def error(self, new_weight: Tensor, bias: Tensor | None = None) -> float:
        """‖Y − W̃_K X_K − b 1ᵀ‖_F² over the calibration tokens, from the statistics alone.

        With Δ = W̃_K − W_K, Y − W̃_K X_K = W_D X_D − Δ X_K, so (without cancellation against ‖Y‖²)

            = tr(W_D G_DD W_Dᵀ) − 2⟨Δ, R⟩ + tr(Δ G_KK Δᵀ) − 2 bᵀ(W s − W̃_K s_K) + N‖b‖²,   R = W_D G_DK.
        """
        w_new = new_weight.detach().to(device=self.stats.device, dtype=torch.float64)
        err = self.pruned_error
        if new_weight is not self.wk:  # Δ = 0 for W̃_K = W_K (a bias only): no d_out·k² product
            delta = w_new - self.wk
            err = err - 2 * (self.dropped_coupling * delta).sum() + ((delta @ self.gkk) * delta).sum()
        if bias is not None:
            b, s = bias.detach().to(device=self.stats.device, dtype=torch.float64), self.stats.sum
            err = err - 2 * b @ (self.w @ s - w_new @ s[self.kept]) + self.stats.n * b @ b
        return float(err.clamp_min(0))

    def rotated_error(self, new_weight: Tensor, scale: float = 1.0) -> float:
        """‖Y − s Q Z‖_F² for W̃_K = s Q W_K with Q orthogonal: ‖sQZ‖² = s²‖Z‖², so it is

            ``pruned_error`` + 2⟨W_K − W̃_K, Y X_Kᵀ⟩ + (s² − 1)‖Z‖²

        (‖Y‖² cancels between the two objectives, and ‖Z‖² for s = 1; Q's orthogonality is checked to c·n·eps).
        """
        w_new = new_weight.detach().to(device=self.stats.device, dtype=torch.float64)
        err = self.pruned_error + 2 * (self.yxk * (self.wk - w_new)).sum()
        if scale != 1.0:
            err = err + (scale**2 - 1) * self.z_norm2
        return float(err.clamp_min(0))

    def result(self, new_weight: Tensor, bias: Tensor | None = None, after: Callable[[], float] | None = None, /,
               **info: Any) -> Compensation:
        """Cast back to the module's dtype/device, reject non-finite values, record the objective before/after.

        The objective needs G; ``after``, when the compensator knows it more cheaply, computes the objective
        of ``new_weight``. ``new_weight``, ``bias`` and ``after`` are positional, so that any other name can be a key of
        ``info``.
        """
        if count_non_finite(new_weight) or (bias is not None and count_non_finite(bias)):
            raise FloatingPointError("compensation produced NaN or infinite weights")

        def cast(t: Tensor) -> Tensor:
            return t.to(device=self.weight.device, dtype=self.weight.dtype)

        out = Compensation(cast(new_weight), cast(bias) if bias is not None else None, dict(info))
        if self.stats.gram is not None:
            out.info["objective_before"] = self.error(self.wk)
            out.info["objective_after"] = self.error(new_weight, bias) if after is None else after()
        return out


def calibration_error(weight: Tensor, stats: ActivationStats, kept: Tensor, new_weight: Tensor,
                      bias: Tensor | None = None) -> float:
    """‖Y − W̃_K X_K − b 1ᵀ‖_F² for a compensated module (see ``Problem.error``)."""
    return Problem(weight, stats, kept).error(new_weight, bias)


def none(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor) -> Compensation:
    """No compensation: W̃_K = W_K (plain structured pruning)."""
    problem = Problem(weight, stats, kept)
    return problem.result(problem.wk)


def flap_bias(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor) -> Compensation:
    """FLAP bias compensation: W̃_K = W_K and b = W_D μ_D, the dropped columns' output at the mean input."""
    problem = Problem(weight, stats, kept)
    pruned = pruned.to(stats.device)
    return problem.result(problem.wk, problem.w[:, pruned] @ stats.mean[pruned])


def require_definite(failed: bool, spectrum: Tensor, lam: float) -> None:
    """Refuse a numerically singular G_KK + λI: its smallest pivot/eigenvalue must exceed k·eps·largest."""
    tolerance = len(spectrum) * torch.finfo(spectrum.dtype).eps * spectrum.abs().max()
    if failed or not (spectrum > tolerance).all():
        raise ValueError(f"G_KK + λI is singular at lam={lam} (fewer independent calibration tokens than kept "
                         "columns?); use a larger lam")


def relative_damping(problem: Problem, lam: float, lam_rel: float) -> tuple[float, dict[str, float | None]]:
    """λ = lam + lam_rel · mean diag G_KK (absolute, and relative on SparseGPT's ``percdamp`` scale), and the record of
    both scales: info["lambda"] = λ, info["lambda_rel"] = λ / mean diag G_KK (None when G_KK's diagonal is 0)."""
    if lam < 0 or lam_rel < 0:
        raise ValueError(f"ridge lam={lam}, lam_rel={lam_rel}; allowed: both >= 0")
    scale = problem.gkk_diagonal_mean
    total = lam + lam_rel * scale
    return total, {"lambda": total, "lambda_rel": total / scale if scale > 0 else None}


def ridge(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *, lam: float = 1e-4,
          lam_rel: float = 0.0, dtype: str = "float64") -> Compensation:
    """Ridge least squares W* = (Y X_Kᵀ + λ W_K)(X_K X_Kᵀ + λ I)⁻¹ (paper eq. astar), by Cholesky.

    Minimises ‖Y − W* X_K‖_F² + λ‖W* − W_K‖_F² (eq. err_A); G is a sum over tokens, so λ is the paper's.
    With A = G_KK + λI and Y X_Kᵀ = W_K G_KK + R (R = W_D G_DK), the right-hand side is W_K A + R, so

        W* = W_K + Δ,   Δ = W_D G_DK A⁻¹:

    only the correction is solved for (``ridge_correction``), and ``dtype='float32'`` rounds Δ, added to W_K in
    float64, rather than W*. In float64 the objective follows from the normal equations, Δ G_KK = R − λΔ:
    ‖Y − W* X_K‖² = tr(W_D G_DD W_Dᵀ) − ⟨Δ, R⟩ − λ‖Δ‖². λ = lam + lam_rel · mean diag G_KK: ``lam_rel=0.01,
    lam=0`` is SparseGPT's / SlimGPT's damping.
    """
    return _ridge(Problem(weight, stats, kept), lam, lam_rel, _dtype(dtype))


def _ridge(problem: Problem, lam: float, lam_rel: float, compute: torch.dtype) -> Compensation:
    """``ridge`` on a problem whose shared products (R, W_DᵀW_D, the objective before) may be cached."""
    lam, damping = relative_damping(problem, lam, lam_rel)
    shifted = problem.kept_block().to(compute)  # A = G_KK + λI; problem.gkk stays unshifted
    shifted.diagonal().add_(lam)
    factor, fail = torch.linalg.cholesky_ex(shifted)  # A = L Lᵀ
    del shifted
    pivots = factor.diagonal().square()
    require_definite(bool(fail) or not torch.isfinite(pivots).all(), pivots, lam)
    delta, coupling = ridge_correction(problem, factor)
    new_weight = problem.wk + delta
    after = None
    if compute == torch.float64:
        def after() -> float:
            return float((problem.pruned_error - coupling() - lam * delta.square().sum()).clamp_min(0))
    return problem.result(new_weight, None, after, **damping)


def ridge_correction(problem: Problem, factor: Tensor) -> tuple[Tensor, Callable[[], Tensor]]:
    """Δ = W_D G_DK A⁻¹ (d_out × k, float64) with A = L Lᵀ, and a function giving ⟨Δ, R⟩ = ‖W_D G_DK L⁻ᵀ‖_F².

    The product is associated the cheaper way: for |D| < d_out, S = G_DK A⁻¹ (two triangular solves with
    |D| rows) and Δ = W_D S; else R = W_D G_DK first and Δ = R A⁻¹ (d_out rows). Both give T = (·) L⁻ᵀ on
    the way, and ⟨Δ, R⟩ = ⟨Δ L, Δ L⟩ = ‖W_D T_S‖_F² = ⟨W_DᵀW_D, T_S T_Sᵀ⟩ (an |D| × |D| inner product) or ‖T_R‖_F².
    L's dtype is the solve's (float32 rounds Δ only).
    """
    w_d, g_dk = problem.w[:, problem.dropped], problem.stats.require_gram()[problem.dropped[:, None], problem.kept]
    if len(problem.dropped) < problem.w.shape[0]:
        s, t = _solve_right(g_dk, factor)
        delta = w_d @ s.to(torch.float64)
        return delta, lambda: (problem.dropped_gram * gram_of(t.T).to(torch.float64)).sum()
    delta, t = _solve_right(w_d @ g_dk, factor)
    return delta.to(torch.float64), lambda: t.to(torch.float64).square().sum()


def _solve_right(b: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    """X with X L Lᵀ = B, and T = B L⁻ᵀ (X = T L⁻¹): two triangular solves from the right, in L's dtype."""
    t = torch.linalg.solve_triangular(factor.T, b.to(factor.dtype), upper=True, left=False)
    return torch.linalg.solve_triangular(factor, t, upper=False, left=False), t


def ridge_grid(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
               lams: Sequence[float] = LAMBDA_GRID, dtype: str = "float64") -> list[Compensation]:
    """``ridge`` at each λ of a grid, one Cholesky per λ, sharing the problem's products (R = W_D G_DK, W_DᵀW_D,
    the objective before).

    (One eigendecomposition G_KK = V diag(e) Vᵀ shared by the grid, W*(λ) = W_K + R V diag(1/(e + λ)) Vᵀ, was
    1.7-2.5x slower at 7B shapes on 2 CPU threads than these Cholesky solves of the correction: the eigh and the
    d_out·k² product per λ outweigh 13 factorisations; ``benchmarks/test_bench_compensators.py``.)
    """
    if not lams or any(lam < 0 for lam in lams):
        raise ValueError(f"ridge lams {list(lams)} must be a non-empty list of values >= 0")
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    return [_ridge(problem, lam, 0.0, compute) for lam in lams]


def rotate(problem: Problem, dtype: torch.dtype, solver: str) -> tuple[Tensor, Rotation]:
    """Q* W_K with Q* = argmax_{QᵀQ=I} tr(QᵀM), M = Y Zᵀ = Y X_Kᵀ W_Kᵀ (paper eq. procrustes_sol), and the rotation.

    For fewer kept columns than outputs (k < d_out, e.g. pruned heads) the problem is solved on W_K's column
    span: with W_K = P T (thin QR, T k × k), M = B Pᵀ with B = Y X_Kᵀ Tᵀ (d_out × k), and when rank B = k

        Q* W_K = U T,   U = argmax_{UᵀU=I} tr(UᵀB) = B (BᵀB)^{-1/2}   (``rotation.polar_columns``),

    a k × k eigenproblem instead of d_out × d_out, unique whatever Q* does on span(W_K)⊥, with tr(Q*ᵀM) =
    tr(UᵀB) (B = M P when the statistics give M alone: S and C_D). When rank B < k (fewer calibration
    tokens than kept columns) Q* W_K depends on that completion, so the square M is solved
    (``rotation.polar``), as it is for k ≥ d_out; ``info["span"]`` says which ran.
    Products are in float32 for ``dtype='float32'`` (as the official code forms Y Aᵀ), else in float64
    (float32 products here moved a ratio-0 model's logits by 1.5e-5); ``rcpu_bench.compensation.rotation``
    documents the solvers and the choice of Q for a rank-deficient M. Q may be a reflection (det −1), as in
    the paper. Only ``solver='official'`` takes ``dtype='float32'`` alone: it reproduces the official float32
    numerics (the square SVD of M).
    """
    if solver == "official" and dtype != torch.float32:
        raise ValueError(f"solver='official' computes in float32 as the official code; got dtype={dtype}: "
                         "pass dtype='float32'")
    wk = problem.wk.to(dtype)
    d_out, k = wk.shape
    solved = None
    if solver != "official" and k < d_out and problem.stats.n >= k:  # rank B ≤ N
        solved = _rotate_on_kept_span(problem, wk, solver)
    if solved is None:
        result = polar(problem.yzt(dtype), solver)
        result.info["span"] = "outputs"
        solved = result.q @ wk, result
    solved[1].info["compute_dtype"] = str(dtype).removeprefix("torch.")
    return solved


def _rotate_on_kept_span(problem: Problem, wk: Tensor, solver: str) -> tuple[Tensor, Rotation] | None:
    """(U T, rotation of U) with W_K = P T and U = polar(B) (``rotate``); None when rank B < k.

    B = Y X_Kᵀ Tᵀ, or M P when only M = Y Zᵀ = B Pᵀ follows from the statistics (S and C_D).
    """
    if problem.has_yxk:
        factor = torch.linalg.qr(wk, mode="r").R  # W_K = P T, T k × k upper triangular
        b = problem.yxk.to(wk.dtype) @ factor.T
    else:
        basis, factor = torch.linalg.qr(wk)  # P d_out × k
        b = problem.yzt(wk.dtype) @ basis
    result = polar_columns(b, solver)
    if result is None:
        return None
    result.info["span"] = "kept columns"
    return result.q @ factor, result


def procrustes(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
               dtype: str = "float64", solver: str = "auto") -> Compensation:
    """RCPU rotation: W̃_K = Q* W_K with Q* = argmin_{QᵀQ=I} ‖Y − Q Z‖_F (paper eqs. procrustes_obj, wk_update)."""
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    new_weight, rot = rotate(problem, compute, solver)
    return _rotation_result(problem, new_weight, rot, compute)


def scaled_procrustes(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
                      dtype: str = "float64", solver: str = "auto") -> Compensation:
    """RCPU rotation + scale: W̃_K = s* Q* W_K with s* = tr(Σ) / ‖Z‖_F² (paper eq. scaled_sol); tr(Σ) = tr(Q*ᵀM)."""
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    rotated, rot = rotate(problem, compute, solver)
    if not problem.z_norm2 > 0:
        raise ValueError("‖Z‖_F² = 0: the kept columns carry no calibration signal, the scale is undefined")
    scale = rot.trace / float(problem.z_norm2)
    return _rotation_result(problem, scale * rotated, rot, compute, scale)


def _rotation_result(problem: Problem, new_weight: Tensor, rot: Rotation, compute: torch.dtype,
                     scale: float | None = None) -> Compensation:
    """``problem.result`` for W̃_K = s Q W_K, the objective after from ``Problem.rotated_error`` when Q is
    orthogonal to float64 precision (checked to c·n·eps), else from the general ``Problem.error``."""
    after = None
    if compute == torch.float64 and "orthogonality_unchecked" not in rot.info:
        def after() -> float:
            return problem.rotated_error(new_weight, 1.0 if scale is None else scale)
    return problem.result(new_weight, None, after, **({} if scale is None else {"scale": scale}), **rot.info)
