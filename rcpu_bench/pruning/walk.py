"""The one walk over a model's decoder layers that every layer-wise pass runs (:func:`walk_layers`).

It captures what layer 0 receives, then for each decoder layer in turn: moves it onto the device (with ``offload``),
runs it over its inputs while forward hooks stream the statistics the pass planned for each module's pruned
projection, yields the layer to the pass (which may prune it in place), and advances the inputs to the next layer:
the dense layer's outputs, or (``advance="pruned"``) the outputs of the layer as the pass left it. Held-out windows,
when given, walk beside the calibration windows and are advanced the same way.

The pipeline (``prune_model``), FLAP's AL-AM pass (``global_selections``), a model allocation's dense pass
(``AllocationTask.dense_layers``) and the depth baselines all walk through here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn

from rcpu_bench.finite import check_parameters, check_tensor
from rcpu_bench.model.adapter import decoder_layers, layer_view, model_view
from rcpu_bench.model.capture import LayerInput, capture_layer_inputs, run_layer
from rcpu_bench.model.views import LayerView
from rcpu_bench.pruning.layer_pass import Plan, statistics_plan
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.timing import Timer
from rcpu_bench.statistics.activations import ActivationStats, GramPrecision, collect_input_stats

Advance = Literal["dense", "pruned"]
Planner = Callable[["LayerStep"], dict[str, Plan]]  # the statistics one layer's pass collects, per module
Capture = Callable[[Callable[[], list[LayerInput]]], list[LayerInput]]  # layer 0's inputs, possibly remembered


@dataclass
class LayerStep:
    """One decoder layer as the walk hands it to a pass, on the device.

    ``inputs``: the calibration windows as this layer receives them; ``stats``: the statistics planned for its
    modules (``plan``), and ``outputs`` the dense layer's outputs, from one pass over them (``outputs`` also
    without a plan, unless the walk advances the pruned layer); ``held_out``: the held-out windows' G per pruned
    module, when the walk has them; ``timer``: this layer's phases (complete once the walk moves on).
    """

    index: int
    view: LayerView
    inputs: list[LayerInput]
    timer: Timer
    plan: dict[str, Plan] = field(default_factory=dict)
    stats: dict[str, ActivationStats] = field(default_factory=dict)
    outputs: list[Tensor] = field(default_factory=list)
    held_out: dict[str, ActivationStats] | None = None

    @property
    def layer(self) -> nn.Module:
        return self.view.layer


@torch.no_grad()
def walk_layers(model: nn.Module, calib_ids: Tensor, config: PruneConfig, device: torch.device, *,
                plan: Planner | None = None, advance: Advance = "dense", timer: Timer | None = None,
                reuse_capture: Capture | None = None, holdout_ids: Tensor | None = None) -> Iterator[LayerStep]:
    """Each decoder layer of ``model``, in order, with its inputs and the statistics ``plan(step)`` asks for.

    ``config`` gives the calibration batch size, ``offload`` and the Gram precision; ``plan`` (None: no statistics)
    the statistics collected, checked finite, from the dense layer; ``advance`` what the next layer receives: the
    dense outputs, or the outputs of the layer as the pass left it (timed as "forward"). ``timer`` receives the
    phase "capture" and each layer's phases once the layer is done. ``reuse_capture(capture)`` returns layer 0's
    inputs (``capture()`` or a remembered equal result, ``rcpu_bench.matrix.reuse``). ``holdout_ids``: held-out
    windows walked alongside, G of every pruned module collected from the dense layer (phase "holdout").
    """
    totals = timer or Timer(device)
    with totals("capture"):
        first = partial(capture, model, calib_ids, config, device)
        inputs = reuse_capture(first) if reuse_capture else first()
        held = capture(model, holdout_ids, config, device) if holdout_ids is not None and len(holdout_ids) else None
    for index, layer in enumerate(decoder_layers(model)):
        step = LayerStep(index, layer_view(layer), inputs, Timer(device))
        with on_device(layer, device, config.offload, step.timer):
            check_parameters(layer, f"layer {index} before pruning")
            held_outputs = _held_out_pass(step, held, config) if held is not None else []
            if plan is not None:
                step.plan = plan(step)
                with step.timer("statistics"):
                    step.stats, step.outputs = collect(step.view, inputs, step.plan, config.gram_precision)
                for module, stats in step.stats.items():
                    check_statistics(stats, index, module)
            elif advance == "dense":
                step.outputs = run_layer(layer, inputs)
            yield step
            if advance == "pruned":
                with step.timer("forward"):
                    step.outputs = run_layer(layer, inputs)
            if held is not None:
                with step.timer("holdout"):
                    held = _advanced(held, run_layer(layer, held) if advance == "pruned" else held_outputs)
        inputs = _advanced(inputs, step.outputs)
        totals.add(step.timer)


def _held_out_pass(step: LayerStep, held: list[LayerInput], config: PruneConfig) -> list[Tensor]:
    """G (and moments, ‖Y‖², C if cheaper than W G[:,K]) of each pruned module's held-out inputs, into
    ``step.held_out``, from one dense pass; returns the dense outputs."""
    with step.timer("holdout"):
        needs = dict.fromkeys(config.pruned_modules, "gram")
        step.held_out, outputs = collect(step.view, held, statistics_plan(step.view, needs, held, config),
                                         config.gram_precision)
    return outputs


def _advanced(inputs: list[LayerInput], outputs: list[Tensor]) -> list[LayerInput]:
    """The next layer's inputs: ``outputs`` with the same keyword arguments (masks, position embeddings)."""
    return [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs, strict=True)]


@contextmanager
def on_device(layer: nn.Module, device: torch.device, offload: bool, timer: Timer | None = None) -> Iterator[None]:
    """With offloading, only the current layer sits on the accelerator; its moves there and back are timed as the
    phase "offload" of ``timer`` when given (about 38 s of the 77 s layer loop of a 13B-shaped prune on an H200)."""
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


def collect(view: LayerView, inputs: list[LayerInput], plan: dict[str, Plan],
            gram_precision: GramPrecision = "mixed") -> tuple[dict[str, ActivationStats], list[Tensor]]:
    """One pass of the layer over the inputs, streaming each planned module's statistics; returns them and the
    layer's outputs."""
    projections = {m: view.projection(m) for m in plan}
    with collect_input_stats(projections, with_gram=[m for m, p in plan.items() if "gram" in p.kinds],
                             with_cross=[m for m, p in plan.items() if "cross" in p.kinds],
                             dropped={m: p.dropped for m, p in plan.items() if p.dropped is not None},
                             gram_precision=gram_precision) as stats:
        outputs = run_layer(view.layer, inputs)
    return stats, outputs


def capture(model: nn.Module, calib_ids: Tensor, config: PruneConfig, device: torch.device) -> list[LayerInput]:
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


def check_statistics(stats: ActivationStats, index: int, module: str) -> None:
    """Σx² is NaN or inf exactly when some calibration input is: stop before a scorer sees it."""
    check_tensor(stats.sq_sum, f"layer {index} {module}: the statistics of its pruned projection's inputs")
