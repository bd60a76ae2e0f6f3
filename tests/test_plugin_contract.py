"""Plugins that break the contract are named and isolated; whole-model methods run, save and load."""

from __future__ import annotations

import copy
from importlib import metadata

import pytest
import torch
from tiny_models import logits, tiny_config, tiny_model, tokens

from rcpu_bench import hookimpl
from rcpu_bench import registry as registry_module
from rcpu_bench.compensation.compensators import Compensation, Problem
from rcpu_bench.plugins import default_registry, plugin_manager
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import PluginContractError, Registry, build_registry, make_method
from rcpu_bench.statistics.activations import ActivationStats


class SkewPlugin:
    """Claims an orthogonal update but returns a scaled one."""

    @staticmethod
    def skew(weight, stats, kept, pruned):
        """Not orthogonal at all."""
        problem = Problem(weight, stats, kept)
        return problem.result(2 * problem.wk, orthogonality_error=3.0)

    @hookimpl
    def register_compensators(self, register):
        register("skew", self.skew)


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
    assert "'skew' from skewer declared an orthogonal update" in registry.broken["skewer"]  # by its trial run
    skew = make_method("compensator", "skew", SkewPlugin.skew, "skewer")
    x = torch.randn(50, 6, dtype=torch.float64)
    stats = ActivationStats.from_activations(x)
    with pytest.raises(PluginContractError, match=r"'skew' from skewer declared an orthogonal update"):
        skew(torch.randn(4, 6), stats, torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]))


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
    from rcpu_bench.commands import plugins as plugins_command

    monkeypatch.setattr(plugins_command, "default_registry", lambda: registry)
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


# --- a failing hook isolates only its plugin -------------------------------------------------------

class ValueErrorPlugin:
    """Registers a working scorer, then its compensator hook raises a ValueError (which used to take every
    command down)."""

    @hookimpl
    def register_scorers(self, register):
        register("column-norm", lambda weight, stats: weight.double().norm(dim=0))

    @hookimpl
    def register_compensators(self, register):
        raise ValueError("config file ~/.mine.toml has no [solver] table")


def test_a_value_error_in_a_hook_isolates_only_its_plugin(monkeypatch, capsys):
    registry = build_registry(plugin_manager([("toy", ToyGram()), ("strict", ValueErrorPlugin())]))
    why = "register_compensators raised ValueError: config file ~/.mine.toml has no [solver] table"
    assert registry.broken == {"strict": why}
    assert registry.compensator("gram-shrink").provider == "toy" and registry.scorer("variance").name == "variance"
    with pytest.raises(KeyError, match=f"scorer 'column-norm' is unavailable: its plugin strict failed to load: "
                                       rf"{why.replace('[', '.').replace(']', '.')}"):
        PruneConfig(scorer="column-norm").validate(registry)
    from rcpu_bench import cli
    from rcpu_bench.commands import plugins as plugins_command

    monkeypatch.setattr(plugins_command, "default_registry", lambda: registry)
    assert cli.main(["plugins"]) == 1
    out = capsys.readouterr().out
    assert f"plugin strict failed to load: {why}" in out and "gram-shrink" in out and "column-norm" not in out


# --- trial runs build only what a method declares ----------------------------------------------------

def gram_shrink(weight, stats, kept, pruned, *, factor: float = 1.0):
    """W̃_K = factor · W G[:,K] G_KK⁻¹ (least squares), reads G."""
    gram = stats.require_gram()
    solved = torch.linalg.solve(gram[kept[:, None], kept], (weight.double() @ gram[:, kept]).T).T
    return Compensation((factor * solved).to(weight.dtype))


def sometimes_gram(weight, stats, kept, pruned, *, exact: bool = False):
    """Keeps W_K, or with exact=True the least-squares update (which reads G)."""
    return gram_shrink(weight, stats, kept, pruned) if exact else Compensation(weight[:, kept])


def diagonal_gram_score(weight, stats):
    """‖W[:,j]‖² G_jj (reads the diagonal of G)."""
    return weight.double().square().sum(0) * stats.gram.diagonal()


class ToyGram:
    @hookimpl
    def register_compensators(self, register):
        register("gram-shrink", gram_shrink, needs="gram")
        register("sometimes-gram", sometimes_gram)


class UndeclaredGram:
    @hookimpl
    def register_compensators(self, register):
        register("gram-shrink-undeclared", gram_shrink)  # needs="moments" by default, but reads G

    @hookimpl
    def register_scorers(self, register):
        register("diagonal-gram", diagonal_gram_score)


def test_a_method_reading_g_without_declaring_it_fails_its_trial_naming_plugin_and_need():
    registry = build_registry(plugin_manager([("undeclared", UndeclaredGram())]))
    why = registry.broken["undeclared"]
    assert "'diagonal-gram' from undeclared declares needs='moments' but reads the Gram matrix" in why
    assert "register it with needs='gram'" in why
    with pytest.raises(KeyError, match="compensator 'gram-shrink-undeclared' is unavailable: its plugin undeclared"):
        PruneConfig(compensator="gram-shrink-undeclared").validate(registry)


def test_a_parameter_that_makes_a_method_read_g_fails_validation_naming_the_need():
    registry = build_registry(plugin_manager([("toy", ToyGram())]))
    PruneConfig(compensator="sometimes-gram").validate(registry)
    with pytest.raises(PluginContractError, match="compensator 'sometimes-gram' from toy declares needs='moments' "
                                                  "but reads the Gram matrix.*needs='gram'"):
        PruneConfig(compensator="sometimes-gram", compensator_params={"exact": True}).validate(registry)


def test_the_trial_statistics_hold_exactly_the_declared_needs():
    seen = {}

    def spy(needs):
        def method(weight, stats):
            seen[needs] = stats.gram is not None
            return weight.double().square().sum(0)
        return method

    class Spy:
        @hookimpl
        def register_scorers(self, register):
            register("spy-moments", spy("moments"))
            register("spy-gram", spy("gram"), needs="gram")

    build_registry(plugin_manager([("spy", Spy())], entry_points=False, builtins=False))
    assert seen == {"moments": False, "gram": True}


def test_a_scorer_needing_g_gets_it_in_the_pipeline_even_without_a_gram_compensator():
    """‖W[:,j]‖² G_jj = ‖W[:,j]‖² Σx_j²: the same model as a moments scorer computing it from Σx²."""
    class Scorers:
        @hookimpl
        def register_scorers(self, register):
            register("diagonal-gram", diagonal_gram_score, needs="gram")
            register("diagonal-moments", lambda weight, stats: weight.double().square().sum(0) * stats.sq_sum)

    registry = build_registry(plugin_manager([("scorers", Scorers())]))
    dense = tiny_model(tiny_config())
    ids = tokens(dense.config.vocab_size, batch=3, length=8)
    pruned = {}
    for scorer in ("diagonal-gram", "diagonal-moments"):
        pruned[scorer] = copy.deepcopy(dense)
        prune_model(pruned[scorer], ids, PruneConfig(scorer=scorer, compensator="none", ratio=0.5), registry=registry,
                    progress=False)
    torch.testing.assert_close(logits(pruned["diagonal-gram"], ids), logits(pruned["diagonal-moments"], ids))


# --- names resolved once per run ---------------------------------------------------------------------

@pytest.mark.parametrize("structure", ["uniform", "al-am"])
def test_names_are_looked_up_a_fixed_number_of_times_whatever_the_depth(monkeypatch, structure):
    lookups = []
    real_get = Registry.get
    monkeypatch.setattr(Registry, "get", lambda self, kind, name: lookups.append(name) or real_get(self, kind, name))
    counts = {}
    for layers in (1, 4):
        lookups.clear()
        model = tiny_model(tiny_config(layers=layers, n_kv_heads=6))
        config = PruneConfig(ratio=0.3, structure=structure, compensator="ridge" if structure == "uniform" else "none")
        prune_model(model, tokens(model.config.vocab_size, batch=2, length=8), config, progress=False,
                    registry=default_registry())
        counts[layers] = len(lookups)
    assert counts[1] == counts[4]
