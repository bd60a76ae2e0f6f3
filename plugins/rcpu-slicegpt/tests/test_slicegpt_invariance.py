"""With nothing sliced, fusing and rotating must not change the model's function."""

import pytest
import torch
from slicegpt_helpers import STORIES, copy_of, random_ids, tiny_llama

from rcpu_bench.evaluation.perplexity import perplexity
from rcpu_slicegpt import SlicedDecoderLayer, fuse_and_rotate


def _assert_invariant(dense, calib_ids, probe):
    expected = dense(probe).logits
    rotated = copy_of(dense)
    report = fuse_and_rotate(rotated, calib_ids, batch_size=4)
    assert report["sliced_hidden_size"] == dense.config.hidden_size
    assert all(isinstance(layer, SlicedDecoderLayer) for layer in rotated.model.layers)
    assert not torch.allclose(rotated.model.embed_tokens.weight, dense.model.embed_tokens.weight)  # really rotated
    torch.testing.assert_close(rotated(probe).logits, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_tiny_llama_is_invariant_in_float64(exact_llama_norm, n_kv_heads, tie):
    dense = tiny_llama(n_kv_heads, tie=tie).to(torch.float64)
    _assert_invariant(dense, random_ids(dense, 8, 16, seed=1), random_ids(dense, 2, 16, seed=2))


@pytest.mark.parametrize("name", STORIES)
def test_stories_is_invariant_in_float64(exact_llama_norm, stories, calib_ids, name):
    dense = copy_of(stories[name].model, torch.float64)
    _assert_invariant(dense, calib_ids, calib_ids[:2] if name == "stories260K" else random_ids(dense, 2, 32, seed=3))


def test_fused_unsliced_perplexity_equals_dense(stories, calib_ids):
    loaded = stories["stories260K"]
    dense = perplexity(loaded.model, loaded.tokenizer, "tinystories[900:950]")
    rotated = copy_of(loaded.model)
    fuse_and_rotate(rotated, calib_ids)
    fused = perplexity(rotated, loaded.tokenizer, "tinystories[900:950]")
    assert fused["n_tokens"] == dense["n_tokens"]
    assert fused["ppl"] == pytest.approx(dense["ppl"], rel=1e-5)
