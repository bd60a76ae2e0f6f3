"""Plugins that break the contract are named and isolated; whole-model methods run, save and load."""

from __future__ import annotations

import copy
from importlib import metadata

import pytest
import torch
from tiny_models import logits, tiny_config, tiny_model, tokens

from rcpu_bench import hookimpl, registry as registry_module
from rcpu_bench.compensation.compensators import Problem
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import PluginContractError, build_registry, plugin_manager
from rcpu_bench.statistics.activations import ActivationStats


class SkewPlugin:
    """Claims an orthogonal update but returns a scaled one."""

    @hookimpl
    def register_compensators(self, register):
        def skew(weight, stats, kept, pruned):
            """Not orthogonal at all."""
            problem = Problem(weight, stats, kept)
            return problem.result(2 * problem.wk, orthogonality_error=3.0)

        register("skew", skew)


class RaisingPlugin:
    @hookimpl
    def register_scorers(self, register):
        raise RuntimeError("cannot find my weights file")


class HalveEmbeddings:
    """A whole-model method: scales the embeddings by (1 − ratio)."""

    @hookimpl
    def register_model_methods(self, register):
        def halve(model, calib_ids, *, ratio, note: str = "x"):
            """Scale the embeddings."""
            model.model.embed_tokens.weight.data *= 1 - ratio
            return {"scaled_by": 1 - ratio, "note": note, "calib_tokens": calib_ids.numel()}

        register("halve", halve)


def test_a_declared_orthogonal_update_is_checked():
    registry = build_registry(plugin_manager([("skewer", SkewPlugin())]))
    x = torch.randn(50, 6, dtype=torch.float64)
    stats = ActivationStats.from_activations(x)
    with pytest.raises(PluginContractError, match=r"'skew' from skewer declared an orthogonal update"):
        registry.compensator("skew")(torch.randn(4, 6), stats, torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]))


def test_a_plugin_whose_hook_raises_is_reported_and_the_rest_works():
    registry = build_registry(plugin_manager([("weights-plugin", RaisingPlugin())]))
    assert "cannot find my weights file" in registry.broken["weights-plugin"]
    assert registry.scorer("variance").name == "variance"
    with pytest.raises(KeyError, match="plugin weights-plugin failed to load: register_scorers raised RuntimeError"):
        registry.scorer("mine")


def test_an_entry_point_that_fails_to_import_is_reported(monkeypatch, capsys):
    real = metadata.entry_points
    broken = metadata.EntryPoint(name="ghost", value="no_such_module_for_rcpu_bench", group="rcpu_bench")
    monkeypatch.setattr(registry_module.metadata, "entry_points",
                        lambda group: [*real(group=group), broken])
    registry = build_registry(plugin_manager())
    assert "ModuleNotFoundError" in registry.broken["ghost"]
    assert registry.compensator("procrustes").provider.startswith("builtin")
    from rcpu_bench import cli

    monkeypatch.setattr(cli, "default_registry", lambda: registry)
    assert cli.main(["plugins"]) == 1
    assert "plugin ghost failed to load: ModuleNotFoundError" in capsys.readouterr().out


def test_a_whole_model_method_replaces_scoring_and_compensation():
    registry = build_registry(plugin_manager([("halver", HalveEmbeddings())]))
    dense = tiny_model(tiny_config())
    ids = tokens(dense.config.vocab_size, batch=3, length=8)
    model = copy.deepcopy(dense)
    config = PruneConfig(ratio=0.5, model_method="halve", model_method_params={"note": "y"})
    report = prune_model(model, ids, config, registry=registry, progress=False)
    assert report.method_report == {"scaled_by": 0.5, "note": "y", "calib_tokens": 24}
    torch.testing.assert_close(model.model.embed_tokens.weight, 0.5 * dense.model.embed_tokens.weight)
    assert not torch.allclose(logits(model, ids), logits(dense, ids))
    with pytest.raises(ValueError, match="no parameter"):
        PruneConfig(model_method="halve", model_method_params={"nope": 1}).validate(registry)
    with pytest.raises(ValueError, match="offload"):
        PruneConfig(model_method="halve", offload=True).validate(registry)
    with pytest.raises(KeyError, match="registered model-methods: halve"):
        PruneConfig(model_method="slice-it").validate(registry)
