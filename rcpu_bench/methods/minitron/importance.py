"""Minitron's activation importance of a consumer's input channels (Muralidharan et al. 2024, arXiv 2407.14679;
NVIDIA ModelOpt), as a scorer before the run's compensator."""

from __future__ import annotations

from torch import Tensor

from rcpu_bench.selection.scorers import ActivationStat, activation_statistic, check_width
from rcpu_bench.statistics.activations import ActivationStats


def minitron(weight: Tensor, stats: ActivationStats, *, aggregation: ActivationStat = "mean-abs") -> Tensor:
    """Minitron's activation importance, squared: s_j = F_j², F_j = E|x_j| or ‖X[j,:]‖₂ (arXiv 2407.14679).

    Minitron (NVIDIA ModelOpt) scores the input channels of the MLP's down projection and of the attention's
    output projection by their activation magnitude aggregated over batch and sequence, F_j, and a head or
    key/value group by the L2 norm of its channels' F over its head_dim·queries columns, ‖F_head‖₂. Here F_j is
    aggregated over all calibration tokens: ``mean-abs`` E|x_j| (mean over batch and sequence) or ``l2``
    ‖X[j,:]‖₂ (L2 over both); ModelOpt's default, the mean over the sequence then the L2 over the batch, needs
    per-window sums that the token-pooled statistics do not keep. The score is F_j², so that a unit's summed
    score (``head_aggregation='sum'``) is ‖F_head‖₂² and ranks units as ‖F_head‖₂ does; W is not read.
    """
    check_width(weight, stats)
    return activation_statistic(stats, aggregation).square()
