"""Column importance scores s_j for an input column j of a linear module (higher = keep).

Every scorer takes the module weight W (d_out × d_in) and the streamed input statistics and returns a
float64 vector of d_in scores. Definitions follow docs/methods.md §2.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rcpu_bench.statistics.activations import ActivationStats

WandaVariant = Literal["flap", "rcpu-code", "paper"]
ActivationStat = Literal["l2", "mean-abs"]


def check_width(weight: Tensor, stats: ActivationStats) -> None:
    if weight.shape[1] != stats.d_in:
        raise ValueError(f"weight has {weight.shape[1]} input columns but the statistics have d_in={stats.d_in}")


def _columns(weight: Tensor, stats: ActivationStats) -> Tensor:
    check_width(weight, stats)
    return weight.detach().to(device=stats.device, dtype=torch.float64)


def activation_statistic(stats: ActivationStats, which: ActivationStat) -> Tensor:
    if which == "l2":
        return stats.l2_norm
    if which == "mean-abs":
        return stats.mean_abs
    raise ValueError(f"unknown activation statistic {which!r}; allowed: 'l2', 'mean-abs'")


def magnitude(weight: Tensor, stats: ActivationStats) -> Tensor:
    """Column magnitude s_j = ‖W[:,j]‖₂ (data-free)."""
    return _columns(weight, stats).norm(dim=0)


def wanda_sp(weight: Tensor, stats: ActivationStats, *, variant: WandaVariant = "flap") -> Tensor:
    """WANDA-sp s_j = ‖W[:,j]‖ · ‖X[j,:]‖.

    Variant flap: ‖W_j‖₁·‖X_j‖₂, rcpu-code: ‖W_j‖₁·mean|x_j|, paper: ‖W_j‖₂·‖X_j‖₂.

    FLAP's mean_i |W_ij|·‖X_j‖₂ differs from ``flap`` by the constant 1/d_out, so rankings are equal.
    """
    w = _columns(weight, stats)
    if variant == "flap":
        return w.abs().sum(0) * stats.l2_norm
    if variant == "rcpu-code":
        return w.abs().sum(0) * stats.mean_abs
    if variant == "paper":
        return w.norm(dim=0) * stats.l2_norm
    raise ValueError(f"unknown wanda-sp variant {variant!r}; allowed: 'flap', 'rcpu-code', 'paper'")


def variance(weight: Tensor, stats: ActivationStats, *, activation: ActivationStat = "l2") -> Tensor:
    """Variance-aware γ_j = ‖W[:,j]‖₂ · ‖X[j,:]‖ · Var(X[j,:]) (paper eq. gamma).

    ``activation='l2'`` uses ‖X_j‖₂ as the paper writes; ``'mean-abs'`` uses E|x_j| as the official
    code does. Var is the mean-centred population variance.
    """
    return _columns(weight, stats).norm(dim=0) * activation_statistic(stats, activation) * stats.variance


def flap_wifv(weight: Tensor, stats: ActivationStats) -> Tensor:
    """FLAP's weighted input-feature variance s_j = Var(x_j) · ‖W[:,j]‖₂² (sample variance)."""
    return stats.sample_variance * _columns(weight, stats).square().sum(0)


def unit_scores(scores: Tensor, unit_size: int, how: Literal["sum", "standardized-mean"] = "sum") -> Tensor:
    """Aggregate per-column scores into scores of contiguous units of ``unit_size`` columns.

    A unit is an attention head (unit_size = head_dim) or a GQA key/value group (head_dim × query
    heads per group); o_proj columns are head-major, so each unit is a contiguous block.
    ``sum`` adds the unit's column scores (RCPU, FLAP UL-UM); ``standardized-mean`` standardizes the
    layer's columns, (s − mean)/std, then averages within each unit (FLAP AL-AM).
    """
    if unit_size < 1 or scores.numel() % unit_size:
        raise ValueError(f"unit_size={unit_size} does not divide the {scores.numel()} columns")
    if how == "sum":
        return scores.reshape(-1, unit_size).sum(1)
    if how == "standardized-mean":
        return standardize(scores).reshape(-1, unit_size).mean(1)
    raise ValueError(f"unknown aggregation {how!r}; allowed: 'sum', 'standardized-mean'")


def standardize(scores: Tensor) -> Tensor:
    """(s − mean(s)) / std(s) over one layer's module, as FLAP's adaptive structure search does."""
    centred = scores - scores.mean()
    std = scores.std()
    return centred / std if std > 0 else centred
