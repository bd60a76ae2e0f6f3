"""The pluggy registry: built-ins, third-party plugins registered from here, and the result contract."""

from importlib import metadata

import pytest
import torch
from tiny_models import tiny_config, tiny_model

from rcpu_bench import registry as registry_module
from rcpu_bench.cli import main
from rcpu_bench.compensation import compensators
from rcpu_bench.compensation.compensators import Compensation
from rcpu_bench.hookspecs import hookimpl
from rcpu_bench.plugins import default_registry, plugin_manager
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.registry import PluginContractError, build_registry, make_method
from rcpu_bench.selection import scorers
from rcpu_bench.statistics.activations import ActivationStats

F64 = torch.float64
BUILTIN_SCORERS = ["flap-wifv", "magnitude", "minitron", "variance", "wanda-sp"]
BUILTIN_COMPENSATORS = ["flap-bias", "none", "olica", "procrustes", "ridge", "scaled-procrustes", "slimllm"]


def make_problem(d_out=4, d_in=6, n_tokens=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=F64)
    X = torch.randn(d_in, n_tokens, generator=g, dtype=F64)
    kept, pruned = torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4])
    return W, ActivationStats.from_activations(X.T), kept, pruned


# --- a third-party plugin, defined here ------------------------------------------------------------

def toy_score(weight, stats, *, power: float = 2.0, absolute: bool = True):
    """Toy scorer: column sums of |W|^power.

    Second docstring line, not part of the description.
    """
    w = weight.abs() if absolute else weight
    return (w.to(F64) ** power).sum(0)


def toy_shrink(weight, stats, kept, pruned, *, factor: float = 0.5):
    return Compensation(factor * weight[:, kept])


class ToyPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("toy-score", toy_score)

    @hookimpl
    def register_compensators(self, register):
        register("toy-shrink", toy_shrink, needs="gram", description="Shrink the kept columns.")


def registry_with(*plugins, entry_points=True, builtins=True):
    return build_registry(plugin_manager(list(plugins), entry_points=entry_points, builtins=builtins))


def test_plugin_methods_show_up_with_provider_params_and_description():
    registry = registry_with(("toy", ToyPlugin()))
    scorer = registry.scorer("toy-score")
    assert scorer.provider == "toy" and scorer.kind == "scorer" and scorer.needs == "moments"
    assert scorer.params == {"power": 2.0, "absolute": True}
    assert scorer.description == "Toy scorer: column sums of |W|^power."
    comp = registry.compensator("toy-shrink")
    assert comp.provider == "toy" and comp.needs == "gram"
    assert comp.params == {"factor": 0.5} and comp.description == "Shrink the kept columns."


def names(registry, kind: str) -> list[str]:
    """Method names from the built-in plugins and the test's own (other installed plugins are ignored)."""
    return [m.name for m in registry.methods(kind) if m.provider.startswith(("builtin", "rcpu_bench.methods.", "toy"))]


def test_plugin_methods_are_listed_next_to_builtins():
    registry = registry_with(("toy", ToyPlugin()))
    assert names(registry, "scorer") == sorted(BUILTIN_SCORERS + ["toy-score"])
    assert names(registry, "compensator") == sorted(BUILTIN_COMPENSATORS + ["toy-shrink"])


def test_plugin_method_runs_with_its_parameters():
    W, stats, kept, pruned = make_problem()
    registry = registry_with(("toy", ToyPlugin()))
    torch.testing.assert_close(registry.scorer("toy-score")(W, stats, power=1.0), W.abs().sum(0))
    out = registry.compensator("toy-shrink")(W, stats, kept, pruned, factor=2.0)
    torch.testing.assert_close(out.weight, 2.0 * W[:, kept])


def test_module_plugin_without_entry_points():
    """A plugin can also be a plain namespace of hook functions; without entry points and built-ins only it is
    present."""
    class OnlyToy:
        register_scorers = staticmethod(hookimpl(lambda register: register("toy-score", toy_score)))
        register_compensators = staticmethod(hookimpl(lambda register: register("toy-shrink", toy_shrink)))

    registry = registry_with(("only", OnlyToy()), entry_points=False, builtins=False)
    assert [m.name for m in registry.methods("scorer")] == ["toy-score"]
    assert [m.name for m in registry.methods("compensator")] == ["toy-shrink"]


def test_no_plugins_at_all_lookups_say_none_is_registered():
    with pytest.raises(KeyError, match="unknown scorer 'variance'; registered scorers: none"):
        registry_with(entry_points=False, builtins=False).scorer("variance")


# --- built-ins ----------------------------------------------------------------------------------------

def test_builtins_are_registered_with_provider_and_needs():
    registry = default_registry()
    assert names(registry, "scorer") == BUILTIN_SCORERS
    assert names(registry, "compensator") == BUILTIN_COMPENSATORS
    builtins = [m for m in registry.methods("scorer") + registry.methods("compensator") if m.name in
                BUILTIN_SCORERS + BUILTIN_COMPENSATORS]
    for method in builtins:
        assert method.provider.startswith(("builtin (rcpu-bench", "rcpu_bench.methods."))
        assert method.description
    needs = {m.name: m.needs for m in registry.methods("compensator") if m.name in BUILTIN_COMPENSATORS}
    assert needs == {"flap-bias": "moments", "none": "moments", "procrustes": "output_cross", "ridge": "gram",
                     "scaled-procrustes": "gram", "slimllm": "gram", "olica": "gram"}


def test_each_peer_method_is_a_plugin_of_its_own_package_and_the_harness_methods_are_builtin():
    registry = default_registry()
    peers = {("allocation", "search"): "search", ("model-method", "shortgpt"): "depth",
             ("model-method", "replaceme"): "depth", ("compensator", "slimllm"): "slimllm",
             ("compensator", "olica"): "olica", ("scorer", "minitron"): "minitron"}
    for (kind, name), package in peers.items():
        assert registry.get(kind, name).provider.startswith(f"rcpu_bench.methods.{package} (rcpu-bench ")
    harness = [m for kind in ("scorer", "selector", "compensator", "allocation") for m in registry.methods(kind)
               if (kind, m.name) not in peers]
    assert harness and all(m.provider.startswith("builtin (rcpu-bench ") for m in harness)
    assert registry.get("model-method", "shortgpt").check is not None  # the depth baselines' check, with the ratio


def test_builtin_params_are_keyword_only_defaults():
    registry = default_registry()
    assert registry.scorer("wanda-sp").params == {"variant": "flap"}
    assert registry.scorer("variance").params == {"activation": "l2"}
    assert registry.scorer("magnitude").params == {}
    assert registry.compensator("ridge").params == {"lam": 1e-4, "lam_rel": 0.0, "dtype": "float64"}
    assert registry.compensator("procrustes").params == {"dtype": "float64", "solver": "auto"}


def test_builtin_method_call_equals_direct_function():
    W, stats, kept, pruned = make_problem()
    registry = default_registry()
    torch.testing.assert_close(registry.scorer("wanda-sp")(W, stats, variant="paper"),
                               scorers.wanda_sp(W, stats, variant="paper"))
    torch.testing.assert_close(registry.compensator("ridge")(W, stats, kept, pruned, lam=0.1).weight,
                               compensators.ridge(W, stats, kept, pruned, lam=0.1).weight)


# --- errors -------------------------------------------------------------------------------------------

def test_duplicate_name_against_builtin_isolates_the_plugin_and_names_both_providers():
    class Clash:
        @hookimpl
        def register_scorers(self, register):
            register("toy-score", toy_score)
            register("magnitude", toy_score)

    registry = registry_with(("clash-plugin", Clash()))
    why = registry.broken["clash-plugin"]
    assert "duplicate scorer name 'magnitude'" in why and "builtin (rcpu-bench" in why and "clash-plugin" in why
    assert registry.scorer("magnitude").provider.startswith("builtin")
    with pytest.raises(KeyError, match="scorer 'toy-score' is unavailable: its plugin clash-plugin failed.*magnitude"):
        registry.scorer("toy-score")


def test_duplicate_name_between_two_plugins_names_both_and_keeps_the_first():
    class First:
        @hookimpl
        def register_compensators(self, register):
            register("shrink", toy_shrink)

    class Second(First):
        pass

    registry = registry_with(("first-plugin", First()), ("second-plugin", Second()))
    assert registry.broken == {"second-plugin": "duplicate compensator name 'shrink': registered by first-plugin "
                                                "and by second-plugin"}
    assert registry.compensator("shrink").provider == "first-plugin"


def test_a_name_registered_twice_by_one_plugin_is_a_clash():
    class Twice:
        @hookimpl
        def register_scorers(self, register):
            register("toy-score", toy_score)
            register("toy-score", toy_score)

    registry = registry_with(("twice", Twice()), builtins=False, entry_points=False)
    assert "duplicate scorer name 'toy-score': registered by twice and by twice" in registry.broken["twice"]


def test_unknown_name_lists_registered_names():
    with pytest.raises(KeyError, match="unknown scorer 'wanda'") as err:
        default_registry().scorer("wanda")
    assert all(name in str(err.value) for name in BUILTIN_SCORERS)
    with pytest.raises(KeyError) as err:
        default_registry().compensator("rotation")
    assert all(name in str(err.value) for name in BUILTIN_COMPENSATORS)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="'pruner'.*allowed.*scorer.*compensator"):
        default_registry().get("pruner", "x")


def test_unknown_param_lists_allowed_ones():
    W, stats, kept, pruned = make_problem()
    with pytest.raises(ValueError, match="'ridge' has no parameter.*lamda.*allowed: lam, lam_rel, dtype"):
        default_registry().compensator("ridge")(W, stats, kept, pruned, lamda=1.0)


def test_unknown_param_on_method_without_params_says_none():
    W, stats, _, _ = make_problem()
    with pytest.raises(ValueError, match="allowed: none"):
        default_registry().scorer("magnitude")(W, stats, variant="flap")


def test_bad_needs_isolates_the_plugin_naming_it():
    class BadNeeds:
        @hookimpl
        def register_scorers(self, register):
            register("toy-score", toy_score, needs="activations")

    registry = registry_with(("bad-needs", BadNeeds()))
    assert "bad-needs: needs='activations'; allowed: moments, output_cross, cross, gram" in registry.broken["bad-needs"]
    assert registry.scorer("variance").provider.startswith("builtin")


# --- the result contract ------------------------------------------------------------------------------

BAD_SCORERS = {
    "short": lambda weight, stats: torch.ones(weight.shape[1] - 1, dtype=F64),
    "nan": lambda weight, stats: torch.full((weight.shape[1],), float("nan"), dtype=F64),
    "list": lambda weight, stats: [1.0] * weight.shape[1],
}
BAD_COMPENSATORS = {
    "wide": lambda weight, stats, kept, pruned: Compensation(weight),
    "nan-weight": lambda weight, stats, kept, pruned: Compensation(weight[:, kept] * float("nan")),
    "bad-bias": lambda weight, stats, kept, pruned: Compensation(weight[:, kept], torch.zeros(1)),
    "inf-bias": lambda weight, stats, kept, pruned:
        Compensation(weight[:, kept], torch.full((weight.shape[0],), float("inf"))),
    "not-a-compensation": lambda weight, stats, kept, pruned: weight[:, kept],
}


@pytest.mark.parametrize("name,problem", [("short", r"shape \(5,\).*expected.*\(6,\)"), ("nan", "NaN"),
                                          ("list", "list")])
def test_bad_scorer_result_raises_contract_error_naming_plugin(name, problem):
    W, stats, _, _ = make_problem()
    method = make_method("scorer", name, BAD_SCORERS[name], "broken-plugin")
    with pytest.raises(PluginContractError, match=f"scorer '{name}' from broken-plugin .*{problem}"):
        method(W, stats)


@pytest.mark.parametrize("name,problem", [("wide", r"shape \(4, 6\), expected \(4, 4\)"), ("nan-weight", "NaN"),
                                          ("bad-bias", r"bias of shape \(1,\)"), ("inf-bias", "infinite"),
                                          ("not-a-compensation", "expected a Compensation")])
def test_bad_compensator_result_raises_contract_error_naming_plugin(name, problem):
    W, stats, kept, pruned = make_problem()
    method = make_method("compensator", name, BAD_COMPENSATORS[name], "broken-plugin")
    with pytest.raises(PluginContractError, match=f"compensator '{name}' from broken-plugin .*{problem}"):
        method(W, stats, kept, pruned)


def test_a_plugin_breaking_the_contract_is_caught_by_its_trial_run_at_registration():
    class Broken:
        @hookimpl
        def register_compensators(self, register):
            register("toy-shrink", toy_shrink)
            register("wide", BAD_COMPENSATORS["wide"])

    registry = registry_with(("broken-plugin", Broken()))
    assert registry.broken["broken-plugin"] == (
        "trial run of compensator 'wide' failed: PluginContractError: compensator 'wide' from broken-plugin "
        "returned a weight of shape (3, 4), expected (3, 2)")
    for name in ("wide", "toy-shrink"):  # the plugin is admitted whole or not at all
        with pytest.raises(KeyError, match=f"compensator '{name}' is unavailable: its plugin broken-plugin failed"):
            registry.compensator(name)
    assert registry.compensator("procrustes").provider.startswith("builtin")


# --- CLI ----------------------------------------------------------------------------------------------

def test_cli_plugins_lists_all_builtins(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "scorers:" in out and "compensators:" in out
    for name in BUILTIN_SCORERS + BUILTIN_COMPENSATORS:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "lam=0.0001" in out and "variant='flap'" in out


# --- built-ins registered in code ---------------------------------------------------------------------

def without_installed_plugins(monkeypatch, *entries):
    """The entry-point group holds only ``entries``: a source checkout that was never pip-installed has none."""
    monkeypatch.setattr(registry_module.metadata, "entry_points", lambda group: list(entries))


def test_builtins_are_registered_without_installed_metadata(monkeypatch):
    without_installed_plugins(monkeypatch)
    registry = build_registry(plugin_manager())
    assert [m.name for m in registry.methods("scorer")] == BUILTIN_SCORERS
    assert [m.name for m in registry.methods("compensator")] == BUILTIN_COMPENSATORS
    assert registry.broken == {}


def test_an_installed_builtin_entry_point_is_not_registered_twice(monkeypatch):
    """An older install declares ``builtin = "rcpu_bench.builtin"``: the same module, skipped, no clash."""
    without_installed_plugins(monkeypatch, metadata.EntryPoint("builtin", "rcpu_bench.builtin", "rcpu_bench"))
    registry = build_registry(plugin_manager())
    assert registry.broken == {}
    assert [m.name for m in registry.methods("scorer")] == BUILTIN_SCORERS
    assert all(m.provider.startswith(("builtin (rcpu-bench", "rcpu_bench.methods."))
               for m in registry.methods("compensator"))


def test_a_foreign_entry_point_named_builtin_is_reported_not_merged(monkeypatch):
    without_installed_plugins(monkeypatch, metadata.EntryPoint("builtin", "rcpu_example.plugin", "rcpu_bench"))
    registry = build_registry(plugin_manager())
    assert "builtin" in registry.broken["builtin"] and "ValueError" in registry.broken["builtin"]
    assert [m.name for m in registry.methods("scorer")] == BUILTIN_SCORERS


# --- typed tables and names resolved once -------------------------------------------------------------

def test_tables_per_kind_are_read_only_views_of_the_same_entries():
    registry = registry_with(("toy", ToyPlugin()))
    assert sorted(registry.scorers) == [m.name for m in registry.methods("scorer")]
    assert registry.scorers["toy-score"] is registry.scorer("toy-score")
    assert registry.compensators["ridge"] is registry.get("compensator", "ridge")
    assert set(registry.model_methods) == {m.name for m in registry.methods("model-method")}
    with pytest.raises(TypeError):
        registry.scorers["mine"] = registry.scorer("toy-score")  # type: ignore[index]


def test_resolve_returns_the_entries_of_a_run():
    registry = registry_with(("toy", ToyPlugin()))
    run = registry.resolve(scorer="toy-score", compensator="toy-shrink")
    assert run.selection is registry.scorer("toy-score") and run.compensator is registry.compensator("toy-shrink")
    assert run.compensator_for(True) is run.compensator
    assert run.compensator_for(False) is registry.compensator("none") and run.model_method is None
    assert run.needs(True) == "gram" and run.needs(False) == "moments"  # toy-shrink needs G; "none", toy-score not


def test_resolve_names_what_exists_for_an_unknown_name():
    with pytest.raises(KeyError, match="unknown compensator 'rotation'; registered compensators: flap-bias, none"):
        default_registry().resolve(scorer="variance", compensator="rotation")
    with pytest.raises(KeyError, match="unknown model-method 'slice'"):
        default_registry().resolve(scorer="variance", compensator="none", model_method="slice")


def test_a_parameter_set_is_tried_once_and_a_rejected_one_every_time():
    calls = []

    def scaled(weight, stats, *, power=1.0):
        calls.append(power)
        if power < 0:
            raise ValueError(f"power={power} must be >= 0")
        return scorers.magnitude(weight, stats) ** power

    method = make_method("scorer", "scaled", scaled, "test-plugin")
    for _ in range(3):
        method.validate({"power": 2.0})
    assert calls == [2.0]
    for _ in range(2):
        with pytest.raises(ValueError, match="power=-1"):
            method.validate({"power": -1})
    assert calls == [2.0] + [-1] * 4  # each rejection tries without G, then with G (is it an undeclared need?)


def test_a_model_methods_check_sees_the_ratio_before_any_weights_load():
    def keep_half(model, calib_ids, *, ratio):
        return {}

    def at_most_half(model, /, *, ratio):
        if ratio > 0.5:
            raise ValueError(f"keep-half prunes at most half of a model; got ratio={ratio}")

    class Plugin:
        register_model_methods = staticmethod(hookimpl(lambda register: register("keep-half", keep_half,
                                                                                 check=at_most_half)))

    registry = registry_with(("keep-half", Plugin()), entry_points=False)
    skeleton = tiny_model(tiny_config())
    PruneConfig(model_method="keep-half", ratio=0.5).check_budget(skeleton, registry)
    with pytest.raises(ValueError, match="at most half of a model; got ratio=0.6"):
        PruneConfig(model_method="keep-half", ratio=0.6).check_budget(skeleton, registry)
    with pytest.raises(ValueError, match="ratio=0.01 matches .* 0 of 3 layers"):  # the built-in depth methods' check
        PruneConfig(model_method="shortgpt", ratio=0.01).check_budget(skeleton, registry)


def test_a_model_methods_check_without_the_ratio_keyword_is_refused_at_registration():
    with pytest.raises(ValueError, match=r"check='skeleton_only' does not take \(model, \*, ratio\)"):
        make_method("model-method", "old", lambda model, calib_ids, *, ratio: {}, "old-plugin", check=skeleton_only)


def skeleton_only(model):
    """A check written for the hook before it passed the ratio."""
