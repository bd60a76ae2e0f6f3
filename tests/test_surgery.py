"""Physical head/channel removal against same-shape masking, generation, GQA rules and bad selections."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import (
    apply_plan,
    logits,
    needs_stories,
    random_plan,
    tiny_config,
    tiny_model,
    tokens,
)
from transformers import LlamaConfig, LlamaForCausalLM

from rcpu_bench.model.adapter import layer_geometries, layer_geometry
from rcpu_bench.model.llama import mask_attention, mask_mlp, prune_attention, prune_mlp
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.model.surgery import check_head_groups
from rcpu_bench.model.views import LayerGeometry

TINY = {"mha": dict(n_heads=4, n_kv_heads=4), "gqa": dict(n_heads=6, n_kv_heads=3)}
CASES = [("mha", "groups"), ("gqa", "groups"), ("gqa", "within")]


def pruned_and_masked(model, plan):
    """Deep copies of ``model``: one physically pruned by ``plan``, one masked by it."""
    return apply_plan(copy.deepcopy(model), plan), apply_plan(copy.deepcopy(model), plan, physical=False)


def head_rows(heads, head_dim):
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads.tolist()])


@pytest.fixture
def stories(stories_260k):
    return {kind: loaded.model for kind, loaded in stories_260k.items()}


# --- equivalences -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_ratio_zero_prune_with_original_weights_is_bit_identical(kind):
    model = tiny_model(tiny_config(**TINY[kind]))
    ids = tokens(model.config.vocab_size)
    before, params_before = logits(model, ids), parameter_count(model)
    for layer, geo in zip(model.model.layers, layer_geometries(model)):
        prune_attention(layer.self_attn, torch.arange(geo.n_heads), torch.arange(geo.n_kv_heads),
                        layer.self_attn.o_proj.weight.detach().clone())
        prune_mlp(layer.mlp, torch.arange(geo.intermediate), layer.mlp.down_proj.weight.detach().clone())
    assert torch.equal(logits(model, ids), before)
    assert parameter_count(model) == params_before


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind, rule", CASES)
def test_pruned_equals_masked_on_tiny_models(kind, rule, bias, attn):
    model = tiny_model(tiny_config(**TINY[kind]), attn=attn)
    plan = random_plan(model, rule=rule, bias=bias, seed=len(kind) + len(rule))
    pruned, masked = pruned_and_masked(model, plan)
    counts = [(g.n_heads, g.intermediate) for g in layer_geometries(pruned)]
    assert len(set(counts)) == len(counts), "layers should differ in kept counts"
    ids = tokens(model.config.vocab_size)
    expected = logits(masked, ids)
    assert not torch.allclose(expected, logits(model, ids), atol=1e-2)  # pruning changed the function
    torch.testing.assert_close(logits(pruned, ids), expected, atol=1e-5, rtol=0)


@needs_stories
@pytest.mark.parametrize("kind, rule", CASES)
def test_pruned_equals_masked_on_stories260k(stories, kind, rule):
    model = stories[kind]
    for seed in range(2):
        pruned, masked = pruned_and_masked(model, random_plan(model, rule=rule, bias=seed == 1, seed=seed))
        ids = tokens(model.config.vocab_size, length=16, seed=seed)
        torch.testing.assert_close(logits(pruned, ids), logits(masked, ids), atol=1e-5, rtol=0)


@needs_stories
def test_stories_mha_and_gqa_stay_equivalent_under_group_pruning(stories):
    """stories260K-mha repeats each kv head for its 2 query heads: pruning the same query heads (whole
    groups in the GQA model) must give the same function in both."""
    gqa, mha = (copy.deepcopy(stories[k]) for k in ("gqa", "mha"))
    ids = tokens(512, length=16)
    torch.testing.assert_close(logits(gqa, ids), logits(mha, ids), atol=1e-5, rtol=0)
    plan = random_plan(gqa, rule="groups", seed=3)
    apply_plan(gqa, plan)
    for layer, p in zip(mha.model.layers, plan):
        prune_attention(layer.self_attn, p.heads, p.heads, p.o_weight, p.o_bias)
        prune_mlp(layer.mlp, p.channels, p.down_weight, p.down_bias)
    torch.testing.assert_close(logits(gqa, ids), logits(mha, ids), atol=1e-5, rtol=0)


def pruned_tiny(attn="eager", rule="groups"):
    model = tiny_model(tiny_config(), attn=attn)
    return apply_plan(model, random_plan(model, rule=rule, bias=True, seed=7))


@pytest.mark.parametrize("rule", ["groups", "within"])
def test_eager_and_sdpa_agree_after_pruning(rule):
    model = pruned_tiny(rule=rule)
    ids = tokens(model.config.vocab_size)
    eager = logits(model, ids)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits(model, ids), eager, atol=1e-5, rtol=0)


def generate(model, ids, use_cache):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          use_cache=use_cache, pad_token_id=model.config.pad_token_id or 0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("rule", ["groups", "within"])
def test_generate_with_kv_cache_equals_without(attn, rule):
    model = pruned_tiny(attn, rule)
    ids = tokens(model.config.vocab_size, length=5)
    cached = generate(model, ids, use_cache=True)
    assert cached.shape == (2, 5 + 12)
    assert torch.equal(cached, generate(model, ids, use_cache=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_surgery_on_cuda_keeps_the_device():
    model = tiny_model(tiny_config()).to("cuda")
    pruned, masked = pruned_and_masked(model, random_plan(model, rule="within", bias=True))  # CPU weights
    assert {p.device.type for p in pruned.parameters()} == {"cuda"}
    ids = tokens(model.config.vocab_size).to("cuda")
    torch.testing.assert_close(logits(pruned, ids), logits(masked, ids), atol=1e-5, rtol=0)
    assert torch.equal(generate(pruned, ids, use_cache=True), generate(pruned, ids, use_cache=False))


@pytest.mark.slow
@needs_stories
def test_generate_on_pruned_stories(stories):
    model = copy.deepcopy(stories["gqa"])
    apply_plan(model, random_plan(model, rule="within", seed=1))
    ids = tokens(512, length=6)
    assert torch.equal(generate(model, ids, use_cache=True), generate(model, ids, use_cache=False))


# --- what the surgery does to each module -------------------------------------------------------

def test_prune_attention_keeps_the_selected_rows_and_updates_groups():
    model = tiny_model(tiny_config(n_heads=6, n_kv_heads=3, head_dim=6))
    attn = model.model.layers[0].self_attn
    q, k, v = (getattr(attn, n).weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj"))
    heads, kv_heads = torch.tensor([0, 1, 4, 5]), torch.tensor([0, 2])  # groups of 2: kv 0 -> q 0,1; kv 2 -> q 4,5
    o_weight = torch.randn(24, 4 * 6)
    prune_attention(attn, heads, kv_heads, o_weight)
    assert torch.equal(attn.q_proj.weight, q[head_rows(heads, 6)])
    assert torch.equal(attn.k_proj.weight, k[head_rows(kv_heads, 6)])
    assert torch.equal(attn.v_proj.weight, v[head_rows(kv_heads, 6)])
    assert torch.equal(attn.o_proj.weight, o_weight) and attn.o_proj.weight.data_ptr() != o_weight.data_ptr()
    assert (attn.o_proj.in_features, attn.o_proj.out_features, attn.q_proj.out_features) == (24, 24, 24)
    assert attn.num_key_value_groups == 2 and attn.o_proj.bias is None
    assert layer_geometries(model)[0] == LayerGeometry(4, 2, 6, 20)


def test_rule_b_keeps_kv_heads_and_halves_the_group():
    model = tiny_model(tiny_config(n_heads=6, n_kv_heads=3, head_dim=6))
    attn = model.model.layers[0].self_attn
    prune_attention(attn, torch.tensor([1, 2, 4]), torch.arange(3), torch.randn(24, 18))
    assert attn.num_key_value_groups == 1
    assert layer_geometries(model)[0] == LayerGeometry(3, 3, 6, 20)
    # and a pruned module can be pruned again, from its current shape
    prune_attention(attn, torch.tensor([0, 2]), torch.tensor([0, 2]), torch.randn(24, 12))
    assert layer_geometries(model)[0] == LayerGeometry(2, 2, 6, 20)
    model(tokens(61))


def test_mask_attention_zeroes_pruned_rows_and_writes_kept_columns():
    model = tiny_model(tiny_config(n_heads=6, n_kv_heads=3, head_dim=6))
    attn = model.model.layers[0].self_attn
    k = attn.k_proj.weight.detach().clone()
    o_weight, o_bias = torch.randn(24, 12), torch.randn(24)
    mask_attention(attn, torch.tensor([2, 3]), torch.tensor([1]), o_weight, o_bias)
    assert attn.q_proj.weight.shape == (36, 24) and attn.o_proj.weight.shape == (24, 36)
    kept = head_rows(torch.tensor([2, 3]), 6)
    pruned = torch.tensor([i for i in range(36) if i not in kept.tolist()])
    assert torch.equal(attn.o_proj.weight[:, kept], o_weight)
    assert not attn.o_proj.weight[:, pruned].any() and not attn.q_proj.weight[pruned].any()
    assert torch.equal(attn.k_proj.weight[6:12], k[6:12]) and not attn.k_proj.weight[:6].any()
    assert torch.equal(attn.o_proj.bias, o_bias) and attn.num_key_value_groups == 2


def test_mlp_prune_and_mask():
    model = tiny_model(tiny_config(intermediate=20, mlp_bias=True))
    mlp, masked = model.model.layers[0].mlp, copy.deepcopy(model.model.layers[0].mlp)
    gate, up_bias = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.bias.detach().clone()
    down_bias = mlp.down_proj.bias
    g = torch.Generator().manual_seed(0)  # the global RNG is unseeded: a fixed draw keeps the tolerance meaningful
    kept, down_weight = torch.tensor([0, 3, 7, 19]), torch.randn(24, 4, generator=g)
    prune_mlp(mlp, kept, down_weight)
    mask_mlp(masked, kept, down_weight)
    assert torch.equal(mlp.gate_proj.weight, gate[kept]) and torch.equal(mlp.up_proj.bias, up_bias[kept])
    assert mlp.down_proj.weight.shape == (24, 4) and mlp.down_proj.bias is down_bias  # existing bias untouched
    assert mlp.intermediate_size == 4 and masked.down_proj.weight.shape == (24, 20)
    assert torch.equal(masked.down_proj.weight[:, kept], down_weight) and masked.down_proj.weight.count_nonzero() == 96
    x = torch.randn(3, 24, generator=g)
    torch.testing.assert_close(mlp(x), masked(x), atol=1e-6, rtol=0)


def test_bias_is_added_when_absent_and_replaced_when_given():
    attn = tiny_model(tiny_config()).model.layers[0].self_attn
    assert attn.o_proj.bias is None
    bias = torch.randn(24)
    prune_attention(attn, torch.arange(6), torch.arange(3), attn.o_proj.weight.detach().clone(), bias)
    assert torch.equal(attn.o_proj.bias, bias)
    biased = tiny_model(tiny_config(attention_bias=True)).model.layers[0].self_attn
    existing = biased.o_proj.bias
    prune_attention(biased, torch.tensor([0, 1]), torch.tensor([0]), torch.randn(24, 12))
    assert biased.o_proj.bias is existing and biased.q_proj.bias.shape == (12,) and biased.k_proj.bias.shape == (6,)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_and_device_are_preserved(dtype):
    model = tiny_model(tiny_config()).to(dtype)
    apply_plan(model, random_plan(model, bias=True))  # float32 compensated weights and biases
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    with torch.device("meta"):
        meta = LlamaForCausalLM(tiny_config())
    apply_plan(meta, random_plan(meta, bias=True))
    assert {p.device.type for p in meta.parameters()} == {"meta"}


# --- bad selections -----------------------------------------------------------------------------

LONG = lambda *values: torch.tensor(values, dtype=torch.long)  # noqa: E731
BAD_HEADS = [
    (LONG(), LONG(0), "kept_heads is empty"),
    (LONG(0, 1), LONG(), "kept_kv_heads is empty"),
    (LONG(1, 0), LONG(0), "strictly increasing"),
    (LONG(0, 0), LONG(0), "strictly increasing"),
    (LONG(0, 6), LONG(0, 2), r"out of range; allowed: 0 … 5"),
    (torch.tensor([0.0, 1.0]), LONG(0), "1-D integer tensor"),
    (LONG(0, 1)[None], LONG(0), "1-D integer tensor"),
    (LONG(0, 1, 2), LONG(0, 1), "cannot be shared equally"),
    (LONG(0, 2), LONG(0), r"do not match kept kv heads \[0\]"),  # head 2 belongs to kv head 1
    (LONG(0, 1, 2), LONG(0, 1, 2), "do not match"),              # rule (b) with unequal group sizes
    (LONG(0, 1), LONG(0, 1), "do not match"),                    # kv head 1 would serve no query head
]


@pytest.mark.parametrize("heads, kv_heads, message", BAD_HEADS)
def test_bad_head_selections_raise_and_change_nothing(heads, kv_heads, message):
    attn = tiny_model(tiny_config(n_heads=6, n_kv_heads=3)).model.layers[0].self_attn
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        prune_attention(attn, heads, kv_heads, torch.randn(24, 12))
    assert all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


def test_bad_weight_shapes_raise_before_anything_changes():
    layer = tiny_model(tiny_config()).model.layers[0]
    with pytest.raises(ValueError, match=r"shape \(24, 11\); expected \(24, 12\)"):
        prune_attention(layer.self_attn, torch.tensor([0, 1]), torch.tensor([0]), torch.randn(24, 11))
    with pytest.raises(ValueError, match=r"bias has shape \(23,\); expected \(24,\)"):
        mask_mlp(layer.mlp, torch.tensor([1]), torch.randn(24, 1), torch.randn(23))
    with pytest.raises(ValueError, match=r"kept channels \[20\] is out of range; allowed: 0 … 19"):
        prune_mlp(layer.mlp, torch.tensor([20]), torch.randn(24, 1))
    assert layer_geometry(layer) == LayerGeometry(6, 3, 6, 20)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_head_group_check_matches_a_brute_force_rule(n_kv, groups, data):
    """Accepted iff every kept query head's kv head is kept and every kept kv head serves the same
    number of kept query heads."""
    heads = sorted(data.draw(st.sets(st.integers(0, n_kv * groups - 1), min_size=1)))
    kv_heads = sorted(data.draw(st.sets(st.integers(0, n_kv - 1), min_size=1)))
    served = [sum(h // groups == g for h in heads) for g in kv_heads]
    valid = all(h // groups in kv_heads for h in heads) and len(set(served)) == 1
    if valid:
        assert check_head_groups(torch.tensor(heads), torch.tensor(kv_heads), groups) == served[0]
    else:
        with pytest.raises(ValueError):
            check_head_groups(torch.tensor(heads), torch.tensor(kv_heads), groups)


# --- the paper's parameter counts ---------------------------------------------------------------

@pytest.mark.parametrize("heads, channels, expected, paper", [(3, 1100, 6_104_551_424, "6.10"),
                                                              (6, 2201, 5_470_294_016, "5.47"),
                                                              (9, 3302, 4_836_036_608, "4.84")])
def test_llama_7b_pruned_parameter_counts(heads, channels, expected, paper):
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        kept = torch.arange(heads, 32)
        prune_attention(layer.self_attn, kept, kept, torch.empty(4096, len(kept) * 128, device="meta"))
        prune_mlp(layer.mlp, torch.arange(channels, 11008), torch.empty(4096, 11008 - channels, device="meta"))
    # each layer loses 4·4096·128 per head (q, k, v rows, o columns) and 3·4096 per channel (gate, up, down)
    assert expected == 6_738_415_616 - 32 * (heads * 4 * 4096 * 128 + channels * 3 * 4096)
    assert parameter_count(model) == expected
    assert f"{parameter_count(model) / 1e9:.2f}" == paper


def test_pruned_parameter_count_by_hand():
    model = tiny_model(tiny_config())  # hidden 24, head_dim 6, 6 heads / 3 kv heads, MLP 20: 13728 parameters
    layer = model.model.layers[0]
    prune_attention(layer.self_attn, torch.tensor([2, 3]), torch.tensor([1]), torch.randn(24, 12), torch.randn(24))
    prune_mlp(layer.mlp, torch.arange(5), torch.randn(24, 5))
    removed = 4 * 6 * 24 + 2 * 2 * 6 * 24 + 4 * 6 * 24  # q rows and o columns of 4 heads, k and v rows of 2 kv heads
    removed += 15 * 3 * 24                               # 15 channels of gate, up, down
    assert parameter_count(model) == 13728 - removed + 24  # + the new o_proj bias
