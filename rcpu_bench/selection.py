"""Choosing which units (heads, key/value groups, MLP channels) of a module to prune."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Rounding = Literal["floor", "ceil"]


@dataclass(frozen=True)
class Selection:
    """Sorted index sets of kept (K) and pruned (D) units."""

    kept: Tensor
    pruned: Tensor

    def columns(self, unit_size: int) -> Selection:
        """Expand unit indices to the column indices they cover (unit u → columns [u·size, (u+1)·size))."""
        expand = lambda idx: (idx[:, None] * unit_size + torch.arange(unit_size, device=idx.device)).reshape(-1)  # noqa: E731
        return Selection(expand(self.kept), expand(self.pruned))


def n_pruned(n_units: int, ratio: float, rounding: Rounding = "floor") -> int:
    """Units to prune at ratio ρ: ⌊ρ·n⌋ (the official code) or ⌈ρ·n⌉ (the paper's text)."""
    if not 0.0 <= ratio < 1.0 or math.isnan(ratio):
        raise ValueError(f"pruning ratio {ratio!r} is outside the allowed range [0, 1)")
    if rounding == "floor":
        count = math.floor(ratio * n_units)
    elif rounding == "ceil":
        count = math.ceil(ratio * n_units)
    else:
        raise ValueError(f"unknown rounding {rounding!r}; allowed: 'floor', 'ceil'")
    if count >= n_units:
        raise ValueError(f"ratio {ratio} with {rounding} rounding would prune all {n_units} units of the module")
    return count


def select_by_score(scores: Tensor, ratio: float, rounding: Rounding = "floor") -> Selection:
    """Prune the n_pruned lowest-scoring units; ties go to the lower index being pruned first.

    A stable sort on (score, index) makes the choice deterministic and prunes exactly n_pruned units,
    unlike the reference code's ``score >= threshold`` rule, which keeps extra units on ties.
    """
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values")
    count = n_pruned(scores.numel(), ratio, rounding)
    order = torch.sort(scores, stable=True).indices
    return Selection(kept=order[count:].sort().values, pruned=order[:count].sort().values)


def select_all(n_units: int, device: torch.device | str | None = None) -> Selection:
    """Keep every unit (a module that is not pruned)."""
    return Selection(torch.arange(n_units, device=device), torch.empty(0, dtype=torch.long, device=device))
