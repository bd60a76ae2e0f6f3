"""Layer-wise prune-and-compensate (the paper's Algorithm 1, in the official code's order).

For each decoder layer in turn:
  1. run the calibration inputs (outputs of the already pruned layers) through the dense layer while
     forward hooks stream the input statistics of each module's pruned projection (o_proj, down_proj);
  2. score and select heads (or key/value groups) and MLP channels;
  3. compensate o_proj, then down_proj, both from that one dense pass (the official code's order);
  4. physically shrink the layer and re-run it to produce the next layer's inputs.
``statistics="one-shot"`` instead feeds every layer the dense model's activations (FLAP's protocol).
How many units each layer loses is the allocation (``pruning/allocation.py``): uniform, a registered per-layer
profile (log-increase), FLAP's global adaptive structure (``structure="al-am"``), or a registered allocation that
searches the model itself (``AllocationTask``; e.g. ``search``), chosen up front.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench import console, strict_json
from rcpu_bench.compensation.diagnostics import module_generalisation
from rcpu_bench.finite import check_parameters, check_tensor
from rcpu_bench.model.adapter import check_prunable, decoder_layers, layer_view, model_view
from rcpu_bench.model.capture import LayerInput, capture_layer_inputs, run_layer
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
from rcpu_bench.pruning.options import MODULES, PruneConfig
from rcpu_bench.registry import PluginContractError, Registry, Resolved
from rcpu_bench.selection.scorers import unit_scores
from rcpu_bench.selection.select import (
    Selection,
    UnitMap,
    kept_multiple,
    round_kept,
    select_lowest,
    select_within_groups,
)
from rcpu_bench.statistics.activations import ActivationStats, GramPrecision, collect_input_stats
from rcpu_bench.statistics.flops import cheapest_statistics, expected_kept


class Timer:
    """Accumulates wall time per named section, synchronising the accelerator around each."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


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
        return selection(weight, stats, mapping, n_prune, **config.scorer_params)
    scores = selection(weight, stats, **config.scorer_params)
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
        n_units = proj.weight.shape[1] // mapping.unit_size
        count = units_to_prune(mapping, n_units, config.ratio, config.rounding) if n_prune is None else n_prune
        with timer("score"):
            units = select(proj.weight, stats, mapping, count, config, methods)
    columns = units.columns(mapping.unit_size)
    compensator = methods.compensator_for(module in config.compensate)
    params = config.compensator_params if module in config.compensate else {}
    with timer("solve"):
        result = compensator(proj.weight, stats, columns.kept, columns.pruned, **params)
    diagnostics = {} if held_out is None else {
        "generalisation": module_generalisation(proj.weight, stats, held_out, columns.kept, compensator.name, result)}
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


def _statistics_plan(view: LayerView, needs: dict[str, str], inputs: list[LayerInput], config: PruneConfig,
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


def _needs(modules: list[str], config: PruneConfig, methods: Resolved) -> dict[str, str]:
    """What each module's scorer and compensator read; G for every pruned module with the held-out diagnostics."""
    return {m: "gram" if config.holdout else methods.needs(m in config.compensate) for m in modules}


@contextmanager
def _on_device(layer: nn.Module, device: torch.device, offload: bool, timer: Timer | None = None):
    """With offloading, only the current layer sits on the accelerator; its moves there and back are timed as the
    phase "offload" of ``timer`` when given (about 38 s of the 77 s layer loop of a 13B-shaped prune on an H200,
    untimed before)."""
    moves = nullcontext if timer is None else partial(timer, "offload")
    if offload:
        with moves():
            layer.to(device)
    try:
        yield
    finally:
        if offload:
            with moves():
                layer.to("cpu")


def _collect(view: LayerView, inputs: list[LayerInput], plan: dict[str, Plan],
             gram_precision: GramPrecision = "mixed") -> tuple[dict[str, ActivationStats], list[Tensor]]:
    """One pass of the layer over the calibration inputs, streaming each planned module's statistics."""
    projections = {m: view.projection(m) for m in plan}
    with collect_input_stats(projections, with_gram=[m for m, p in plan.items() if "gram" in p.kinds],
                             with_cross=[m for m, p in plan.items() if "cross" in p.kinds],
                             dropped={m: p.dropped for m, p in plan.items() if p.dropped is not None},
                             gram_precision=gram_precision) as stats:
        outputs = run_layer(view.layer, inputs)
    return stats, outputs


class HeldOut:
    """Held-out windows' layer inputs, advanced through the layers like the calibration inputs (diagnostics.py)."""

    def __init__(self, inputs: list[LayerInput], modules: list[str], config: PruneConfig):
        self.inputs, self.modules, self.config = inputs, modules, config

    def dense_stats(self, view: LayerView, timer: Timer) -> dict[str, ActivationStats]:
        """G (and moments, ‖Y‖², C if cheaper than W G[:,K]) of each module's held-out inputs from one dense pass."""
        with timer("holdout"):
            plan = _statistics_plan(view, dict.fromkeys(self.modules, "gram"), self.inputs, self.config)
            stats, self.dense_outputs = _collect(view, self.inputs, plan, self.config.gram_precision)
        return stats

    def advance(self, layer: nn.Module, statistics: str, timer: Timer) -> None:
        """Next layer's inputs: the pruned layer's outputs (sequential) or the dense ones (one-shot)."""
        with timer("holdout"):
            outputs = run_layer(layer, self.inputs) if statistics == "sequential" else self.dense_outputs
        self.inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, self.inputs, strict=True)]


@dataclass
class PruneReport:
    """Per-layer diagnostics and timings of one pruning run."""

    layers: list[dict[str, Any]]
    seconds: dict[str, float]
    peak_memory_bytes: int
    method_report: dict[str, Any] | None = None  # what a whole-model method or a model allocation reported


def _peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated on the accelerator, or the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def prune_model(model: nn.Module, calib_ids: Tensor, config: PruneConfig, *, registry: Registry,
                device: torch.device | str | None = None, progress: bool = True,
                holdout_ids: Tensor | None = None,
                reuse_capture: Callable[[Callable[[], list[LayerInput]]], list[LayerInput]] | None = None,
                validated: bool = False, holdout_source: Callable[[int], Tensor] | None = None) -> PruneReport:
    """Prune and compensate every decoder layer of ``model`` in place from calibration token windows.

    With ``config.holdout`` > 0, ``holdout_ids`` holds that many held-out windows (``data.holdout_windows``)
    and each module's report gets its ``generalisation`` diagnostics (``compensation/diagnostics.py``).
    ``reuse_capture(capture)``, when given, returns layer 0's inputs: ``capture()``, or an equal result
    remembered from an earlier call with the same model and calibration (rcpu_bench.matrix.reuse).
    ``validated=True``: the caller has already run ``config.validate(registry)`` (``run_experiment`` does, through
    ``Experiment.validate``), so it is not run again. ``holdout_source(n)`` gives n held-out windows
    (``data.holdout_windows`` bound to the run's calibration and tokenizer), for an allocation that scores on them.
    """
    if not validated:
        config.validate(registry)
    methods = registry.resolve(scorer=config.scorer, compensator=config.compensator, model_method=config.model_method,
                               allocation=config.allocation)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if config.model_method is not None:
        return _run_model_method(model, calib_ids, config, methods, device)
    check_prunable(model, [m for m in MODULES if m in config.prune])
    layers = decoder_layers(model)
    totals = Timer(device)
    with totals("allocation"):  # AL-AM's dense pass, a model allocation's search, or a profile; ~0 for uniform
        task = AllocationTask(model, calib_ids, config, methods, device, progress, holdout_source)
        plans, allocation_report = allocate(task, registry)
    with totals("capture"):
        capture = partial(_capture, model, calib_ids, config, device)
        inputs = reuse_capture(capture) if reuse_capture else capture()
    held = _held_out(model, holdout_ids, config, device)
    reports = []
    for index, layer in enumerate(console.progress(layers, desc="pruning layers", unit="layer", enabled=progress)):
        timer = Timer(device)
        view = layer_view(layer)
        with _on_device(layer, device, config.offload, timer):
            check_parameters(layer, f"layer {index} before pruning")
            held_stats = held.dense_stats(view, timer) if held else None
            report, outputs = _prune_layer(view, inputs, config, methods, timer, plans[index], held_stats, index=index)
            check_parameters(layer, f"layer {index} after pruning and compensation")
            if config.statistics == "sequential":
                with timer("forward"):
                    outputs = run_layer(layer, inputs)
            if held:
                held.advance(layer, config.statistics, timer)
        inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs, strict=True)]
        reports.append({"layer": index, **report, "seconds": timer.seconds})
        for key, value in timer.seconds.items():
            totals.seconds[key] = totals.seconds.get(key, 0.0) + value
    return PruneReport(reports, totals.seconds, _peak_memory(device), allocation_report)


def _run_model_method(model: nn.Module, calib_ids: Tensor, config: PruneConfig, methods: Resolved,
                      device: torch.device) -> PruneReport:
    """Hand the whole model to a registered model method (ratio and its own parameters)."""
    timer = Timer(device)
    method = methods.model_method
    assert method is not None  # prune_model resolved config.model_method, which is set on this path
    with timer(config.model_method):
        report = method(model, calib_ids.to(device), ratio=config.ratio, **config.model_method_params)
    check_parameters(model, f"after the model method {config.model_method}")
    return PruneReport([], timer.seconds, _peak_memory(device), report)


def _capture(model: nn.Module, calib_ids: Tensor, config: PruneConfig, device: torch.device) -> list[LayerInput]:
    """Layer-0 inputs; with offloading only the embeddings (and rotary tables) visit the device."""
    if not config.offload:
        return capture_layer_inputs(model, calib_ids, config.batch_size, device)
    front = model_view(model).front
    for module in front:
        module.to(device)
    try:
        return capture_layer_inputs(model, calib_ids, config.batch_size, device)
    finally:
        for module in front:
            module.to("cpu")


def _held_out(model: nn.Module, holdout_ids: Tensor | None, config: PruneConfig,
              device: torch.device) -> HeldOut | None:
    """The held-out windows' layer-0 inputs, checked against ``config.holdout``; None without a held-out split."""
    rows = 0 if holdout_ids is None else len(holdout_ids)
    if rows != config.holdout:
        raise ValueError(f"holdout={config.holdout} but {rows} held-out windows were given; pass holdout_ids "
                         "(data.holdout_windows) with exactly that many windows")
    if not rows:
        return None
    modules = [m for m in MODULES if m in config.prune]
    return HeldOut(_capture(model, holdout_ids, config, device), modules, config)


def _prune_layer(view: LayerView, inputs: list[LayerInput], config: PruneConfig, methods: Resolved, timer: Timer,
                 allocated: dict[str, Selection | int], held_out: dict[str, ActivationStats] | None = None, *,
                 index: int) -> tuple[dict[str, Any], list[Tensor]]:
    """Statistics pass, then attention and MLP pruning; returns the diagnostics and the dense layer outputs."""
    modules = [m for m in MODULES if m in config.prune]
    plan = _statistics_plan(view, _needs(modules, config, methods), inputs, config, allocated)
    with timer("statistics"):
        stats, dense_outputs = _collect(view, inputs, plan, config.gram_precision)
    report: dict[str, Any] = {}
    for module in modules:
        if module == "mlp" and config.recollect_mlp and "attention" in modules:
            with timer("statistics"):
                stats["mlp"] = _collect(view, inputs, {"mlp": plan["mlp"]}, config.gram_precision)[0]["mlp"]
        _check_statistics(stats[module], index, module)
        planned = allocated[module]
        units, count = (planned, None) if isinstance(planned, Selection) else (None, planned)
        report[module] = prune_module(view, module, stats[module], config, methods, timer, units,
                                      held_out[module] if held_out else None, n_prune=count)
        report[module]["statistics"] = "+".join(sorted(plan[module].kinds)) or "moments"
    return report, dense_outputs


def _check_statistics(stats: ActivationStats, index: int, module: str) -> None:
    """Σx² is NaN or inf exactly when some calibration input is: stop before a scorer sees it."""
    check_tensor(stats.sq_sum, f"layer {index} {module}: the statistics of its pruned projection's inputs")


# Allocation: units pruned per layer and module ----------------------------------------------------------

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
        return [m for m in MODULES if m in self.config.prune]

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
        windows: one-shot, every layer sees the dense outputs of the layer before."""
        inputs = _capture(self.model, self.calib_ids, self.config, self.device)
        needs = _needs(self.modules, self.config, self.methods)
        for index, layer in enumerate(decoder_layers(self.model)):
            view = layer_view(layer)
            with _on_device(layer, self.device, self.config.offload):
                plan = _statistics_plan(view, needs, inputs, self.config)
                stats, outputs = _collect(view, inputs, plan, self.config.gram_precision)
                for module in self.modules:
                    _check_statistics(stats[module], index, module)
                yield index, view, stats
            inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs, strict=True)]

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
        plans.append({m: units_to_prune(view.units(m, config.gqa_rule), _n_units(view, m, config.gqa_rule), ratio,
                                        config.rounding) for m in modules})
    return plans, None


def _model_allocation(task: AllocationTask, allocation: Callable[[AllocationTask], Any], name: str, provider: str
                      ) -> tuple[list[dict[str, Selection | int]], dict[str, Any]]:
    """A ``hookspecs.ModelAllocation``'s counts and report, checked against its contract."""
    counts, report = allocation(task)
    n_units = [{m: _n_units(layer_view(layer), m, task.config.gqa_rule) for m in task.modules}
                for layer in decoder_layers(task.model)]
    problem = counts_problem(counts, n_units) or strict_json.problem(report, "its report")
    if problem:
        raise PluginContractError(f"allocation {name!r} from {provider} returned {problem}")
    return counts, {"allocation": report}


def _n_units(view: Any, module: str, gqa_rule: str) -> int:
    return view.projection(module).weight.shape[1] // view.units(module, gqa_rule).unit_size


@torch.no_grad()
def global_selections(model: nn.Module, calib_ids: Tensor, config: PruneConfig, scorer: Any,
                      params: dict[str, Any], device: torch.device) -> list[dict[str, Selection]]:
    """FLAP AL-AM (``allocation.al_am``) on the ``scorer``'s standardized unit scores from one dense pass (one-shot
    statistics, moments only)."""
    modules = [m for m in MODULES if m in config.prune]
    inputs = _capture(model, calib_ids, config, device)
    units = []
    for index, layer in enumerate(decoder_layers(model)):
        view = layer_view(layer)
        with _on_device(layer, device, config.offload):
            check_parameters(layer, f"layer {index} before pruning")
            stats, outputs = _collect(view, inputs, dict.fromkeys(modules, Plan(frozenset())), config.gram_precision)
            for module in modules:
                _check_statistics(stats[module], index, module)
                scores = scorer(view.projection(module).weight, stats[module], **params)
                units += layer_units(layer, index, module, scores, config.gqa_rule)
        inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs, strict=True)]
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
