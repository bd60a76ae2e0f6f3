"""Reuse that changes no number: cells sharing model and calibration share layer 0's captured inputs, with
bit-identical compensated weights and records; the dense model is evaluated once per model and matrix."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_matrices import tiny_matrix
from tiny_models import needs_stories, tiny_config, tiny_model, tokens

from rcpu_bench.matrix.executors import LocalExecutor
from rcpu_bench.matrix.reuse import LayerInputCache, capture_key
from rcpu_bench.matrix.spec import expand
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning import walk
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model

METHODS = [("wanda-sp", "none", {}), ("variance", "procrustes", {}), ("variance", "ridge", {"lam": 1.0}),
           ("wanda-sp", "scaled-procrustes", {})]


def _count_captures(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = walk.capture

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(walk, "capture", counting)
    return calls


def _without_seconds(layers):
    return [{k: v for k, v in layer.items() if k != "seconds"} for layer in layers]


@pytest.mark.slow
def test_compensated_weights_are_bit_identical_with_reused_layer_inputs(monkeypatch):
    dense = tiny_model(tiny_config(layers=3))
    calib = tokens(dense.config.vocab_size, batch=6, length=16, seed=1)
    captures = _count_captures(monkeypatch)
    cache = LayerInputCache()
    for scorer, compensator, params in METHODS:
        config = PruneConfig(scorer=scorer, compensator=compensator, compensator_params=params, ratio=0.4,
                             batch_size=4)
        fresh, reused = copy.deepcopy(dense), copy.deepcopy(dense)
        fresh_report = prune_model(fresh, calib, config, progress=False, registry=default_registry())
        reused_report = prune_model(reused, calib, config, progress=False, reuse_capture=cache.reuse(("tiny",)),
                                    registry=default_registry())
        assert _without_seconds(fresh_report.layers) == _without_seconds(reused_report.layers)
        for (name, a), (_, b) in zip(fresh.state_dict().items(), reused.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    assert (cache.misses, cache.hits) == (1, len(METHODS) - 1)
    assert len(captures) == len(METHODS) + 1  # one per fresh prune, one for all the reusing ones


def test_the_cache_keeps_the_last_max_entries_keys_and_recomputes_an_evicted_one():
    computed: list[str] = []

    def capture(key):
        return lambda: computed.append(key) or [key]

    cache = LayerInputCache(max_entries=2)
    for key in ["a", "b", "a", "c", "b", "a"]:
        assert cache.reuse((key,))(capture(key)) == [key]
    # a, b computed; a hit; c evicts b (least recently used); b evicts a; a recomputed
    assert computed == ["a", "b", "c", "b", "a"] and (cache.hits, cache.misses) == (1, 5)
    with pytest.raises(ValueError, match="max_entries=0"):
        LayerInputCache(max_entries=0)


def test_the_capture_key_separates_whatever_changes_layer_0_inputs():
    cells = expand(tiny_matrix(["wanda-sp", "rcpu-rot"], ratios=[0.1, 0.2], include_dense=True), default_registry())
    assert len({capture_key(cell, "cpu") for cell in cells}) == 1  # methods and ratios share one capture
    base = cells[0]
    other_calib = expand(tiny_matrix(["wanda-sp"], calib={"source": "tinystories", "n_calib": [4], "seqlen": 64}),
                         default_registry())[0]
    assert capture_key(other_calib, "cpu") != capture_key(base, "cpu")
    assert capture_key(base, "cuda:0") != capture_key(base, "cuda:1") != capture_key(base, "cpu")
    batched = expand(tiny_matrix([{"name": "b", "scorer": "wanda-sp", "compensator": "none", "batch_size": 2}]),
                     default_registry())[0]
    assert capture_key(batched, "cpu") != capture_key(base, "cpu")


@pytest.mark.slow
@needs_stories
def test_a_matrix_run_with_reuse_records_the_same_numbers_and_captures_once(monkeypatch):
    matrix = tiny_matrix(["wanda-sp", "rcpu-rot"], include_dense=True)  # uniform structure: one capture a cell
    cells = expand(matrix, default_registry())
    captures = _count_captures(monkeypatch)
    pruned = len(cells) - 1  # the dense cell walks no layers, so it captures nothing
    without = list(LocalExecutor(reuse=False).run(cells, default_registry(), lambda cell: None))
    assert len(captures) == pruned
    with_reuse = list(LocalExecutor(reuse=True).run(cells, default_registry(), lambda cell: None))
    assert len(captures) == pruned + 1
    for a, b in zip(without, with_reuse, strict=True):
        assert a.status == b.status == "ok"
        assert a.record.perplexity == b.record.perplexity
        assert a.record.calibration_ppl == b.record.calibration_ppl
        assert a.record.layers == b.record.layers
        assert a.record.parameters == b.record.parameters


def test_the_dense_model_is_one_cell_per_model_whatever_the_sizes_methods_and_ablation():
    raw_calib = {"source": "tinystories", "n_calib": [4, 8], "seqlen": 64}
    matrix = tiny_matrix(["wanda-sp", "rcpu-rot"], ratios=[0.1, 0.2], calib=raw_calib, include_dense=True,
                         ablation={"compensate": ["both", "o_proj"]})
    cells = expand(matrix, default_registry())
    dense = [cell for cell in cells if cell.ratio == 0.0]
    assert len(dense) == 1 and len(cells) == 1 + 2 * 2 * 2 * 2
