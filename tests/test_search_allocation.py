"""The searched allocation (Týr-the-Pruner): exact budget, refusal before work, determinism, the on-disk candidate
cache, and the whole run from the command line and a matrix."""

from __future__ import annotations

import copy
import itertools
import math
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from registries import builtin_registry
from tiny_matrices import tiny_matrix
from tiny_models import STORIES_MHA, needs_stories, tiny_config, tiny_model, tokens

from rcpu_bench import hookimpl
from rcpu_bench.cli import main
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.store import Store
from rcpu_bench.methods.search import driver, genome
from rcpu_bench.methods.search.genome import Slot, offspring, removed, witness
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model
from rcpu_bench.records import read_records
from rcpu_bench.registry import PluginContractError, build_registry

REGISTRY = builtin_registry()
CONFIG = tiny_config(layers=3, n_heads=6, n_kv_heads=6, intermediate=20)  # MHA: 6 heads of 6, 20 channels, width 24
RATIO = 0.3  # uniform: ⌊1.8⌋ = 1 head and ⌊6⌋ = 6 channels per layer; one level moves 1 head or 1 channel
QUICK = {"population": 4, "generations": 3, "tokens": 12, "stages": 2, "growth": 2}  # 2 held-out windows of 12
HELD_OUT = tokens(CONFIG.vocab_size, batch=8, length=12, seed=99)


def run(model, cache=None, **params):
    """Prune ``model`` in place with the searched allocation (one-shot statistics, ridge); returns the report."""
    config = PruneConfig(ratio=RATIO, compensator="ridge", statistics="one-shot", allocation="search",
                         allocation_params={**QUICK, "cache": None if cache is None else str(cache), **params})
    return prune_model(model, tokens(CONFIG.vocab_size, batch=4, length=12), config, registry=REGISTRY,
                       progress=False, holdout_source=lambda n: HELD_OUT[:n])


def kl_to(dense, model, windows) -> float:
    """Mean over positions of KL(p_dense ‖ p_model), from both models' logits."""
    with torch.no_grad():
        p, q = (m(windows).logits.double().log_softmax(-1) for m in (dense, model))
    return float((p.exp() * (p - q)).sum() / windows.numel())


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """(dense, searched, uniform, report): one search and the uniform allocation, same scorer and compensator."""
    dense = tiny_model(CONFIG)
    model, uniform = copy.deepcopy(dense), copy.deepcopy(dense)
    report = run(model, cache=tmp_path_factory.mktemp("cache"))
    prune_model(uniform, tokens(CONFIG.vocab_size, batch=4, length=12),
                PruneConfig(ratio=RATIO, compensator="ridge", statistics="one-shot"), registry=REGISTRY,
                progress=False)
    return dense, model, uniform, report


# --- the grid and the budget ---------------------------------------------------------------------------------------

@st.composite
def grids(draw):
    """Up to 4 slots of one module, each with a few levels, a step of units and a cost per unit."""
    grid = []
    for layer in range(draw(st.integers(1, 4))):
        uniform, size, cost = draw(st.integers(0, 4)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 6]))
        levels = draw(st.lists(st.integers(-2, 2), min_size=1, max_size=3, unique=True))
        counts = {k: uniform + k * size for k in levels if uniform + k * size >= 0}
        assume(counts)
        grid.append(Slot(layer, "mlp", uniform, counts, cost))
    return grid


@settings(max_examples=200, deadline=None)
@given(grid=grids())
def test_a_choice_meeting_the_budget_is_found_exactly_when_one_exists(grid):
    budget = sum(slot.uniform * slot.cost for slot in grid)
    exists = any(removed(grid, genome) == budget for genome in itertools.product(*(slot.counts for slot in grid)))
    found = witness(grid, budget)
    assert (found is not None) == exists
    if found is not None:
        assert removed(grid, found) == budget
    if all(0 in slot.counts for slot in grid):
        assert found == (0,) * len(grid)  # the uniform choice when the grid has it


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), costs=st.lists(st.sampled_from([1, 2, 4]), min_size=6, max_size=6))
def test_offspring_remove_exactly_the_parents_parameters(seed, costs):
    grid = [Slot(i // 2, module, 3, {k: 3 + k for k in (-2, -1, 0, 1, 2)}, cost)
            for i, (module, cost) in enumerate(zip(["attention", "mlp"] * 3, costs))]
    parent = (0,) * len(grid)
    children = offspring(parent, grid, random.Random(seed), population=8, shifts=4)
    assert len(set(children)) == len(children) and parent not in children
    for child in children:
        assert removed(grid, child) == removed(grid, parent)
        assert all(level in slot.counts for slot, level in zip(grid, child))


def test_the_stage_plan_grows_the_tokens_and_narrows_the_survivors():
    assert genome.stage_plan(population=16, stages=3, growth=4, tokens=256, seqlen=128) == [(2, 4), (8, 1), (32, 1)]
    assert genome.stage_plan(population=128, stages=3, growth=8, tokens=2048, seqlen=4096) == [(1, 16), (4, 2), (32, 1)]


# --- before any work -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("levels", [[1, 2], [-1, 1]])  # all above uniform; odd layers cannot balance ±1 steps
def test_an_impossible_budget_is_refused_before_any_model_work(tmp_path, levels):
    model = tiny_model(CONFIG)

    def no_forward(*_):
        raise AssertionError("the model ran")

    model.register_forward_pre_hook(no_forward)
    config = PruneConfig(ratio=RATIO, allocation="search", allocation_params={"levels": levels,
                                                                               "cache": str(tmp_path / "c")})
    budget = 3 * (1 * 4 * 6 * 24 + 6 * 3 * 24)  # per layer: a head's q, k, v rows and o columns; a channel's 3 × 24
    message = (f"allocation 'search' levels={levels} with step=0.05: no choice of one level per layer and module "
               f"removes the {budget:,} parameters")
    with pytest.raises(ValueError, match=re.escape(message)):
        prune_model(model, tokens(CONFIG.vocab_size), config, registry=REGISTRY, progress=False,
                    holdout_source=lambda n: pytest.fail("held-out windows drawn"))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("params, message", [
    ({"levels": [0, 0]}, "search levels=[0, 0]: not a grid"),
    ({"levels": [0.5]}, "search levels=[0.5]"),
    ({"step": 1.5}, "search step=1.5"),
    ({"population": 0}, "search population=0: not a count; allowed: an integer >= 1"),
    ({"keep": "yes"}, "keep='yes'"),
])
def test_bad_parameters_are_refused_by_the_configuration_check(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PruneConfig(allocation="search", allocation_params=params).validate(REGISTRY)


def test_unsupported_options_are_refused_before_any_model_work():
    for options in ({"round_to": 8}, {"offload": True}, {"gqa_rule": "query"}):
        with pytest.raises(ValueError, match="allocation 'search' with round_to="):
            prune_model(tiny_model(CONFIG), tokens(CONFIG.vocab_size), PruneConfig(allocation="search", **options),
                        registry=REGISTRY, progress=False)


# --- the search on a tiny model ------------------------------------------------------------------------------------

def test_the_chosen_levels_remove_exactly_the_uniform_allocations_parameters(searched):
    dense, model, uniform, report = searched
    record = report.method_report["allocation"]
    removed_by_uniform = parameter_count(dense) - parameter_count(uniform)
    assert parameter_count(dense) - parameter_count(model) == removed_by_uniform == record["budget_parameters"]
    assert record["removed_parameters"] == removed_by_uniform
    for layer, levels in zip(report.layers, record["chosen_levels"]):  # level k: uniform count + k units (step 1)
        assert layer["attention"]["units_pruned"] == 1 + levels["attention"]
        assert layer["mlp"]["units_pruned"] == 6 + levels["mlp"]
    assert any(level != 0 for levels in record["chosen_levels"] for level in levels.values())


def test_the_fitness_curve_is_the_kl_from_uniform_to_the_searched_model(searched):
    dense, model, uniform, report = searched
    record = report.method_report["allocation"]
    windows = HELD_OUT[: record["heldout_windows"]]
    curve = record["fitness"]
    assert len(curve) == QUICK["generations"] + 1 and all(a >= b for a, b in zip(curve, curve[1:]))
    assert curve[0] == pytest.approx(kl_to(dense, uniform, windows), rel=1e-4)  # generation 0: the uniform choice
    assert curve[-1] == pytest.approx(kl_to(dense, model, windows), rel=1e-4)  # one-shot: the best candidate itself
    assert curve[-1] < curve[0]
    assert record["stages"] == [{"windows": 1, "tokens": 12, "survivors": 2}, {"windows": 2, "tokens": 24,
                                                                                 "survivors": 1}]


def test_the_search_is_determined_by_its_seed(searched, tmp_path):
    dense, _, _, report = searched
    again = run(copy.deepcopy(dense), cache=tmp_path)
    first, second = (r.method_report["allocation"] for r in (report, again))
    for key in ("fitness", "chosen_levels", "removed_parameters"):
        assert first[key] == second[key]


def test_the_candidate_cache_is_removed_unless_kept(searched, tmp_path):
    dense, _, _, report = searched
    record = report.method_report["allocation"]
    assert record["cache"] is None and record["cache_bytes"] > 0
    run(copy.deepcopy(dense), cache=tmp_path / "gone")
    assert list((tmp_path / "gone").iterdir()) == []
    kept = run(copy.deepcopy(dense), cache=tmp_path / "kept", keep=True).method_report["allocation"]
    directory = Path(kept["cache"])
    assert directory.parent == tmp_path / "kept"
    levels = {"attention": 4, "mlp": 5}  # attention's level −2 would prune −1 heads
    assert len(list((directory / "candidates").iterdir())) == 3 * sum(levels.values())
    assert len(list((directory / "dense").iterdir())) == 3 * 2
    assert len(list((directory / "targets").iterdir())) == kept["heldout_windows"]
    assert kept["cache_bytes"] == sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    for path in directory.rglob("*.pt"):  # each file holds its tensors' bytes only, not a larger storage they view
        for tensor in saved_tensors(torch.load(path)):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), path


def saved_tensors(saved) -> list[torch.Tensor]:
    """Every tensor in what ``torch.save`` wrote: a tensor, or lists, tuples and dicts of them (None skipped)."""
    if isinstance(saved, torch.Tensor):
        return [saved]
    items = saved.values() if isinstance(saved, dict) else saved if isinstance(saved, (list, tuple)) else []
    return [tensor for item in items for tensor in saved_tensors(item)]


def test_a_failing_search_hands_the_model_back_dense_and_removes_its_cache(monkeypatch, tmp_path):
    dense = tiny_model(CONFIG)
    model = copy.deepcopy(dense)

    def fail(*_):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(driver, "select_parent", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        run(model, cache=tmp_path)
    assert list(tmp_path.iterdir()) == []
    for (name, a), (_, b) in zip(dense.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [n for n, _ in dense.named_parameters()] == [n for n, _ in model.named_parameters()]


# --- the model-allocation contract ---------------------------------------------------------------------------------

class FrontLoaded:
    """A third-party model allocation: all the MLP pruning in the last layer, attention as given."""

    def __init__(self, attention: int):
        self.attention = attention

    def __call__(self, task):
        n = len(task.model.model.layers)
        return [{"attention": self.attention, "mlp": 6 * n if i == n - 1 else 0} for i in range(n)], {"layers": n}

    @hookimpl
    def register_allocations(self, register):
        register("front-loaded", lambda n_layers, ratio, /: self)


def test_a_third_party_model_allocation_runs_and_a_bad_one_is_refused():
    good = build_registry(plugin_manager([("good", FrontLoaded(attention=1))], entry_points=False))
    config = PruneConfig(ratio=RATIO, compensator="ridge", allocation="front-loaded")
    report = prune_model(tiny_model(CONFIG), tokens(CONFIG.vocab_size, batch=4, length=12), config, registry=good,
                         progress=False)
    assert [layer["mlp"]["units_pruned"] for layer in report.layers] == [0, 0, 18]
    assert report.method_report == {"allocation": {"layers": 3}}
    bad = build_registry(plugin_manager([("bad", FrontLoaded(attention=6))], entry_points=False))
    with pytest.raises(PluginContractError, match=r"allocation 'front-loaded' from bad returned layer 0 counts"):
        prune_model(tiny_model(CONFIG), tokens(CONFIG.vocab_size), config, registry=bad, progress=False)


# --- end to end on the stories260K fixture -------------------------------------------------------------------------

SMALL = ["population=3", "generations=2", "tokens=64", "stages=2", "growth=2"]


@needs_stories
def test_prune_with_the_searched_allocation_from_the_command_line(capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    params = [arg for p in SMALL for arg in ("--allocation-param", p)]
    code = main(["prune", "--model", str(STORIES_MHA), "--calib", "tinystories:8x64", "--ppl", "tinystories[900:910]",
                 "--quiet", "--ratio", "0.25", "--compensator", "ridge", "--allocation", "search", *params,
                 "--allocation-param", f"cache='{tmp_path / 'cache'}'", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    [record] = read_records(out)
    searched = record["method_report"]["allocation"]
    assert record["parameters"]["before"] - record["parameters"]["after"] == searched["budget_parameters"]
    assert searched["removed_parameters"] == searched["budget_parameters"]
    assert len(searched["fitness"]) == 3 and len(searched["chosen_levels"]) == 5
    assert searched["heldout_windows"] == 2 and list((tmp_path / "cache").iterdir()) == []
    assert record["timing"]["prune_seconds"]["allocation"] >= sum(searched["seconds"].values())


@needs_stories
def test_a_matrix_cell_with_the_searched_allocation(tmp_path):
    method = {"name": "searched", "scorer": "variance", "compensator": "procrustes", "allocation": "search",
              "allocation_params": {"population": 2, "generations": 1, "tokens": 64, "stages": 1}}
    summary = run_matrix(tiny_matrix([method]), tmp_path / "results", progress=False, registry=REGISTRY)
    assert (summary.ok, summary.failed) == (1, 0)
    [entry] = Store(tmp_path / "results").entries()
    searched = entry.record.method_report["allocation"]
    assert searched["removed_parameters"] == searched["budget_parameters"] and len(searched["fitness"]) == 2
    assert math.isfinite(entry.record.perplexity[0].ppl)
