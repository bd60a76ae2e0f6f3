"""One decoder layer's prune-and-compensate, the steps of the pipeline (``rcpu_bench.pruning.pipeline``): the plan of
the statistics each module's pass streams (the cheapest sufficient set, ``statistics.flops``; the layer walk,
``rcpu_bench.pruning.walk``, runs the pass), the selection of units by the run's scorer or selector, the
compensation, and the surgery that shrinks the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor

from rcpu_bench.compensation.diagnostics import module_generalisation
from rcpu_bench.hookspecs import ScorerEntry, SelectorEntry
from rcpu_bench.model.capture import LayerInput
from rcpu_bench.model.views import LayerView
from rcpu_bench.pruning.allocation import units_to_prune
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.timing import Timer
from rcpu_bench.registry import Resolved
from rcpu_bench.selection.scorers import unit_scores
from rcpu_bench.selection.select import (
    Selection,
    UnitMap,
    kept_multiple,
    round_kept,
    select_lowest,
    select_within_groups,
)
from rcpu_bench.statistics.activations import ActivationStats
from rcpu_bench.statistics.flops import cheapest_statistics, expected_kept


def select_units(mapping: UnitMap, scores: Tensor, n_prune: int, how: str, round_to: int = 0) -> Selection:
    """The scorer's selection: the ``n_prune`` lowest unit scores pruned, split equally over GQA groups if any;
    with ``round_to``, the kept width rounded to a multiple of that many channels (``round_kept``)."""
    units = unit_scores(scores, mapping.unit_size, how)  # type: ignore[arg-type]
    if mapping.group_size > 1:
        return select_within_groups(units, mapping.group_size, n_prune // (units.numel() // mapping.group_size))
    selection = select_lowest(units, n_prune)
    if round_to:
        return round_kept(selection, units, kept_multiple(round_to, mapping.unit_size))
    return selection


def select(weight: Tensor, stats: ActivationStats, mapping: UnitMap, n_prune: int, config: PruneConfig,
           methods: Resolved) -> Selection:
    """Kept and pruned units of a module: the run's selector, or its scorer's lowest units (the common case)."""
    selection = methods.selection
    if selection.kind == "selector":
        return cast(SelectorEntry, selection)(weight, stats, mapping, n_prune, **config.scorer_params)
    scores = cast(ScorerEntry, selection)(weight, stats, **config.scorer_params)
    return select_units(mapping, scores, n_prune, config.head_aggregation, config.round_to)


def prune_module(view: LayerView, module: str, stats: ActivationStats, config: PruneConfig, methods: Resolved,
                 timer: Timer, units: Selection | None = None,
                 held_out: ActivationStats | None = None, *, n_prune: int | None = None) -> dict[str, Any]:
    """Select, compensate and shrink one module of one layer (``layer_view(layer)``); returns its diagnostics.

    ``units`` given: that selection; else ``n_prune`` units (default: the uniform count at ``config.ratio``)
    chosen by the run's scorer or selector.
    """
    proj = view.projection(module)
    mapping = view.units(module, config.gqa_rule)
    if units is None:
        count = (units_to_prune(mapping, view.n_units(module, config.gqa_rule), config.ratio, config.rounding)
                 if n_prune is None else n_prune)
        with timer("score"):
            units = select(proj.weight, stats, mapping, count, config, methods)
    columns = units.columns(mapping.unit_size)
    compensator = methods.compensator_for(module in config.compensate)
    params = config.compensator_params if module in config.compensate else {}
    with timer("solve"):
        result = compensator(proj.weight, stats, columns.kept, columns.pruned, **params)
    diagnostics = {} if held_out is None else {
        "generalisation": module_generalisation(proj.weight, stats, held_out, columns.kept, result, compensator.dof)}
    view.apply(module, columns, result.weight, added_bias(proj.bias, result.bias))
    # The compensator's own diagnostics (already checked strict-JSON by the registry) stay under "info", so no
    # plugin can overwrite the harness's fields.
    return {"compensator": compensator.name, "units_total": len(units.kept) + len(units.pruned),
            "units_pruned": len(units.pruned), "pruned_units": units.pruned.tolist(), "info": dict(result.info),
            **diagnostics, **post_norm_notes(view, module, result.info)}


def added_bias(existing: Tensor | None, compensation: Tensor | None) -> Tensor | None:
    """The consumer's new bias: a compensator's bias adds to the existing one (FLAP: b₀ + W_D μ_D); None keeps it."""
    if compensation is None or existing is None:
        return compensation
    return existing.detach() + compensation


def post_norm_notes(view: LayerView, module: str, info: dict[str, Any]) -> dict[str, bool]:
    """Notes for a module whose output goes through a norm before the residual (Gemma's sandwich norms).

    An RMSNorm divides out any common scale s of its input (RMSNorm(s·y) = RMSNorm(y) up to ε), so a
    compensator's scale (``info["scale"]``: scaled-procrustes' s*) has no effect there: ``scale_void``
    records that the run is the unscaled method, instead of reporting a distinct one.
    """
    if view.post_norm(module) is None:
        return {}
    return {"post_norm": True, **({"scale_void": True} if "scale" in info else {})}


@dataclass(frozen=True)
class Plan:
    """What one module's statistics pass collects: ``kinds`` (statistics/flops.py) and, for "dropped_cross", the
    dropped columns fixed before the pass."""

    kinds: frozenset[str]
    dropped: Tensor | None = None


def statistics_plan(view: LayerView, needs: dict[str, str], inputs: list[LayerInput], config: PruneConfig,
                     allocated: dict[str, Selection | int] | None = None) -> dict[str, Plan]:
    """Per module, the cheapest statistics sufficient for its need over these inputs' tokens (statistics/flops.py);
    a module whose units are ``allocated`` before the pass (a Selection) may collect S and C_D over its dropped
    columns."""
    tokens = sum(x.hidden.shape[:-1].numel() for x in inputs)
    plan = {}
    for module, need in needs.items():
        d_out, d_in = view.projection(module).weight.shape
        chosen = (allocated or {}).get(module)
        columns = (chosen.columns(view.units(module, config.gqa_rule).unit_size) if isinstance(chosen, Selection)
                   else None)
        kept = expected_kept(d_in, config.ratio) if columns is None else len(columns.kept)
        kinds = cheapest_statistics(need, tokens, d_out, d_in, kept, config.gram_precision,
                                    selected=columns is not None)
        plan[module] = Plan(kinds, columns.pruned if columns is not None and "dropped_cross" in kinds else None)
    return plan


def statistics_needs(modules: Sequence[str], config: PruneConfig, methods: Resolved) -> dict[str, str]:
    """What each module's scorer and compensator read; G for every pruned module with the held-out diagnostics."""
    return {m: "gram" if config.holdout else methods.needs(m in config.compensate) for m in modules}
