"""How many units each layer loses: the ``allocation`` axis of a run, every allocation parameter-matched to ρ.

- ``uniform``: every layer at ρ (RCPU, WANDA-sp);
- ``log-increase``: SlimGPT's incremental ratio, growing with the logarithm of the depth (:func:`log_increase`);
- ``al-am``: FLAP's adaptive structure, one global threshold on standardized unit scores (:func:`al_am`); the
  option ``structure: al-am`` is the same allocation (``allocation: al-am`` is stored as it, so cell ids stay);
- ``search``: Týr-the-Pruner's evolutionary search over per-layer levels on the model itself
  (``rcpu_bench.methods.search``), a ``hookspecs.ModelAllocation``;
- a third-party profile or model allocation registered with the ``register_allocations`` hook
  (``hookspecs.Allocation``).

``uniform`` and ``log-increase`` are registered profiles (per-layer ratios whose mean is ρ, so layers of equal size
lose ρ of their parameters in total); AL-AM depends on the data, so the pipeline computes it from a dense pass; a
model allocation returns units per layer and module (checked by :func:`counts_problem`).
"""

from __future__ import annotations

import math
from typing import Any, Final, NamedTuple

import torch
from torch import Tensor, nn

from rcpu_bench.model.adapter import layer_view
from rcpu_bench.selection.scorers import unit_scores
from rcpu_bench.selection.select import Rounding, Selection, UnitMap, n_pruned

__all__ = ["AL_AM", "AL_AM_SCORER", "UNIFORM", "Unit", "al_am", "counts_problem", "layer_units", "log_increase",
           "uniform", "units_to_prune"]
# AL-AM needs a score per unit; a selector (OBS) has none, so its per-layer counts come from FLAP's own score.
AL_AM: Final = "al-am"  # the allocations the pipeline computes itself (Final: typed as their literal values)
UNIFORM: Final = "uniform"
AL_AM_SCORER = "flap-wifv"


def units_to_prune(mapping: UnitMap, n_units: int, ratio: float, rounding: Rounding) -> int:
    """⌊ρ·n⌋ (or ⌈ρ·n⌉) of a module's n units; under GQA's "query" rule the same number in every group."""
    if mapping.group_size > 1:
        return n_units // mapping.group_size * n_pruned(mapping.group_size, ratio, rounding)
    return n_pruned(n_units, ratio, rounding)


def uniform(n_layers: int, ratio: float, /) -> Tensor:
    """Every layer at the target ratio: ρ_l = ρ."""
    return torch.full((n_layers,), float(ratio), dtype=torch.float64)


def log_increase(n_layers: int, ratio: float, /, *, spread: float = 1.0) -> Tensor:
    """SlimGPT's incremental ratio: ρ_l = ρ + s·(p_l − mean p), p_l = ln(1 + l) / ln(L), l = 0 … L−1.

    Computed as ρ·(1 − spread) + spread·ρ·p_l / mean p, so that layer 0 is exactly ρ·(1 − spread) (never −1e-17).

    The mean of ρ_l is ρ (parameter-matched); s = spread·ρ / mean p, so layer 0 keeps ρ·(1 − spread) and
    ``spread=1`` leaves it unpruned.
    """
    if not 0.0 <= spread <= 1.0:
        raise ValueError(f"log-increase spread={spread!r}; allowed: a number in [0, 1]")
    if n_layers == 1:
        return uniform(1, ratio)
    depth = torch.log1p(torch.arange(n_layers, dtype=torch.float64)) / math.log(n_layers)
    ratios = ratio * (1 - spread) + spread * ratio * depth / depth.mean()  # = ρ + s·(p_l − mean p), p_0 = 0 exact
    if not ratios.max() < 1:
        raise ValueError(f"log-increase at ratio={ratio}, spread={spread} gives the last layer ratio "
                         f"{float(ratios.max()):.3f} >= 1; allowed: a smaller spread or ratio")
    return ratios


def counts_problem(counts: Any, n_units: list[dict[str, int]]) -> str | None:
    """What is wrong with a model allocation's ``counts`` (per layer, {module: units to prune}) for layers of
    ``n_units`` units per module, or None: one dict per layer, the same modules, integers in [0, n)."""
    if not isinstance(counts, list) or len(counts) != len(n_units):
        return f"{type(counts).__name__} counts; expected a list of {len(n_units)} dicts, one per layer"
    for index, (chosen, units) in enumerate(zip(counts, n_units, strict=True)):
        if not isinstance(chosen, dict) or set(chosen) != set(units) or not all(
                isinstance(chosen[m], int) and not isinstance(chosen[m], bool) and 0 <= chosen[m] < n
                for m, n in units.items()):
            return f"layer {index} counts {chosen!r}; expected {{module: an integer in [0, units)}} for {units}"
    return None


class Unit(NamedTuple):
    """One prunable unit for AL-AM: its standardized score, parameter cost and place."""

    score: float
    cost: float
    layer: int
    module: str
    index: int  # type: ignore[assignment]  # shadows tuple.index, which no caller uses


def layer_units(layer: nn.Module, index: int, module: str, scores: Tensor, gqa_rule: str) -> list[Unit]:
    """AL-AM unit scores of one module: mean of standardized column scores (o_proj scores squared first)."""
    view = layer_view(layer)
    mapping = view.units(module, gqa_rule)
    if mapping.group_size > 1:
        raise ValueError("structure='al-am' prunes whole key/value groups; use gqa_rule='group'")
    if module == "attention":
        scores = scores.square()
    cost = view.unit_cost(module)
    units = unit_scores(scores, mapping.unit_size, "standardized-mean")
    return [Unit(float(score), cost, index, module, u) for u, score in enumerate(units)]


def al_am(units: list[Unit], ratio: float, n_layers: int, modules: list[str]) -> list[dict[str, Selection]]:
    """FLAP AL-AM: all units of all layers sorted by score and kept, best first, while the kept cost moves closer
    to (1 − ρ) of the total (a global threshold; units weighted by parameter cost).

    Unlike FLAP, every module keeps at least its best unit, so no layer loses all heads or channels.
    """
    kept = _global_keep(units, ratio)
    return [{m: _selection([u for u in units if u.layer == i and u.module == m], kept) for m in modules}
            for i in range(n_layers)]


def _global_keep(units: list[Unit], ratio: float) -> set[Unit]:
    """Best-first units whose cumulative cost is closest to (1 − ρ)·total, plus each module's best unit."""
    ordered = sorted(units, key=lambda u: (-u.score, u.layer, u.module, u.index))
    target = (1 - ratio) * sum(u.cost for u in units)
    kept, cost = set(), 0.0
    for unit in ordered:
        if abs(cost + unit.cost - target) > abs(cost - target):
            break
        kept.add(unit)
        cost += unit.cost
    best: dict[tuple[int, str], Unit] = {}
    for unit in ordered:
        best.setdefault((unit.layer, unit.module), unit)
    return kept | set(best.values())


def _selection(module_units: list[Unit], kept: set[Unit]) -> Selection:
    mask = torch.tensor([u in kept for u in sorted(module_units, key=lambda u: u.index)])
    return Selection(mask.nonzero().flatten(), (~mask).nonzero().flatten())
