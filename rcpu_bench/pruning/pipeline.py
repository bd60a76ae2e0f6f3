"""Layer-wise prune-and-compensate (the paper's Algorithm 1, in the official code's order).

For each decoder layer in turn:
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
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

from rcpu_bench import console, peak_memory
from rcpu_bench.finite import check_parameters
from rcpu_bench.model.adapter import check_prunable, decoder_layers, layer_view
from rcpu_bench.model.capture import LayerInput, run_layer
from rcpu_bench.model.views import LayerView
from rcpu_bench.pruning.allocation_pass import AllocationTask, allocate
from rcpu_bench.pruning.layer_pass import (
    Timer,
    capture,
    check_statistics,
    collect,
    on_device,
    prune_module,
    statistics_needs,
    statistics_plan,
)
from rcpu_bench.pruning.options import MODULES, PruneConfig
from rcpu_bench.registry import Registry, Resolved
from rcpu_bench.selection.select import Selection
from rcpu_bench.statistics.activations import ActivationStats


class HeldOut:
    """Held-out windows' layer inputs, advanced through the layers like the calibration inputs (diagnostics.py)."""

    def __init__(self, inputs: list[LayerInput], modules: list[str], config: PruneConfig):
        self.inputs, self.modules, self.config = inputs, modules, config

    def dense_stats(self, view: LayerView, timer: Timer) -> dict[str, ActivationStats]:
        """G (and moments, ‖Y‖², C if cheaper than W G[:,K]) of each module's held-out inputs from one dense pass."""
        with timer("holdout"):
            plan = statistics_plan(view, dict.fromkeys(self.modules, "gram"), self.inputs, self.config)
            stats, self.dense_outputs = collect(view, self.inputs, plan, self.config.gram_precision)
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
    check_prunable(model, [m for m in MODULES if m in config.prune])
    layers = decoder_layers(model)
    totals = Timer(device)
    with totals("allocation"):  # AL-AM's dense pass, a model allocation's search, or a profile; ~0 for uniform
        task = AllocationTask(model, calib_ids, config, methods, device, progress, holdout_source)
        plans, allocation_report = allocate(task, registry)
    with totals("capture"):
        layer_0 = partial(capture, model, calib_ids, config, device)
        inputs = reuse_capture(layer_0) if reuse_capture else layer_0()
    held = _held_out(model, holdout_ids, config, device)
    reports = []
    for index, layer in enumerate(console.progress(layers, desc="pruning layers", unit="layer", enabled=progress)):
        timer = Timer(device)
        view = layer_view(layer)
        with on_device(layer, device, config.offload, timer):
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
    return HeldOut(capture(model, cast(Tensor, holdout_ids), config, device), modules, config)  # rows > 0: given


def _prune_layer(view: LayerView, inputs: list[LayerInput], config: PruneConfig, methods: Resolved, timer: Timer,
                 allocated: dict[str, Selection | int], held_out: dict[str, ActivationStats] | None = None, *,
                 index: int) -> tuple[dict[str, Any], list[Tensor]]:
    """Statistics pass, then attention and MLP pruning; returns the diagnostics and the dense layer outputs."""
    modules = [m for m in MODULES if m in config.prune]
    plan = statistics_plan(view, statistics_needs(modules, config, methods), inputs, config, allocated)
    with timer("statistics"):
        stats, dense_outputs = collect(view, inputs, plan, config.gram_precision)
    report: dict[str, Any] = {}
    for module in modules:
        if module == "mlp" and config.recollect_mlp and "attention" in modules:
            with timer("statistics"):
                stats["mlp"] = collect(view, inputs, {"mlp": plan["mlp"]}, config.gram_precision)[0]["mlp"]
        check_statistics(stats[module], index, module)
        planned = allocated[module]
        units, count = (planned, None) if isinstance(planned, Selection) else (None, planned)
        report[module] = prune_module(view, module, stats[module], config, methods, timer, units,
                                      held_out[module] if held_out else None, n_prune=count)
        report[module]["statistics"] = "+".join(sorted(plan[module].kinds)) or "moments"
    return report, dense_outputs


