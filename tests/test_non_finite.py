"""Non-finite weights, statistics, logits and records stop the run, naming the layer and module."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import STORIES, needs_stories, tiny_config, tiny_model, tokens
from transformers import AutoTokenizer

from rcpu_bench.evaluation.generation import greedy_continuation
from rcpu_bench.evaluation.perplexity import sequence_nll
from rcpu_bench.finite import NonFiniteError, count_non_finite, finite_logits
from rcpu_bench.model.loading import load_model
from rcpu_bench.model.persistence import load_pruned, save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.records import append_record

NAN, INF = math.nan, math.inf


def poisoned(name: str, value: float, *, index: int = 0):
    """A tiny model with ``value`` written at ``index`` of the parameter called ``name``."""
    model = tiny_model(tiny_config())
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[index] = value
    return model


@pytest.mark.parametrize(("name", "value", "message"), [
    ("model.layers.1.input_layernorm.weight", NAN, r"layer 1 before pruning: the parameter input_layernorm.weight "
                                                   r"holds 1 of 24 non-finite values"),
    ("model.layers.2.self_attn.o_proj.weight", INF, "layer 2 before pruning: the parameter self_attn.o_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", -INF, "layer 0 before pruning: the parameter mlp.up_proj.weight"),
    ("model.embed_tokens.weight", NAN, "layer 0 attention: the statistics of its pruned projection's inputs"),
])
@pytest.mark.parametrize("structure", ["uniform", "al-am"])
def test_pruning_a_non_finite_model_names_layer_and_module(name, value, message, structure):
    model = poisoned(name, value, index=4 * 24 if "embed" in name else 0)  # row 4: token 4, in every batch below
    ids = torch.full((4, 16), 4)
    config = PruneConfig(ratio=0.3, structure=structure)
    with pytest.raises(NonFiniteError, match=message):
        prune_model(model, ids, config, progress=False, registry=default_registry())


@pytest.mark.parametrize(("name", "value", "message"), [
    ("model.norm.weight", NAN, "the parameter model.norm.weight holds 1 of 24"),
    ("model.layers.2.post_attention_layernorm.weight", INF, "model.layers.2.post_attention_layernorm.weight"),
    ("model.layers.0.self_attn.v_proj.weight", 1e38, "the forward pass overflowed"),  # finite weights, inf logits
])
def test_perplexity_of_a_non_finite_model_names_the_weight(name, value, message):
    model = poisoned(name, value)
    if value == 1e38:
        with torch.no_grad():
            model.model.layers[0].self_attn.v_proj.weight.fill_(1e38)
    with pytest.raises(NonFiniteError, match=message):
        sequence_nll(model, list(tokens(61, batch=3, length=12)), batch_size=2)


@needs_stories
def test_generate_on_a_non_finite_model_stops():
    loaded = load_model(str(STORIES))
    with torch.no_grad():
        loaded.model.model.norm.weight[3] = NAN
    with pytest.raises(NonFiniteError, match="generation: the parameter model.norm.weight"):
        greedy_continuation(loaded.model, loaded.tokenizer, "Once upon a time", 4)


def test_the_logits_check_is_removed_after_the_block():
    model = poisoned("model.norm.weight", NAN)
    with pytest.raises(NonFiniteError), finite_logits(model, "here"):
        model(tokens(61))
    assert not model._forward_hooks
    assert torch.isnan(model(tokens(61)).logits).all()  # outside the block the model is as it is


@needs_stories
@pytest.mark.parametrize("saved", [False, True])
def test_loading_non_finite_weights_names_the_parameter(tmp_path, saved):
    loaded = load_model(str(STORIES))
    with torch.no_grad():
        loaded.model.model.layers[3].mlp.down_proj.weight[0, 0] = NAN
    if saved:
        save_pruned(loaded.model, tmp_path / "m", tokenizer=loaded.tokenizer)
        load = lambda: load_pruned(tmp_path / "m")  # noqa: E731
    else:
        loaded.model.save_pretrained(tmp_path / "m")
        AutoTokenizer.from_pretrained(str(STORIES)).save_pretrained(tmp_path / "m")
        load = lambda: load_model(str(tmp_path / "m"))  # noqa: E731
    with pytest.raises(NonFiniteError, match=r"the parameter model.layers.3.mlp.down_proj.weight holds 1 of"):
        load()


@pytest.mark.parametrize(("record", "field"), [
    ({"perplexity": [{"ppl": NAN}]}, r"record\['perplexity'\]\[0\]\['ppl'\] = nan"),
    ({"calibration_ppl": INF}, r"record\['calibration_ppl'\] = inf"),
    ({"layers": [{"q": torch.ones(2)}]}, r"record\['layers'\]\[0\]\['q'\] is a tensor of shape \(2,\)"),
])
def test_records_are_strict_json(tmp_path, record, field):
    with pytest.raises(ValueError, match=f"not strict JSON: {field}"):
        append_record(tmp_path / "r.jsonl", record)
    assert not (tmp_path / "r.jsonl").exists() or (tmp_path / "r.jsonl").read_text() == ""


def test_a_finite_model_passes_every_check():
    model = tiny_model(tiny_config())
    dense = copy.deepcopy(model)
    prune_model(model, tokens(61, batch=4, length=16), PruneConfig(ratio=0.3), progress=False,
                registry=default_registry())
    nll, n = sequence_nll(dense, list(tokens(61, batch=3, length=12)), batch_size=2)
    assert math.isfinite(nll) and n == 3 * 11


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 24])
def test_non_finite_values_are_counted_in_any_chunk_size(chunk):
    values = torch.tensor([[1.0, NAN, 2.0], [INF, 0.0, -INF], [3.0, 4.0, NAN]])
    assert count_non_finite(values, chunk) == 4 == sum(not math.isfinite(v) for v in values.flatten().tolist())


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.floats(width=32), st.sampled_from([3e38, -3e38, 6e4, -6e4])), max_size=40),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
       chunk=st.integers(1, 50))
def test_non_finite_count_matches_an_entrywise_count(values, dtype, chunk):
    """Also where finite entries overflow the one-sum fast path (3e38 + 3e38 in float32, 6e4 + 6e4 in float16)."""
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    expected = sum(not math.isfinite(v) for v in tensor.tolist())
    assert count_non_finite(tensor, chunk) == expected
