"""SlimLLM's linear regression of the output matrix (Guo et al., ICML 2025, arXiv 2505.22689).

After pruning, SlimLLM refits each output row i of the consumer (o_proj, down_proj) by a one-variable affine least
squares of the dense output on the pruned one, Ŷ = W_K X_K:

    (a_i, b_i) = argmin_{a, b} Σ_t (y_it − a·ŷ_it − b)²,    W̃_K = diag(a) W_K,   bias b

(the code's ``np.polyfit(ŷ_i, y_i, 1)`` per output channel). In closed form, with N tokens and the sums
Sŷ_i = (W_K s_K)_i, Sy_i = (W s)_i (s = Σ x), Sŷŷ_i = (W_K G_KK W_Kᵀ)_ii and Syŷ_i = (Y X_Kᵀ W_Kᵀ)_ii:

    a_i = (Syŷ_i − Sy_i Sŷ_i / N) / (Sŷŷ_i − Sŷ_i² / N),    b_i = (Sy_i − a_i Sŷ_i) / N,

the covariance of y_i and ŷ_i over the variance of ŷ_i; a row whose ŷ_i is constant over the tokens (variance
within rounding of 0) keeps a_i = 1. It reads G (for W_K G_KK W_Kᵀ and Y X_Kᵀ = W G[:,K]) and the moments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcpu_bench.compensation.compensators import Compensation, Problem
from rcpu_bench.statistics.activations import ActivationStats


def slimllm(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor) -> Compensation:
    """SlimLLM's per-row affine refit: W̃_K = diag(a) W_K, bias b, (a_i, b_i) the least squares of y_i on ŷ_i."""
    problem = Problem(weight, stats, kept)
    n, wk = stats.n, problem.wk
    kept_sum = wk @ stats.sum[problem.kept]  # Sŷ (d_out,)
    dense_sum = problem.w @ stats.sum  # Sy (d_out,)
    kept_square = ((wk @ problem.gkk) * wk).sum(1)  # Sŷŷ = diag(W_K G_KK W_Kᵀ)
    cross = (problem.yxk * wk).sum(1)  # Syŷ = diag(Y X_Kᵀ W_Kᵀ)
    variance = kept_square - kept_sum.square() / n
    constant = variance <= n * torch.finfo(variance.dtype).eps * kept_square
    scale = torch.where(constant, torch.ones_like(variance), (cross - dense_sum * kept_sum / n) / variance)
    bias = (dense_sum - scale * kept_sum) / n
    return problem.result(scale[:, None] * wk, bias)


def affine_rows_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    """A scale and a bias per output row: 2·d_out."""
    return 2 * weight.shape[0]
