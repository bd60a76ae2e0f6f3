"""The pluggy registry: built-ins, third-party plugins registered from here, and the result contract."""

import pytest
import torch

from rcpu_bench.compensation import compensators
from rcpu_bench.selection import scorers
from rcpu_bench.cli import main
from rcpu_bench.compensation.compensators import Compensation
from rcpu_bench.hookspecs import hookimpl
from rcpu_bench.registry import PluginContractError, build_registry, default_registry, plugin_manager
from rcpu_bench.statistics.activations import ActivationStats

F64 = torch.float64
BUILTIN_SCORERS = ["flap-wifv", "magnitude", "variance", "wanda-sp"]
BUILTIN_COMPENSATORS = ["flap-bias", "none", "procrustes", "ridge", "scaled-procrustes"]


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


def registry_with(*plugins, entry_points=True):
    return build_registry(plugin_manager(list(plugins), entry_points=entry_points))


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
    """Method names from the built-in plugin and the test's own (other installed plugins are ignored)."""
    return [m.name for m in registry.methods(kind) if m.provider.startswith(("builtin", "toy"))]


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
    """A plugin can also be a plain namespace of hook functions; without entry points only it is present."""
    class OnlyToy:
        register_scorers = staticmethod(hookimpl(lambda register: register("toy-score", toy_score)))
        register_compensators = staticmethod(hookimpl(lambda register: register("toy-shrink", toy_shrink)))

    registry = registry_with(("only", OnlyToy()), entry_points=False)
    assert [m.name for m in registry.methods("scorer")] == ["toy-score"]
    assert [m.name for m in registry.methods("compensator")] == ["toy-shrink"]


def test_no_plugins_at_all_is_a_clear_error():
    with pytest.raises(RuntimeError, match="entry points"):
        registry_with(entry_points=False)


# --- built-ins ----------------------------------------------------------------------------------------

def test_builtins_are_registered_with_provider_and_needs():
    registry = default_registry()
    assert names(registry, "scorer") == BUILTIN_SCORERS
    assert names(registry, "compensator") == BUILTIN_COMPENSATORS
    builtins = [m for m in registry.methods("scorer") + registry.methods("compensator") if m.name in
                BUILTIN_SCORERS + BUILTIN_COMPENSATORS]
    for method in builtins:
        assert method.provider.startswith("builtin (rcpu-bench")
        assert method.description
    needs = {m.name: m.needs for m in registry.methods("compensator") if m.name in BUILTIN_COMPENSATORS}
    assert needs == {"flap-bias": "moments", "none": "moments", "procrustes": "gram", "ridge": "gram",
                     "scaled-procrustes": "gram"}


def test_builtin_params_are_keyword_only_defaults():
    registry = default_registry()
    assert registry.scorer("wanda-sp").params == {"variant": "flap"}
    assert registry.scorer("variance").params == {"activation": "l2"}
    assert registry.scorer("magnitude").params == {}
    assert registry.compensator("ridge").params == {"lam": 1e-4, "dtype": "float64"}
    assert registry.compensator("procrustes").params == {"dtype": "float64", "solver": "auto"}


def test_builtin_method_call_equals_direct_function():
    W, stats, kept, pruned = make_problem()
    registry = default_registry()
    torch.testing.assert_close(registry.scorer("wanda-sp")(W, stats, variant="paper"),
                               scorers.wanda_sp(W, stats, variant="paper"))
    torch.testing.assert_close(registry.compensator("ridge")(W, stats, kept, pruned, lam=0.1).weight,
                               compensators.ridge(W, stats, kept, pruned, lam=0.1).weight)


# --- errors -------------------------------------------------------------------------------------------

def test_duplicate_name_against_builtin_names_both_providers():
    class Clash:
        @hookimpl
        def register_scorers(self, register):
            register("magnitude", toy_score)

    with pytest.raises(ValueError, match="magnitude") as err:
        registry_with(("clash-plugin", Clash()))
    assert "clash-plugin" in str(err.value) and "builtin" in str(err.value)


def test_duplicate_name_between_two_plugins_names_both_providers():
    class First:
        @hookimpl
        def register_compensators(self, register):
            register("shrink", toy_shrink)

    class Second(First):
        pass

    with pytest.raises(ValueError, match="duplicate compensator name 'shrink'") as err:
        registry_with(("first-plugin", First()), ("second-plugin", Second()))
    assert "first-plugin" in str(err.value) and "second-plugin" in str(err.value)


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
    with pytest.raises(ValueError, match="'ridge' has no parameter.*lamda.*allowed: lam, dtype"):
        default_registry().compensator("ridge")(W, stats, kept, pruned, lamda=1.0)


def test_unknown_param_on_method_without_params_says_none():
    W, stats, _, _ = make_problem()
    with pytest.raises(ValueError, match="allowed: none"):
        default_registry().scorer("magnitude")(W, stats, variant="flap")


def test_bad_needs_is_rejected_naming_the_plugin():
    class BadNeeds:
        @hookimpl
        def register_scorers(self, register):
            register("toy-score", toy_score, needs="activations")

    with pytest.raises(ValueError, match="bad-needs.*'activations'"):
        registry_with(("bad-needs", BadNeeds()))


# --- the result contract ------------------------------------------------------------------------------

class Broken:
    """A plugin whose methods break the contract in different ways."""

    @hookimpl
    def register_scorers(self, register):
        register("short", lambda weight, stats: torch.ones(weight.shape[1] - 1, dtype=F64))
        register("nan", lambda weight, stats: torch.full((weight.shape[1],), float("nan"), dtype=F64))
        register("list", lambda weight, stats: [1.0] * weight.shape[1])

    @hookimpl
    def register_compensators(self, register):
        register("wide", lambda weight, stats, kept, pruned: Compensation(weight))
        register("nan-weight", lambda weight, stats, kept, pruned: Compensation(weight[:, kept] * float("nan")))
        register("bad-bias", lambda weight, stats, kept, pruned: Compensation(weight[:, kept], torch.zeros(1)))
        register("inf-bias", lambda weight, stats, kept, pruned:
                 Compensation(weight[:, kept], torch.full((weight.shape[0],), float("inf"))))
        register("not-a-compensation", lambda weight, stats, kept, pruned: weight[:, kept])


@pytest.mark.parametrize("name,problem", [("short", r"shape \(5,\).*expected.*\(6,\)"), ("nan", "NaN"),
                                          ("list", "list")])
def test_bad_scorer_result_raises_contract_error_naming_plugin(name, problem):
    W, stats, _, _ = make_problem()
    method = registry_with(("broken-plugin", Broken())).scorer(name)
    with pytest.raises(PluginContractError, match=f"scorer '{name}' from broken-plugin .*{problem}"):
        method(W, stats)


@pytest.mark.parametrize("name,problem", [("wide", r"shape \(4, 6\), expected \(4, 4\)"), ("nan-weight", "NaN"),
                                          ("bad-bias", r"bias of shape \(1,\)"), ("inf-bias", "infinite"),
                                          ("not-a-compensation", "expected a Compensation")])
def test_bad_compensator_result_raises_contract_error_naming_plugin(name, problem):
    W, stats, kept, pruned = make_problem()
    method = registry_with(("broken-plugin", Broken())).compensator(name)
    with pytest.raises(PluginContractError, match=f"compensator '{name}' from broken-plugin .*{problem}"):
        method(W, stats, kept, pruned)


# --- CLI ----------------------------------------------------------------------------------------------

def test_cli_plugins_lists_all_builtins(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "scorers:" in out and "compensators:" in out
    for name in BUILTIN_SCORERS + BUILTIN_COMPENSATORS:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "lam=0.0001" in out and "variant='flap'" in out
