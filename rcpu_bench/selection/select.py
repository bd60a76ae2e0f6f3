"""Choosing which units (heads, key/value groups, MLP channels) of a module to prune."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch
from torch import Tensor

Rounding = Literal["floor", "ceil"]


@dataclass(frozen=True)
class UnitMap:
    """How one module's prunable units map to its consumer's input columns.

    Unit u covers columns [u·unit_size, (u+1)·unit_size). ``group_size`` > 1: units are selected within
    contiguous groups of that many (query heads per key/value group under the "query" GQA rule).
    """

    unit_size: int
    group_size: int = 1


@dataclass(frozen=True)
class Selection:
    """Sorted index sets of kept (K) and pruned (D) units."""

    kept: Tensor
    pruned: Tensor

    def columns(self, unit_size: int) -> Selection:
        """Expand unit indices to the column indices they cover (unit u → columns [u·size, (u+1)·size))."""

        def expand(idx: Tensor) -> Tensor:
            return (idx[:, None] * unit_size + torch.arange(unit_size, device=idx.device)).reshape(-1)

        return Selection(expand(self.kept), expand(self.pruned))


def n_pruned(n_units: int, ratio: float, rounding: Rounding = "floor") -> int:
    """Units to prune at ratio ρ: ⌊ρ·n⌋ (the official code) or ⌈ρ·n⌉ (the paper's text).

    ρ·n is computed exactly from ρ's decimal form, so 0.29·100 gives 29 (binary floating point says 28.999…).
    """
    if math.isnan(ratio) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"pruning ratio {ratio!r} is outside the allowed range [0, 1)")
    exact = Fraction(str(ratio)) * n_units
    if rounding == "floor":
        count = math.floor(exact)
    elif rounding == "ceil":
        count = math.ceil(exact)
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
    return select_lowest(scores, n_pruned(scores.numel(), ratio, rounding))


def select_lowest(scores: Tensor, count: int) -> Selection:
    """Prune the ``count`` lowest-scoring units (a stable sort: on ties the lower index is pruned first)."""
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values")
    if not 0 <= count < scores.numel():
        raise ValueError(f"cannot prune {count} of {scores.numel()} units; allowed: 0 to {scores.numel() - 1}")
    order = torch.sort(scores, stable=True).indices
    return Selection(kept=order[count:].sort().values, pruned=order[:count].sort().values)


def select_within_groups(scores: Tensor, group_size: int, count: int) -> Selection:
    """Prune the ``count`` lowest-scoring units inside every contiguous group of ``group_size``.

    The GQA "query" rule: each key/value group keeps all its k/v rows and loses the same number of its
    query heads, so every group still serves the same number of query heads.
    """
    if scores.numel() % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {scores.numel()} units")
    picks = [select_lowest(group, count) for group in scores.reshape(-1, group_size)]
    return Selection(torch.cat([p.kept + g * group_size for g, p in enumerate(picks)]),
                     torch.cat([p.pruned + g * group_size for g, p in enumerate(picks)]))


def kept_multiple(channels: int, unit_size: int) -> int:
    """Units whose columns make a multiple of ``channels``: m = channels / gcd(channels, unit_size)."""
    return channels // math.gcd(channels, unit_size)


def round_kept(selection: Selection, scores: Tensor, multiple: int) -> Selection:
    """``selection`` with its kept units rounded to the multiple of ``multiple`` nearest to |K| (ties upward),
    within [multiple, n]: the best-scoring pruned units are kept back, or the worst-scoring kept ones pruned
    (ties as ``select_by_score``: the lower index is pruned first).

    ValueError when the module has fewer than ``multiple`` units (no multiple fits).
    """
    n = scores.numel()
    if n < multiple:
        raise ValueError(f"cannot keep a multiple of {multiple} units in a module of {n}")
    target = min(max(multiple * math.floor(len(selection.kept) / multiple + 0.5), multiple), n - n % multiple)
    kept, pruned = selection.kept, selection.pruned
    # Units in pruning order (score, then lower index first, as select_by_score): restore the last pruned ones,
    # or prune the first kept ones.
    if target > len(kept):
        order = pruned[torch.sort(scores[pruned], stable=True).indices]
        split = len(order) - (target - len(kept))
        kept, pruned = torch.cat([kept, order[split:]]), order[:split]
    elif target < len(kept):
        order = kept[torch.sort(scores[kept], stable=True).indices]
        kept, pruned = order[len(kept) - target:], torch.cat([pruned, order[:len(kept) - target]])
    return Selection(kept.sort().values, pruned.sort().values)
