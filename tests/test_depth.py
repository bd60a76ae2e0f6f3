"""ShortGPT and ReplaceMe against direct float64 computations from hooks on a full forward pass."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_config, tiny_model, tokens

from rcpu_bench.methods.depth.layers import matched_layer_count
from rcpu_bench.methods.depth.replaceme import replaceme_transform
from rcpu_bench.methods.depth.shortgpt import block_influence
from rcpu_bench.model.adapter import decoder_layers
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model


def model_and_ids(layers: int = 6):
    config = tiny_config(layers=layers, n_kv_heads=6, intermediate=40)
    return tiny_model(config), tokens(config.vocab_size, batch=4, length=12)


def traced(model, ids):
    """Each layer's input and output, and each layer's MLP output, from one full forward pass (float64)."""
    seen: dict[str, dict[int, torch.Tensor]] = {"in": {}, "out": {}, "mlp": {}}
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        handles.append(layer.register_forward_hook(
            lambda _m, args, kwargs, out, i=i: seen["in"].__setitem__(i, (args[0] if args else kwargs[
                "hidden_states"]).double()) or seen["out"].__setitem__(i, (out[0] if isinstance(out, tuple) else
                                                                           out).double()), with_kwargs=True))
        handles.append(layer.mlp.register_forward_hook(
            lambda _m, _a, out, i=i: seen["mlp"].__setitem__(i, out.double())))
    with torch.no_grad():
        model(ids, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


def test_block_influence_is_one_minus_the_mean_token_cosine():
    model, ids = model_and_ids()
    seen = traced(model, ids)
    direct = torch.stack([1 - torch.nn.functional.cosine_similarity(seen["in"][i], seen["out"][i], dim=-1).mean()
                          for i in range(6)])
    torch.testing.assert_close(block_influence(model, ids), direct, rtol=1e-6, atol=1e-7)


def test_replaceme_transform_is_the_least_squares_map():
    model, ids = model_and_ids()
    seen = traced(model, ids)
    start, count = 2, 3
    m = seen["mlp"][start - 1].reshape(-1, 24)
    target = (seen["out"][start + count - 1] - (seen["out"][start - 1] - seen["mlp"][start - 1])).reshape(-1, 24)
    direct = torch.linalg.lstsq(m, target).solution
    torch.testing.assert_close(replaceme_transform(model, ids, start, count), direct, rtol=1e-5, atol=1e-6)


def test_the_matched_layer_count_is_what_width_pruning_removes():
    model, ids = model_and_ids()
    per_layer = sum(p.numel() for p in decoder_layers(model)[0].parameters())
    width = copy.deepcopy(model)
    before = sum(p.numel() for p in width.parameters())
    prune_model(width, ids, PruneConfig(ratio=0.3, compensator="none"), progress=False, registry=default_registry())
    removed = before - sum(p.numel() for p in width.parameters())
    count, matched = matched_layer_count(model, 0.3)
    assert matched == removed and count == round(removed / per_layer)
    with pytest.raises(ValueError, match="ratio=0.01 matches"):
        matched_layer_count(model, 0.01)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["shortgpt", "replaceme"])
def test_depth_methods_remove_the_matched_layers_and_report_both_counts(method):
    model, ids = model_and_ids()
    dense = copy.deepcopy(model)
    report = prune_model(model, ids, PruneConfig(ratio=0.3, model_method=method), progress=False,
                         registry=default_registry()).method_report
    count, width = matched_layer_count(dense, 0.3)
    assert report["n_layers_removed"] == count
    assert len(decoder_layers(model)) == model.config.num_hidden_layers == 6 - count
    assert report["width_params_matched"] == width
    per_layer = sum(p.numel() for p in decoder_layers(dense)[0].parameters())
    assert report["params_removed"] == count * per_layer
    if method == "shortgpt":
        bi = block_influence(dense, ids)
        assert report["layers_removed"] == sorted(torch.argsort(bi, stable=True)[:count].tolist())
    else:
        start = report["layers_removed"][0]
        assert report["layers_removed"] == list(range(start, start + count))
        # the merged down_proj makes layer start−1 output R + M T, what the removed run's output is fitted to
        seen = traced(dense, ids)
        m = seen["mlp"][start - 1]
        transform = replaceme_transform(dense, ids, start, count)
        expected = seen["out"][start - 1] - m + m @ transform
        after = traced(model, ids)["out"][start - 1]
        torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
