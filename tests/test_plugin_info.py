"""A compensator's ``info`` lives under its own key, strict JSON: it cannot overwrite the harness's record fields."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import tiny_config, tiny_model, tokens

from rcpu_bench import hookimpl
from rcpu_bench.compensation.compensators import Problem
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import PluginContractError, build_registry, make_method
from rcpu_bench.statistics.activations import ActivationStats


class Impostor:
    """Reports diagnostics named like the harness's own record fields."""

    @staticmethod
    def impostor(weight, stats, kept, pruned):
        """Drop the pruned columns; claim nothing was pruned."""
        return Problem(weight, stats, kept).result(weight[:, kept], compensator="none", units_pruned=0,
                                                   pruned_units="[]", note="mine")

    @hookimpl
    def register_compensators(self, register):
        register("impostor", self.impostor)


def test_info_named_like_harness_fields_stays_under_info():
    registry = build_registry(plugin_manager([("impostor-plugin", Impostor())]))
    model = tiny_model(tiny_config(n_heads=4, n_kv_heads=4))  # MHA: every head is a unit
    n_heads, n_channels = model.config.num_attention_heads, model.config.intermediate_size
    report = prune_model(model, tokens(61, batch=4, length=16), PruneConfig(compensator="impostor", ratio=0.5),
                         registry=registry, progress=False)
    for layer in report.layers:
        assert layer["attention"]["compensator"] == "impostor"
        assert layer["attention"]["units_pruned"] == n_heads // 2
        assert layer["mlp"]["units_pruned"] == n_channels // 2
        assert len(layer["mlp"]["pruned_units"]) == n_channels // 2
        assert layer["mlp"]["info"] == {"compensator": "none", "units_pruned": 0, "pruned_units": "[]",
                                        "note": "mine"}
    json.dumps(report.layers, allow_nan=False)  # strict JSON


@pytest.mark.parametrize(("info", "named"), [
    ({"gain": math.nan}, r"info\['gain'\] = nan is not finite"),
    ({"gain": -math.inf}, r"info\['gain'\] = -inf is not finite"),
    ({"per_row": [1.0, math.inf]}, r"info\['per_row'\]\[1\] = inf"),
    ({"q": torch.eye(3)}, r"info\['q'\] is a tensor of shape \(3, 3\)"),
    ({"scale": torch.tensor(2.0)}, r"info\['scale'\] is a tensor of shape \(\)"),
    ({"solver": object()}, r"info\['solver'\] is a object"),
])
def test_non_json_info_is_refused_naming_plugin_and_key(info, named):
    def broken(weight, stats, kept, pruned):
        """Reports an unrecordable diagnostic."""
        out = Problem(weight, stats, kept).result(weight[:, kept])
        out.info.update(info)
        return out

    method = make_method("compensator", "broken", broken, "broken-plugin")
    stats = ActivationStats.from_activations(torch.randn(40, 6, dtype=torch.float64))
    with pytest.raises(PluginContractError, match=rf"compensator 'broken' from broken-plugin .*{named}"):
        method(torch.randn(4, 6), stats, torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]))

    class Plugin:
        @hookimpl
        def register_compensators(self, register):
            register("broken", broken)

    registry = build_registry(plugin_manager([("broken-plugin", Plugin())]))
    assert "cannot be recorded" in registry.broken["broken-plugin"]  # refused by its trial run, before any work


def test_a_model_method_report_must_be_strict_json():
    def nan_report(model, calib_ids, *, ratio):
        """Reports NaN."""
        return {"loss": math.nan}

    method = make_method("model-method", "nan-report", nan_report, "nan-plugin")
    with pytest.raises(PluginContractError, match=r"'nan-report' from nan-plugin .*report\['loss'\] = nan"):
        method(tiny_model(tiny_config()), tokens(61), ratio=0.1)
