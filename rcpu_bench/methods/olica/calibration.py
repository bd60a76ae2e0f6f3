"""Olica's linear calibration of a pruned FFN, on the consumer's kept inputs (He & Lin, ICML 2025, arXiv 2506.08436).

Olica calibrates a pruned FFN layer by regressing its pruning error E (the dense output minus the pruned one) on
the layer's input by ridge least squares, and keeps a rank-r truncated SVD of the solution as two small matrices
(its "linear calibration": a low-rank branch beside the pruned FFN; the damping λ is its ``percdamp``). Here the
same rank-r ridge regression is made on the statistics the consumer already streams: the regressors are the kept
inputs X_K of the consumer (down_proj's kept channels), the target is the pruned error E = W_D X_D, and the
low-rank solution is merged into the kept weight, so the pruned model keeps its structure:

    Δ_r = argmin_{rank Δ ≤ r} ‖W_D X_D − Δ X_K‖_F² + λ‖Δ‖_F²,     W̃_K = W_K + Δ_r      (Olica's loss, its eq. 7)

With A = G_KK + λI = L Lᵀ and R = W_D G_DK the objective is tr(W_D G_DD W_Dᵀ) + ‖Δ L − T‖_F² − ‖T‖_F², T = R L⁻ᵀ, so
(Eckart–Young) Δ_r = [T]_r L⁻¹, [T]_r the rank-r truncated SVD of T, r = ⌈rank · min(d_out, |K|)⌉: the full-rank
solution is the ridge correction W_D G_DK A⁻¹ (the ``ridge`` compensator at lam=0, this lam_rel), and every rank
lowers the calibration error below the uncompensated one. Olica truncates the SVD of the solution itself, which is
this one when the kept inputs are whitened (A ∝ I). λ = lam_rel · mean diag G_KK: Olica's default ``percdamp`` 0.5
is λ = 0.5 · mean diag of its Gram matrix at its 128 windows of 128 tokens; ``rank`` 0.03 is its low-rank ratio.
G alone is read.

Not covered: Olica's orthogonal neuron decomposition of attention (the SVD of W_q W_kᵀ and W_v W_oᵀ), and its
calibration from the FFN's input h instead of the kept channels. That branch would need the statistics of another
module's input, Σ h hᵀ and Σ h x_Dᵀ (for Σ h Eᵀ = (Σ h x_Dᵀ) W_Dᵀ), beyond what ``needs`` declares for one
consumer, and a module the pruned model's format cannot hold. The compensator acts wherever the run compensates
(``compensate``), attention included.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rcpu_bench.compensation.compensators import Compensation, Problem, relative_damping, require_definite
from rcpu_bench.statistics.activations import ActivationStats


def olica(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, *, rank: float = 0.03,
          lam_rel: float = 0.5) -> Compensation:
    """Olica's linear calibration on the kept inputs: W̃_K = W_K + Δ_r, the rank-r ridge least squares of the pruned
    error W_D X_D on X_K, λ = lam_rel · mean diag G_KK (He & Lin, ICML 2025)."""
    if not 0 < rank <= 1:
        raise ValueError(f"olica rank={rank!r}: the fraction of the correction's rank kept; allowed: a number in "
                         "(0, 1]")
    problem = Problem(weight, stats, kept)
    lam, damping = relative_damping(problem, 0.0, lam_rel)
    shifted = problem.kept_block()  # A = G_KK + λI
    shifted.diagonal().add_(lam)
    factor, fail = torch.linalg.cholesky_ex(shifted)  # A = L Lᵀ
    pivots = factor.diagonal().square()
    require_definite(bool(fail) or not torch.isfinite(pivots).all(), pivots, lam)
    t = torch.linalg.solve_triangular(factor.T, problem.dropped_coupling, upper=True, left=False)  # T = R L⁻ᵀ
    u, s, vh = torch.linalg.svd(t, full_matrices=False)
    r = math.ceil(rank * min(t.shape))
    low_rank = torch.linalg.solve_triangular(factor, (u[:, :r] * s[:r]) @ vh[:r], upper=False, left=False)  # [T]_r L⁻¹
    return problem.result(problem.wk + low_rank, None, None, rank=r, **damping)


def low_rank_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    """A rank-r update of the d_out × |K| kept weight (r = ``compensation.info["rank"]``): r·(d_out + |K| − r)."""
    rank = int(compensation.info["rank"])
    return rank * (weight.shape[0] + len(kept) - rank)
