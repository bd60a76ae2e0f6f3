"""How many units each layer's modules lose, decided before the layer loop (``pruning/allocation.py`` has the
profiles): uniform, a registered per-layer profile (log-increase), FLAP's global adaptive structure (AL-AM: one dense
pass scoring every unit, ``global_selections``), or a registered allocation that searches the model itself
(``AllocationTask``, e.g. ``search``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench import strict_json
from rcpu_bench.model.adapter import decoder_layers, layer_view
from rcpu_bench.model.views import LayerView
from rcpu_bench.pruning.allocation import (
    AL_AM,
    AL_AM_SCORER,
    Unit,
    al_am,
    counts_problem,
    layer_units,
    units_to_prune,
)
from rcpu_bench.pruning.layer_pass import Plan, prune_module, statistics_needs, statistics_plan
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.timing import Timer
from rcpu_bench.pruning.walk import walk_layers
from rcpu_bench.registry import PluginContractError, Registry, Resolved
from rcpu_bench.selection.select import Selection, kept_multiple, round_kept
from rcpu_bench.statistics.activations import ActivationStats


@dataclass
class AllocationTask:
    """What an allocation is handed (a ``hookspecs.ModelAllocation`` sees all of it): the dense model, the run's
    calibration windows, options and methods, and where held-out windows come from."""

    model: nn.Module
    calib_ids: Tensor
    config: PruneConfig
    methods: Resolved
    device: torch.device
    progress: bool = True
    holdout_source: Callable[[int], Tensor] | None = None

    @property
    def modules(self) -> list[str]:
        """The pruned modules, in pruning order."""
        return list(self.config.pruned_modules)

    def holdout(self, n_windows: int) -> Tensor:
        """``n_windows`` held-out windows (n × seqlen token ids), disjoint from the calibration windows and from the
        ``config.holdout`` windows of the diagnostics (those come first in ``data.holdout_windows``' order)."""
        if self.holdout_source is None:
            raise ValueError(f"allocation {self.config.allocation!r} scores on held-out windows, and this run has no "
                             "source of them; allowed: prune_model(..., holdout_source=...) (data.holdout_windows)")
        return self.holdout_source(self.config.holdout + n_windows)[self.config.holdout:]

    def dense_layers(self) -> Iterator[tuple[int, LayerView, dict[str, ActivationStats]]]:
        """Each decoder layer (on the device while it is yielded) with the statistics its modules' scorer and
        compensator read, planned as the run plans them, from one pass of the dense model over the calibration
        windows (the layer walk): one-shot, every layer sees the dense outputs of the layer before."""
        needs = statistics_needs(self.modules, self.config, self.methods)
        for step in walk_layers(self.model, self.calib_ids, self.config, self.device,
                                plan=lambda step: statistics_plan(step.view, needs, step.inputs, self.config)):
            yield step.index, step.view, step.stats

    def prune(self, view: LayerView, module: str, stats: ActivationStats, n_prune: int) -> dict[str, Any]:
        """Prune ``n_prune`` units of one module of ``view`` in place with the run's scorer or selector and
        compensator (``prune_module``); returns its diagnostics."""
        return prune_module(view, module, stats, self.config, self.methods, Timer(self.device), n_prune=n_prune)


def allocate(task: AllocationTask, registry: Registry
             ) -> tuple[list[dict[str, Selection | int]], dict[str, Any] | None]:
    """Each layer's plan per module: a selection (AL-AM with a scorer: FLAP's global choice of units) or the number
    of units its scorer or selector prunes (uniform, a registered profile, AL-AM's counts with a selector, or a
    model allocation's counts); and the model allocation's report for the record (``{"allocation": ...}``), else
    None."""
    model, calib_ids, config, methods, device = task.model, task.calib_ids, task.config, task.methods, task.device
    layers = decoder_layers(model)
    modules = task.modules
    if config.structure == AL_AM:
        scorer = methods.selection if methods.selection.kind == "scorer" else registry.scorer(AL_AM_SCORER)
        params = config.scorer_params if scorer is methods.selection else {}
        selections = global_selections(model, calib_ids, config, scorer, params, device)
        if scorer is methods.selection:
            return selections, None  # type: ignore[return-value]
        return [{m: len(chosen[m].pruned) for m in modules} for chosen in selections], None
    allocation = methods.allocation
    assert allocation is not None  # prune_model resolved config.allocation
    profile = allocation(len(layers), config.ratio, **config.allocation_params)
    if callable(profile):
        return _model_allocation(task, profile, allocation.name, allocation.provider)
    ratios = profile.tolist()
    plans: list[dict[str, Selection | int]] = []
    for layer, ratio in zip(layers, ratios, strict=True):
        view = layer_view(layer)
        plans.append({m: units_to_prune(view.units(m, config.gqa_rule), view.n_units(m, config.gqa_rule), ratio,
                                        config.rounding) for m in modules})
    return plans, None


def _model_allocation(task: AllocationTask, allocation: Callable[[AllocationTask], Any], name: str, provider: str
                      ) -> tuple[list[dict[str, Selection | int]], dict[str, Any]]:
    """A ``hookspecs.ModelAllocation``'s counts and report, checked against its contract."""
    counts, report = allocation(task)
    n_units = [{m: layer_view(layer).n_units(m, task.config.gqa_rule) for m in task.modules}
               for layer in decoder_layers(task.model)]
    problem = counts_problem(counts, n_units) or strict_json.problem(report, "its report")
    if problem:
        raise PluginContractError(f"allocation {name!r} from {provider} returned {problem}")
    return counts, {"allocation": report}


@torch.no_grad()
def global_selections(model: nn.Module, calib_ids: Tensor, config: PruneConfig, scorer: Any,
                      params: dict[str, Any], device: torch.device) -> list[dict[str, Selection]]:
    """FLAP AL-AM (``allocation.al_am``) on the ``scorer``'s standardized unit scores from one dense pass (one-shot
    statistics, moments only)."""
    modules = list(config.pruned_modules)
    units = []
    for step in walk_layers(model, calib_ids, config, device,
                            plan=lambda _: dict.fromkeys(modules, Plan(frozenset()))):
        for module in modules:
            scores = scorer(step.view.projection(module).weight, step.stats[module], **params)
            units += layer_units(step.layer, step.index, module, scores, config.gqa_rule)
    layers = decoder_layers(model)
    selections = al_am(units, config.ratio, len(layers), modules)
    if config.round_to:
        for i, layer in enumerate(layers):
            for module in modules:
                module_units = [u for u in units if u.layer == i and u.module == module]
                selections[i][module] = _rounded(layer_view(layer).units(module).unit_size, module_units,
                                                 selections[i][module], config.round_to)
    return selections


def _rounded(unit_size: int, module_units: list[Unit], selection: Selection, channels: int) -> Selection:
    """An AL-AM module's selection with its kept width rounded to a multiple of ``channels`` (``round_kept``)."""
    scores = torch.tensor([u.score for u in sorted(module_units, key=lambda u: u.index)])
    return round_kept(selection, scores, kept_multiple(channels, unit_size))
