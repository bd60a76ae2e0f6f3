"""The layer walk: each layer's inputs are what the whole model's forward pass gives it (dense or as the pass left
the layers), its statistics are those of those inputs, held-out windows walk alongside, and every phase a pruning run
times is a declared one."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_config, tiny_model, tokens

from rcpu_bench.model.adapter import decoder_layers
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.layer_pass import Plan
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model
from rcpu_bench.pruning.timing import PHASES
from rcpu_bench.pruning.walk import walk_layers

CPU = torch.device("cpu")


def hidden_states(model, ids) -> tuple[torch.Tensor, ...]:
    """What each decoder layer receives in the model's own forward pass (the last entry is after the final norm)."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True, use_cache=False).hidden_states


def down_proj_inputs(model, ids, layer: int) -> torch.Tensor:
    """The inputs of one layer's down_proj in the model's own forward pass, one row per token (float64)."""
    seen = []
    handle = decoder_layers(model)[layer].mlp.down_proj.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].detach()))
    try:
        hidden_states(model, ids)
    finally:
        handle.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).double()


def test_a_dense_walk_gives_each_layer_the_inputs_of_the_models_own_forward_pass():
    model = tiny_model(tiny_config(layers=3))
    ids = tokens(61, batch=5, length=8, seed=1)
    want = hidden_states(model, ids)
    seen = []
    for step in walk_layers(model, ids, PruneConfig(batch_size=2), CPU):
        got = torch.cat([x.hidden for x in step.inputs])
        assert torch.allclose(got, want[step.index], atol=1e-6), step.index
        assert len(step.outputs) == 3 and not step.stats  # batches of 2, 2 and 1 windows; no plan, no statistics
        seen.append(step.index)
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("advance", ["dense", "pruned"])
def test_the_next_layer_sees_the_dense_outputs_or_the_layer_as_the_pass_left_it(advance):
    model = tiny_model(tiny_config(layers=3))
    ids = tokens(61, batch=4, length=8, seed=2)
    dense = hidden_states(model, ids)
    changed = copy.deepcopy(model)
    for layer in decoder_layers(changed):
        layer.mlp.down_proj.weight.data.mul_(0.5)  # what the pass below does to each layer while it is walked
    edited = hidden_states(changed, ids)
    for step in walk_layers(model, ids, PruneConfig(batch_size=4), CPU, advance=advance):
        got = torch.cat([x.hidden for x in step.inputs])
        want = edited if advance == "pruned" else dense
        assert torch.allclose(got, want[step.index], atol=1e-6), step.index
        step.layer.mlp.down_proj.weight.data.mul_(0.5)


def test_planned_and_held_out_statistics_are_those_of_each_layers_dense_inputs():
    model = tiny_model(tiny_config(layers=2))
    ids, held = tokens(61, batch=4, length=8, seed=3), tokens(61, batch=3, length=8, seed=4)
    config = PruneConfig(batch_size=2, prune=("mlp",), gram_precision="float64")
    plan = {"mlp": Plan(frozenset({"gram"}))}
    steps = 0
    for step in walk_layers(model, ids, config, CPU, plan=lambda _: plan, holdout_ids=held):
        x, x_held = down_proj_inputs(model, ids, step.index), down_proj_inputs(model, held, step.index)
        assert torch.allclose(step.stats["mlp"].gram, x.T @ x, rtol=1e-10, atol=1e-8)
        assert torch.allclose(step.held_out["mlp"].gram, x_held.T @ x_held, rtol=1e-10, atol=1e-8)
        assert set(step.stats) == {"mlp"} and set(step.timer.seconds) >= {"statistics", "holdout"}
        steps += 1
    assert steps == 2


@pytest.mark.parametrize("changes", [
    {"holdout": 2, "offload": True, "statistics": "one-shot"},
    {"structure": "al-am", "recollect_mlp": True},
    {"allocation": "search", "allocation_params": {"population": 2, "generations": 1, "tokens": 16, "stages": 1}},
])
def test_every_phase_a_pruning_run_times_is_a_declared_one(changes):
    model = tiny_model(tiny_config(layers=2))
    ids = tokens(61, batch=4, length=8, seed=5)
    config = PruneConfig(ratio=0.3, compensator="ridge", **changes)
    held = tokens(61, batch=config.holdout, length=8, seed=6) if config.holdout else None
    report = prune_model(model, ids, config, registry=default_registry(), progress=False, holdout_ids=held,
                         holdout_source=lambda n: tokens(61, batch=n, length=8, seed=7))
    assert set(report.seconds) <= set(PHASES) and {"allocation", "capture", "statistics"} <= set(report.seconds)
    for layer in report.layers:
        assert set(layer["seconds"]) <= set(PHASES) - {"allocation", "capture"}
        for phase, seconds in layer["seconds"].items():
            assert seconds <= report.seconds[phase]  # the run's seconds of a layer phase sum its layers'
    if config.holdout:
        assert {"holdout", "offload"} <= set(report.seconds)
