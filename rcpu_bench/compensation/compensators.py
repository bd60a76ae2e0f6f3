"""Closed-form compensation of a pruned linear module from streamed input statistics.

Notation of the paper (§2): W (d_out × d_in), inputs X (d_in × N), dense output Y = W X, kept
columns K, dropped columns D, pruned output Z = W_K X_K. With G = Σ x xᵀ = X Xᵀ and s = Σ x:

    Y X_Kᵀ = W G[:,K]        M = Y Zᵀ = W G[:,K] W_Kᵀ        ‖Z‖_F² = tr(W_K G_KK W_Kᵀ)

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

from rcpu_bench.compensation.rotation import Rotation, polar
from rcpu_bench.statistics.activations import ActivationStats

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
    from C's columns K or W G[:,K] (never the full W G), ‖Y‖² from the streamed outputs, and the
    objective from the blocks G_DD, G_KK.
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

    @cached_property
    def yxk(self) -> Tensor:
        """Y X_Kᵀ (d_out × k): C[:,K] when C = Σ y xᵀ was collected, else W G[:,K]."""
        if self.stats.cross is not None:
            return self.stats.cross[:, self.kept]
        if self.stats.gram is None:
            raise ValueError("these statistics have neither the cross statistic C = Σ y xᵀ nor the Gram matrix G; "
                             "collect one for a compensator that declares needs='cross' or 'gram'")
        return self.w @ self.stats.gram[:, self.kept]

    @cached_property
    def gkk(self) -> Tensor:
        """X_K X_Kᵀ = G_KK."""
        return self.stats.require_gram()[self.kept[:, None], self.kept]

    @cached_property
    def y_norm2(self) -> Tensor:
        """‖Y‖_F²: streamed from the module's outputs, else tr(W G Wᵀ) (statistics without outputs)."""
        if self.stats.out_sq_sum is not None:
            return self.stats.out_sq_sum
        return ((self.w @ self.stats.require_gram()) * self.w).sum()

    @cached_property
    def z_norm2(self) -> Tensor:
        """‖Z‖_F² = tr(W_K G_KK W_Kᵀ)."""
        return ((self.wk @ self.gkk) * self.wk).sum()

    @cached_property
    def pruned_error(self) -> Tensor:
        """‖Y − W_K X_K‖_F² = ‖W_D X_D‖_F² = tr(W_D G_DD W_Dᵀ): the uncompensated error, without cancellation."""
        w_d = self.w[:, self.dropped]
        return ((w_d @ self.stats.require_gram()[self.dropped[:, None], self.dropped]) * w_d).sum()

    def error(self, new_weight: Tensor, bias: Tensor | None = None, quadratic: Tensor | None = None) -> float:
        """‖Y − W̃_K X_K − b 1ᵀ‖_F² over the calibration tokens, from the statistics alone.

        With Δ = W̃_K − W_K, Y − W̃_K X_K = W_D X_D − Δ X_K, so (without cancellation against ‖Y‖²)

            = tr(W_D G_DD W_Dᵀ) − 2⟨Δ, W_D G_DK⟩ + tr(Δ G_KK Δᵀ) − 2 bᵀ(W s − W̃_K s_K) + N‖b‖².

        ``quadratic``, when the compensator knows tr(W̃_K G_KK W̃_Kᵀ) more cheaply, is used in the form
        ‖Y‖² − 2⟨W̃_K, Y X_Kᵀ⟩ + quadratic instead (d_out·k flops instead of 2·d_out·k²).
        """
        if new_weight is self.wk and bias is None:
            return float(self.pruned_error.clamp_min(0))
        w_new = new_weight.detach().to(device=self.stats.device, dtype=torch.float64)
        if quadratic is not None:
            err = self.y_norm2 - 2 * (self.yxk * w_new).sum() + quadratic
        else:
            delta, w_d = w_new - self.wk, self.w[:, self.dropped]
            g_dk = self.stats.require_gram()[self.dropped[:, None], self.kept]
            err = self.pruned_error - 2 * ((w_d @ g_dk) * delta).sum() + ((delta @ self.gkk) * delta).sum()
        if bias is not None:
            b, s = bias.detach().to(device=self.stats.device, dtype=torch.float64), self.stats.sum
            err = err - 2 * b @ (self.w @ s - w_new @ s[self.kept]) + self.stats.n * b @ b
        return float(err.clamp_min(0))

    def rotated_error(self, new_weight: Tensor) -> float:
        """‖Y − Q Z‖_F² for W̃_K = Q W_K with Q orthogonal: ‖QZ‖ = ‖Z‖, so it is ``pruned_error`` + 2⟨W_K − W̃_K, Y X_Kᵀ⟩.

        (‖Y‖² and ‖Z‖² cancel between the two objectives; Q's orthogonality is checked to c·n·eps.)
        """
        w_new = new_weight.detach().to(device=self.stats.device, dtype=torch.float64)
        return float((self.pruned_error + 2 * (self.yxk * (self.wk - w_new)).sum()).clamp_min(0))

    def result(self, new_weight: Tensor, bias: Tensor | None = None, after: Callable[[], float] | None = None, /,
               **info: Any) -> Compensation:
        """Cast back to the module's dtype/device, reject non-finite values, record the objective before/after.

        The objective needs G; ``after``, when the compensator knows it more cheaply, computes the objective
        of ``new_weight``. ``new_weight``, ``bias`` and ``after`` are positional, so that any other name can be a key of
        ``info``.
        """
        if not torch.isfinite(new_weight).all() or (bias is not None and not torch.isfinite(bias).all()):
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


def _require_definite(failed: bool, spectrum: Tensor, lam: float) -> None:
    """Refuse a numerically singular G_KK + λI: its smallest pivot/eigenvalue must exceed k·eps·largest."""
    tolerance = len(spectrum) * torch.finfo(spectrum.dtype).eps * spectrum.abs().max()
    if failed or not (spectrum > tolerance).all():
        raise ValueError(f"G_KK + λI is singular at lam={lam} (fewer independent calibration tokens than kept "
                         "columns?); use a larger lam")


def _damping(gkk: Tensor, lam: float, lam_rel: float) -> tuple[float, dict[str, float | None]]:
    """λ = lam + lam_rel · mean diag G_KK (absolute, and relative on SparseGPT's ``percdamp`` scale), and the record of
    both scales: info["lambda"] = λ, info["lambda_rel"] = λ / mean diag G_KK (None when G_KK's diagonal is 0)."""
    if lam < 0 or lam_rel < 0:
        raise ValueError(f"ridge lam={lam}, lam_rel={lam_rel}; allowed: both >= 0")
    scale = float(gkk.diagonal().mean())
    total = lam + lam_rel * scale
    return total, {"lambda": total, "lambda_rel": total / scale if scale > 0 else None}


def ridge(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *, lam: float = 1e-4,
          lam_rel: float = 0.0, dtype: str = "float64") -> Compensation:
    """Ridge least squares W* = (Y X_Kᵀ + λ W_K)(X_K X_Kᵀ + λ I)⁻¹ (paper eq. astar), by Cholesky.

    Minimises ‖Y − W* X_K‖_F² + λ‖W* − W_K‖_F² (eq. err_A); G is a sum over tokens, so λ is the paper's.
    In float64 the objective's quadratic term is read off the normal equations, W* G_KK = B − λW* with
    B = Y X_Kᵀ + λW_K: tr(W* G_KK W*ᵀ) = ⟨B − λW*, W*⟩ (d_out·k flops instead of 2·d_out·k²).
    λ = lam + lam_rel · mean diag G_KK: ``lam_rel=0.01, lam=0`` is SparseGPT's / SlimGPT's damping.
    """
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    lam, damping = _damping(problem.gkk, lam, lam_rel)
    shifted = problem.gkk.to(compute, copy=True)  # problem.gkk stays unshifted for the objective
    shifted.diagonal().add_(lam)
    factor, fail = torch.linalg.cholesky_ex(shifted)
    pivots = factor.diagonal().square()
    _require_definite(bool(fail) or not torch.isfinite(pivots).all(), pivots, lam)
    # W* A = B with A symmetric  <=>  A W*ᵀ = Bᵀ.
    rhs = problem.yxk + lam * problem.wk  # B
    new_weight = torch.cholesky_solve(rhs.to(compute).T, factor).T
    after = None
    if compute == torch.float64:
        def after() -> float:
            return problem.error(new_weight, quadratic=((rhs - lam * new_weight) * new_weight).sum())
    return problem.result(new_weight, None, after, **damping)


def ridge_grid(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
               lams: Sequence[float] = LAMBDA_GRID, dtype: str = "float64") -> list[Compensation]:
    """Ridge solutions for a whole λ grid from one eigendecomposition G_KK = V diag(e) Vᵀ.

    W*(λ) = (W G[:,K] V + λ W_K V) diag(1/(e + λ)) Vᵀ: one matmul per λ after the shared eigh.
    """
    if not lams or any(lam < 0 for lam in lams):
        raise ValueError(f"ridge lams {list(lams)} must be a non-empty list of values >= 0")
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    evals, evecs = torch.linalg.eigh(problem.gkk.to(compute))
    yxk_v, wk_v = problem.yxk.to(compute) @ evecs, problem.wk.to(compute) @ evecs
    results = []
    for lam in lams:
        denom = evals + lam
        _require_definite(False, denom, lam)
        results.append(problem.result(((yxk_v + lam * wk_v) / denom) @ evecs.T, **_damping(problem.gkk, lam, 0.0)[1]))
    return results


def rotation(problem: Problem, dtype: torch.dtype, solver: str) -> Rotation:
    """Orthogonal Procrustes Q* = argmax_{QᵀQ=I} tr(QᵀM), M = Y Zᵀ = Y X_Kᵀ W_Kᵀ (paper eq. procrustes_sol).

    M is formed from Y X_Kᵀ (C[:,K] or W G[:,K]) and W_K: in float32 for ``dtype='float32'`` (as the official
    code forms Y Aᵀ), else in float64 (float32 products here moved a ratio-0 model's logits by 1.5e-5);
    ``rcpu_bench.compensation.rotation.polar`` documents
    the solvers and the choice of Q when M is rank-deficient.
    Q may be a reflection (det −1), as in the paper. Only ``solver='official'`` takes ``dtype='float32'``
    alone: it reproduces the official float32 numerics.
    """
    if solver == "official" and dtype != torch.float32:
        raise ValueError(f"solver='official' computes in float32 as the official code; got dtype={dtype}: "
                         "pass dtype='float32'")
    m = problem.yxk.to(dtype) @ problem.wk.to(dtype).T
    result = polar(m, solver)
    result.info["compute_dtype"] = str(dtype).removeprefix("torch.")
    return result


def procrustes(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
               dtype: str = "float64", solver: str = "auto") -> Compensation:
    """RCPU rotation: W̃_K = Q* W_K with Q* = argmin_{QᵀQ=I} ‖Y − Q Z‖_F (paper eqs. procrustes_obj, wk_update)."""
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    rot = rotation(problem, compute, solver)
    new_weight = rot.q @ problem.wk.to(compute)
    checked = compute == torch.float64 and "orthogonality_unchecked" not in rot.info
    return problem.result(new_weight, None, (lambda: problem.rotated_error(new_weight)) if checked else None,
                          **rot.info)


def scaled_procrustes(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *,
                      dtype: str = "float64", solver: str = "auto") -> Compensation:
    """RCPU rotation + scale: W̃_K = s* Q* W_K with s* = tr(Σ) / ‖Z‖_F² (paper eq. scaled_sol); tr(Σ) = tr(Q*ᵀM)."""
    compute, problem = _dtype(dtype), Problem(weight, stats, kept)
    rot = rotation(problem, compute, solver)
    if not problem.z_norm2 > 0:
        raise ValueError("‖Z‖_F² = 0: the kept columns carry no calibration signal, the scale is undefined")
    scale = rot.trace / float(problem.z_norm2)
    return problem.result(scale * rot.q @ problem.wk.to(compute), scale=scale, **rot.info)
