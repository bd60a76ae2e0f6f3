"""Exact parameter counts, checked against hand arithmetic at Llama-7B shapes and against real sliced models."""

import pytest
import torch
from slicegpt_helpers import STORIES, copy_of
from transformers import LlamaConfig, LlamaForCausalLM

from rcpu_bench.model.loading import parameter_count
from rcpu_slicegpt import SlicePlan, slice_model, sliced_parameter_count
from rcpu_slicegpt.slicing import dim_for_parameters, sliced_dim

V, D, L, H, KV, HD, I = 32000, 4096, 32, 32, 32, 128, 11008  # noqa: E741 (I: the intermediate size)
# LLaMA-1-7B and Llama-2-7B differ only in context length and norm ε: the same parameter shapes.
SEVEN_B = {"llama-7b": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
           "llama-2-7b": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}}


@pytest.fixture(scope="module", params=list(SEVEN_B))
def llama_7b(request):
    """A weightless Llama-7B-shaped model on the meta device."""
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L,
                         num_attention_heads=H, num_key_value_heads=KV, tie_word_embeddings=False,
                         **SEVEN_B[request.param])
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def dense_count() -> int:
    """Embeddings + head V·d each; per layer 4·d² attention, 3·d·I MLP, 2·d norm weights; the final norm d."""
    return 2 * V * D + L * (4 * D * D + 3 * D * I + 2 * D) + D


def sliced_count(d: int) -> int:
    """Embeddings V·d′; per layer q/k/v d′·(H + 2·KV)·hd, o H·hd·d′, gate/up/down 3·d′·I, shortcuts 2·d′²;
    the last layer writes the full width (down_proj I·d, MLP shortcut d′·d); the head d·V; no norm weights."""
    per_layer = d * (H + 2 * KV) * HD + H * HD * d + 3 * d * I + 2 * d * d
    last_layer_extra = (D - d) * I + d * (D - d)
    return V * d + L * per_layer + last_layer_extra + D * V


# docs/methods.md §8: Llama-2-7B parameters removed at each hidden sparsity (negative: the model grows).
SPEC_TABLE = [(0.10, 3680, -3.0), (0.20, 3272, 9.4), (0.25, 3072, 15.3), (0.30, 2864, 21.4)]


@pytest.mark.parametrize("sparsity, dim, removed_percent", SPEC_TABLE)
def test_llama_7b_counts_match_hand_arithmetic_and_the_spec_table(llama_7b, sparsity, dim, removed_percent):
    assert parameter_count(llama_7b) == dense_count() == 6_738_415_616
    assert sliced_dim(D, sparsity) == dim
    count = sliced_parameter_count(llama_7b, SlicePlan.uniform(D, dim, L))
    assert count == sliced_count(dim)
    removed = 100 * (1 - count / dense_count())
    assert abs(removed - removed_percent) < 0.06
    # The table's one-decimal figures are those of a count that still holds the 2·L + 1 RMSNorm weight
    # vectors (21.448 % at s = 0.3); here they are folded into the linears (21.452 %, which rounds to 21.5).
    assert round(100 * (1 - (count + (2 * L + 1) * D) / dense_count()), 1) == removed_percent


def test_llama_7b_sliced_head_counts(llama_7b):
    """With the head sliced too: every layer d′-wide, head d′·V."""
    dim = 3072
    per_layer = dim * (H + 2 * KV) * HD + H * HD * dim + 3 * dim * I + 2 * dim * dim
    expected = V * dim + L * per_layer + dim * V
    assert sliced_parameter_count(llama_7b, SlicePlan.uniform(D, dim, L, slice_head=True)) == expected


@pytest.mark.parametrize("removed", [0.1, 0.2, 0.3])
def test_parameter_budget_picks_the_largest_fitting_multiple_of_8(llama_7b, removed):
    target = int((1 - removed) * dense_count())
    dim = dim_for_parameters(llama_7b, target)
    assert dim % 8 == 0
    assert sliced_count(dim) <= target < sliced_count(dim + 8)


def test_unreachable_budget_is_rejected(llama_7b):
    with pytest.raises(ValueError, match="unreachable.*d′=8"):
        dim_for_parameters(llama_7b, sliced_count(8) - 1)


@pytest.mark.parametrize("slice_head", [False, True])
@pytest.mark.parametrize("name", STORIES)
def test_real_sliced_models_have_the_counted_parameters(stories, calib_ids, name, slice_head):
    """stories260K: V=512, d=64, 5 layers, 8 heads of 8 (4 or 8 kv heads), I=172, tied embeddings in the dense model."""
    dense = stories[name].model
    kv = dense.config.num_key_value_heads
    dim = 40
    per_layer = dim * (8 + 2 * kv) * 8 + 64 * dim + 3 * dim * 172 + 2 * dim * dim
    head_in = dim if slice_head else 64
    last_layer_extra = (head_in - dim) * 172 + dim * (head_in - dim)
    expected = 512 * dim + 5 * per_layer + last_layer_extra + head_in * 512
    model = copy_of(dense)
    report = slice_model(model, calib_ids, sparsity=0.375, slice_head=slice_head)
    assert parameter_count(model) == report["parameters"]["sliced"] == expected
    assert sliced_parameter_count(dense, SlicePlan.uniform(64, dim, 5, slice_head=slice_head)) == expected
