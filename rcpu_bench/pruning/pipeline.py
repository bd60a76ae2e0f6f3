"""Layer-wise prune-and-compensate (the paper's Algorithm 1, in the official code's order).

For each decoder layer in turn (the layer walk, ``pruning/walk.py``):
  1. run the calibration inputs (outputs of the already pruned layers) through the dense layer while
     forward hooks stream the input statistics of each module's pruned projection (o_proj, down_proj);
  2. score and select heads (or key/value groups) and MLP channels;
  3. compensate o_proj, then down_proj, both from that one dense pass (the official code's order);
  4. physically shrink the layer and re-run it to produce the next layer's inputs.
``statistics="one-shot"`` instead feeds every layer the dense model's activations (FLAP's protocol).
How many units each layer loses is the allocation, chosen up front (``pruning/allocation_pass.py``); each layer's
steps are ``pruning/layer_pass.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from rcpu_bench import console, peak_memory
from rcpu_bench.finite import check_parameters
from rcpu_bench.model.adapter import check_prunable, decoder_layers
from rcpu_bench.model.capture import LayerInput
from rcpu_bench.pruning.allocation_pass import AllocationTask, allocate
from rcpu_bench.pruning.layer_pass import prune_module, statistics_needs, statistics_plan
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.timing import Timer
from rcpu_bench.pruning.walk import LayerStep, check_statistics, collect, walk_layers
from rcpu_bench.registry import Registry, Resolved
from rcpu_bench.selection.select import Selection


@dataclass
class PruneReport:
    """Per-layer diagnostics and timings of one pruning run."""

    layers: list[dict[str, Any]]
    seconds: dict[str, float]
    peak_memory_bytes: int
    method_report: dict[str, Any] | None = None  # what a whole-model method or a model allocation reported


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
    peak_memory.reset(device)
    if config.model_method is not None:
        return _run_model_method(model, calib_ids, config, methods, device)
    if config.ratio == 0 and config.compensator == "none" and not config.holdout:  # the dense model: nothing to do
        return PruneReport([], {}, peak_memory.peak_bytes(device))
    check_prunable(model, list(config.pruned_modules))
    totals = Timer(device)
    with totals("allocation"):  # AL-AM's dense pass, a model allocation's search, or a profile; ~0 for uniform
        task = AllocationTask(model, calib_ids, config, methods, device, progress, holdout_source)
        plans, allocation_report = allocate(task, registry)
    _check_held_out(holdout_ids, config)
    needs = statistics_needs(config.pruned_modules, config, methods)
    walk = walk_layers(model, calib_ids, config, device, timer=totals, reuse_capture=reuse_capture,
                       holdout_ids=holdout_ids if config.holdout else None,
                       advance="pruned" if config.statistics == "sequential" else "dense",
                       plan=lambda step: statistics_plan(step.view, needs, step.inputs, config, plans[step.index]))
    reports = []
    for step in console.progress(walk, desc="pruning layers", total=len(decoder_layers(model)), unit="layer",
                                 enabled=progress):
        report = _prune_layer(step, config, methods, plans[step.index])
        check_parameters(step.layer, f"layer {step.index} after pruning and compensation")
        reports.append({"layer": step.index, **report, "seconds": step.timer.seconds})  # complete once walked on
    return PruneReport(reports, totals.seconds, peak_memory.peak_bytes(device), allocation_report)


def _run_model_method(model: nn.Module, calib_ids: Tensor, config: PruneConfig, methods: Resolved,
                      device: torch.device) -> PruneReport:
    """Hand the whole model to a registered model method (ratio and its own parameters)."""
    timer = Timer(device)
    method = methods.model_method
    assert method is not None  # prune_model resolved config.model_method, which is set on this path
    with timer(cast(str, config.model_method)):
        report = method(model, calib_ids.to(device), ratio=config.ratio, **config.model_method_params)
    check_parameters(model, f"after the model method {config.model_method}")
    return PruneReport([], timer.seconds, peak_memory.peak_bytes(device), report)


def _check_held_out(holdout_ids: Tensor | None, config: PruneConfig) -> None:
    """Refuse held-out windows that are not the ``config.holdout`` asked for."""
    rows = 0 if holdout_ids is None else len(holdout_ids)
    if rows != config.holdout:
        raise ValueError(f"holdout={config.holdout} but {rows} held-out windows were given; pass holdout_ids "
                         "(data.holdout_windows) with exactly that many windows")


def _prune_layer(step: LayerStep, config: PruneConfig, methods: Resolved, allocated: dict[str, Selection | int]
                 ) -> dict[str, Any]:
    """Attention, then MLP pruning of the walked layer, from the statistics of its dense pass; returns the
    diagnostics."""
    report: dict[str, Any] = {}
    plan, stats = step.plan, dict(step.stats)
    for module in config.pruned_modules:
        if module == "mlp" and config.recollect_mlp and "attention" in config.pruned_modules:
            with step.timer("statistics"):
                stats["mlp"] = collect(step.view, step.inputs, {"mlp": plan["mlp"]}, config.gram_precision)[0]["mlp"]
            check_statistics(stats["mlp"], step.index, module)
        planned = allocated[module]
        units, count = (planned, None) if isinstance(planned, Selection) else (None, planned)
        report[module] = prune_module(step.view, module, stats[module], config, methods, step.timer, units,
                                      step.held_out[module] if step.held_out else None, n_prune=count)
        report[module]["statistics"] = "+".join(sorted(plan[module].kinds)) or "moments"
    return report
