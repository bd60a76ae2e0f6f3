"""Model loading, architecture checks, per-layer geometry and parameter counting."""

from types import SimpleNamespace

import pytest
import torch
from tiny_models import STORIES, STORIES_MHA, needs_stories, tiny_config, tiny_model
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    ViTConfig,
)

from rcpu_bench.model.adapter import check_architecture, decoder_layers, layer_geometries, layer_geometry
from rcpu_bench.model.llama import config_head_dim
from rcpu_bench.model.loading import load_model, model_source, parameter_count, resolve_device, resolve_dtype
from rcpu_bench.model.views import LayerGeometry

LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32)


def meta_model(model_class, config):
    with torch.device("meta"):
        return model_class(config)


# --- parameter counts ---------------------------------------------------------------------------

def test_parameter_count_by_hand_tied_untied_and_biases():
    # vocab 61, hidden 24, 6 query heads, 3 kv heads, head_dim 6, MLP 20, 3 layers.
    embed = 61 * 24                                        # 1464
    attention = 24 * 6 * 6 + 2 * (24 * 3 * 6) + 6 * 6 * 24  # q 864 + k,v 2·432 + o 864 = 2592
    mlp = 3 * 24 * 20                                      # 1440
    norms = 2 * 24                                         # input + post-attention RMSNorm
    body = 3 * (attention + mlp + norms) + 24              # 3 layers + final norm = 12264
    assert parameter_count(tiny_model(tiny_config(tie=True))) == embed + body == 13728
    assert parameter_count(tiny_model(tiny_config(tie=False))) == 2 * embed + body == 15192
    biases = 3 * ((36 + 18 + 18 + 24) + (20 + 20 + 24))    # q,k,v,o biases; gate,up,down biases
    model = tiny_model(tiny_config(attention_bias=True, mlp_bias=True))
    assert parameter_count(model) == 13728 + biases == 14208


def test_parameter_count_llama_7b_on_meta():
    model = meta_model(LlamaForCausalLM, LlamaConfig(**LLAMA_7B))
    assert parameter_count(model) == 6_738_415_616


def test_tied_embeddings_counted_once():
    model = tiny_model(tiny_config(tie=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert parameter_count(model) == sum(p.numel() for _, p in model.named_parameters(remove_duplicate=True))
    assert parameter_count(model) < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


# --- geometry -----------------------------------------------------------------------------------

def test_geometry_reads_current_shapes_and_config_head_dim():
    model = tiny_model(tiny_config(n_heads=6, n_kv_heads=3, head_dim=6, hidden=24, intermediate=20))
    assert config_head_dim(model.config) == 6  # not hidden // heads = 4
    assert layer_geometries(model) == [LayerGeometry(6, 3, 6, 20)] * 3
    layer = model.model.layers[1]
    layer.self_attn.q_proj = nn.Linear(24, 2 * 6, bias=False)
    layer.self_attn.k_proj = nn.Linear(24, 1 * 6, bias=False)
    layer.mlp.gate_proj = nn.Linear(24, 7, bias=False)
    assert layer_geometries(model)[1] == layer_geometry(layer) == LayerGeometry(2, 1, 6, 7)


def test_config_head_dim_falls_back_to_hidden_over_heads():
    assert config_head_dim(SimpleNamespace(hidden_size=64, num_attention_heads=8)) == 8
    assert config_head_dim(SimpleNamespace(hidden_size=64, num_attention_heads=8, head_dim=None)) == 8
    assert config_head_dim(SimpleNamespace(hidden_size=64, num_attention_heads=8, head_dim=16)) == 16


def test_geometry_rejects_rows_not_a_multiple_of_head_dim():
    layer = tiny_model(tiny_config()).model.layers[0]
    layer.self_attn.q_proj = nn.Linear(24, 10, bias=False)
    with pytest.raises(ValueError, match="query projection has 10 output rows, not a multiple of head_dim=6"):
        layer_geometry(layer)


# --- architecture -------------------------------------------------------------------------------

@pytest.mark.parametrize("model_class, config_class", [(LlamaForCausalLM, LlamaConfig),
                                                       (MistralForCausalLM, MistralConfig),
                                                       (Qwen2ForCausalLM, Qwen2Config)])
def test_llama_shaped_architectures_are_accepted(model_class, config_class):
    config = config_class(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = meta_model(model_class, config)
    check_architecture(model)
    assert len(decoder_layers(model)) == 3
    assert layer_geometries(model) == [LayerGeometry(4, 2, 8, 24)] * 3


def test_other_architectures_are_rejected_with_what_is_supported():
    gpt2 = meta_model(GPT2LMHeadModel, GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel.*supported: Llama \(llama"):
        check_architecture(gpt2)


def test_missing_projection_is_named():
    model = tiny_model(tiny_config())
    del model.model.layers[2].mlp.up_proj
    with pytest.raises(ValueError, match=r"layer 2: no nn.Linear mlp.up_proj"):
        decoder_layers(model)


# --- loading ------------------------------------------------------------------------------------

@needs_stories
def test_load_model_stories_fp32_with_provenance_and_tokenizer():
    loaded = load_model(str(STORIES))
    model = loaded.model
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert layer_geometries(model) == [LayerGeometry(8, 4, 8, 172)] * 5
    assert parameter_count(model) == 260_032
    assert loaded.tokenizer("Once upon a time").input_ids[0] == model.config.bos_token_id
    prov = loaded.provenance
    assert prov["name_or_path"] == str(STORIES) and prov["dtype"] == "float32" and prov["device"] == "cpu"
    assert prov["config_class"] == "LlamaConfig" and prov["model_class"] == "LlamaForCausalLM"
    assert prov["commit_hash"] is None  # a local directory has no Hub commit


@needs_stories
def test_load_model_gives_float32_for_a_bfloat16_checkpoint(tmp_path):
    loaded = load_model(str(STORIES_MHA))
    loaded.model.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded.tokenizer.save_pretrained(tmp_path)
    assert {p.dtype for p in load_model(str(tmp_path)).model.parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(str(tmp_path), dtype="float64").model.parameters()} == {torch.float64}


def test_missing_local_path_raises_file_not_found(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="./models/absent"):
        load_model("./models/absent")


def test_hub_ids_are_passed_to_the_hub_and_paths_are_resolved(tmp_path):
    assert model_source("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert model_source(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("config, named", [
    (GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32), "GPT2LMHeadModel"),  # a causal LM of another shape
    (ViTConfig(), "ViTConfig: no causal-LM model"),                                  # not a causal LM at all
])
def test_unsupported_architecture_is_rejected_before_reading_weights(tmp_path, config, named):
    config.save_pretrained(tmp_path)  # config only: no weights, no tokenizer
    with pytest.raises(ValueError, match=f"unsupported architecture {named}.*supported: Llama \\(llama"):
        load_model(str(tmp_path))


def test_dtype_and_device_strings_are_validated():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"unknown dtype 'fp32'; allowed: float32, float64, bfloat16, float16"):
        load_model(str(STORIES), dtype="fp32")
    with pytest.raises(ValueError, match=r"unknown device 'gpu'; allowed: cpu, cuda, cuda:<index>"):
        load_model(str(STORIES), device="gpu")
