"""The allocation axis: log-increase ratios, AL-AM as an allocation, third-party allocations and selectors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_config, tiny_model, tokens

from rcpu_bench import hookimpl
from rcpu_bench.matrix.cells import cell_id
from rcpu_bench.plugins import default_registry, plugin_manager
from rcpu_bench.pruning.allocation import log_increase
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model
from rcpu_bench.registry import build_registry
from rcpu_bench.selection.select import Selection


@settings(max_examples=60, deadline=None)
@given(n_layers=st.integers(2, 48), ratio=st.floats(0.0, 0.45), spread=st.floats(0.0, 1.0))
def test_log_increase_ratios_sum_to_the_target_and_grow_with_the_log_of_depth(n_layers, ratio, spread):
    ratios = log_increase(n_layers, ratio, spread=spread)
    assert float(ratios.sum()) == pytest.approx(n_layers * ratio, abs=1e-9)
    assert float(ratios[0]) == pytest.approx(ratio * (1 - spread), abs=1e-12)
    if ratio * spread > 1e-6:  # below, the rise's denominator is rounding-sized
        rise = (ratios - ratios[0]) / (ratios[-1] - ratios[0])
        expected = [math.log(1 + layer) / math.log(n_layers) for layer in range(n_layers)]
        assert rise.tolist() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.3, 0.45])
@pytest.mark.parametrize("n_layers", [2, 5, 8, 32])
def test_log_increase_with_full_spread_starts_at_exactly_zero(n_layers, ratio):
    ratios = log_increase(n_layers, ratio)
    assert float(ratios[0]) == 0.0 and bool((ratios >= 0).all())
    assert default_registry().allocation("log-increase")(n_layers, ratio).shape == (n_layers,)  # passes the contract


def test_log_increase_refuses_a_last_layer_ratio_of_one_or_more():
    with pytest.raises(ValueError, match="last layer ratio"):
        log_increase(8, 0.7)
    with pytest.raises(ValueError, match="spread=2"):
        log_increase(8, 0.2, spread=2)


def test_allocation_al_am_is_stored_as_structure_al_am_with_the_same_cell_id():
    by_allocation, by_structure = PruneConfig(allocation="al-am"), PruneConfig(structure="al-am")
    assert by_allocation == by_structure and by_allocation.allocation == "uniform"
    old = {k: v for k, v in by_structure.to_dict().items() if k not in ("allocation", "allocation_params")}
    cell = {"model": "m", "n_calib": 8, "seqlen": 128, "calib": "c", "revision": None,
            "ppl_profiles": [], "eval": ["ppl"], "dtype": "float32"}
    assert cell_id({**cell, "prune": by_allocation.to_dict()}) == cell_id({**cell, "prune": old})
    with pytest.raises(ValueError, match="structure='al-am' is itself the allocation"):
        PruneConfig(structure="al-am", allocation="log-increase").validate(default_registry())


def units_pruned(report, module: str) -> list[int]:
    return [layer[module]["units_pruned"] for layer in report.layers]


@pytest.mark.slow
def test_log_increase_prunes_each_layer_at_its_own_ratio():
    config = tiny_config(layers=4, n_kv_heads=6, intermediate=40)
    model = tiny_model(config)
    report = prune_model(model, tokens(config.vocab_size, batch=4, length=12),
                         PruneConfig(ratio=0.3, allocation="log-increase", compensator="none"), progress=False,
                         registry=default_registry())
    depth = [math.log(1 + layer) / math.log(4) for layer in range(4)]
    ratios = [0.3 + 0.3 / (sum(depth) / 4) * (d - sum(depth) / 4) for d in depth]
    assert units_pruned(report, "mlp") == [math.floor(r * 40 + 1e-9) for r in ratios]
    assert units_pruned(report, "attention") == [math.floor(r * 6 + 1e-9) for r in ratios]


@pytest.mark.slow
def test_obs_under_al_am_prunes_flap_s_per_layer_counts():
    config = tiny_config(layers=3, n_kv_heads=6, intermediate=30)
    ids = tokens(config.vocab_size, batch=6, length=12)
    dense = tiny_model(config)
    counts = {}
    for scorer in ("flap-wifv", "obs"):
        report = prune_model(copy.deepcopy(dense), ids, PruneConfig(ratio=0.3, scorer=scorer, structure="al-am",
                                                                    compensator="none"), progress=False,
                                                                    registry=default_registry())
        counts[scorer] = (units_pruned(report, "attention"), units_pruned(report, "mlp"))
    assert counts["obs"] == counts["flap-wifv"]


class ThirdParty:
    """A front-loaded allocation and a selector that prunes the last units."""

    @staticmethod
    def front(n_layers, ratio, /, *, tilt: float = 0.5):
        """More pruning in early layers, mean ρ."""
        steps = torch.linspace(1, -1, n_layers, dtype=torch.float64) if n_layers > 1 else torch.zeros(1)
        return ratio + tilt * ratio * steps

    @staticmethod
    def last(weight, stats, units, n_prune, /):
        """Prune the last n_prune units."""
        n_units = weight.shape[1] // units.unit_size
        return Selection(torch.arange(n_units - n_prune), torch.arange(n_units - n_prune, n_units))

    @hookimpl
    def register_allocations(self, register):
        register("front", self.front)

    @hookimpl
    def register_selectors(self, register):
        register("last", self.last)


class BadPlugins:
    """An allocation whose mean is not the target, and a selector that prunes one unit too many."""

    @hookimpl
    def register_allocations(self, register):
        register("too-much", lambda n_layers, ratio: torch.full((n_layers,), 2 * ratio, dtype=torch.float64))

    @hookimpl
    def register_selectors(self, register):
        register("greedy", lambda weight, stats, units, n_prune: Selection(torch.tensor([0]), torch.tensor([1])))


class UndeclaredGramSelector:
    @hookimpl
    def register_selectors(self, register):
        register("gram-diag", lambda weight, stats, units, n_prune: Selection(
            torch.sort(stats.gram.diagonal()[::units.unit_size]).indices[n_prune:].sort().values,
            torch.sort(stats.gram.diagonal()[::units.unit_size]).indices[:n_prune].sort().values))


class ClashingSelector:
    @hookimpl
    def register_selectors(self, register):
        register("variance", ThirdParty.last)


def test_third_party_allocations_and_selectors_pass_the_contract_and_the_bad_ones_are_isolated():
    registry = build_registry(plugin_manager([("third", ThirdParty()), ("bad", BadPlugins()),
                                              ("undeclared", UndeclaredGramSelector()), ("clash", ClashingSelector())]))
    assert registry.allocation("front").provider == "third" and registry.selection("last").kind == "selector"
    assert "ratios of mean 0.4" in registry.broken["bad"] and "expected the target 0.2" in registry.broken["bad"]
    assert "'gram-diag' from undeclared declares needs='moments' but reads the Gram matrix" in registry.broken[
        "undeclared"]
    assert "duplicate selector name 'variance'" in registry.broken["clash"]
    for name in ("obs",):
        assert registry.selection(name).provider.startswith("builtin")
    for name in ("uniform", "log-increase"):
        assert registry.allocation(name).provider.startswith("builtin")
    with pytest.raises(ValueError, match="no parameter"):
        PruneConfig(allocation="front", allocation_params={"tilt2": 1}).validate(registry)
    with pytest.raises(KeyError, match="unknown scorer 'lastt'.*registered selectors: last, obs"):
        PruneConfig(scorer="lastt").validate(registry)


@pytest.mark.slow
def test_a_third_party_allocation_and_selector_run_in_the_pipeline():
    registry = build_registry(plugin_manager([("third", ThirdParty())]))
    config = tiny_config(layers=3, n_kv_heads=6, intermediate=20)
    model = tiny_model(config)
    report = prune_model(model, tokens(config.vocab_size, batch=3, length=8),
                         PruneConfig(ratio=0.2, scorer="last", allocation="front", compensator="ridge"),
                         registry=registry, progress=False)
    ratios = [0.2 + 0.1 * s for s in (1.0, 0.0, -1.0)]
    assert units_pruned(report, "mlp") == [math.floor(r * 20 + 1e-9) for r in ratios]
    assert [layer["mlp"]["pruned_units"] for layer in report.layers] == [
        list(range(20 - n, 20)) for n in units_pruned(report, "mlp")]
