"""GGUF export (rcpu_bench.export.gguf): the RoPE row permutation, the file's keys and tensors read back with
the gguf library's reader, the tokenizer's scores, and the refusals. (Running the file in llama.cpp:
test_gguf_llama_cpp.py.)"""

import numpy as np
import pytest
import torch
from tiny_models import STORIES, apply_plan, needs_stories, random_plan, tiny_config, tiny_model
from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rcpu_bench.export.gguf import export_gguf, gguf_name, rope_interleave
from rcpu_bench.export.gguf_vocab import merge_scores

gguf = pytest.importorskip("gguf")


def stories_tokenizer():
    return AutoTokenizer.from_pretrained(STORIES)


def pruned_tiny(bias=True, seed=3):
    """A tiny GQA Llama (vocab of the stories tokenizer) with different widths per layer and o/down biases."""
    model = tiny_model(tiny_config(vocab=512, tie=False), seed=seed)
    return apply_plan(model, random_plan(model, bias=bias, seed=seed))


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def interleaved_rope(x, positions, theta):
    """llama.cpp's NORM RoPE, float64: rotate the pairs (x_2j, x_2j+1) of each head by pos·θ^(-2j/d)."""
    d = x.shape[-1]
    angle = positions[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # (seq, d/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * angle.cos() - odd * angle.sin()
    out[..., 1::2] = even * angle.sin() + odd * angle.cos()
    return out


def test_rope_interleave_turns_hugging_face_rope_into_llama_cpp_rope():
    config = tiny_config()
    heads, d, seq = config.num_attention_heads, config.head_dim, 7
    weight = torch.randn(heads * d, config.hidden_size, dtype=torch.float64)
    x = torch.randn(seq, config.hidden_size, dtype=torch.float64)
    positions = torch.arange(seq)
    cos, sin = LlamaRotaryEmbedding(config)(x[None].float(), positions[None])
    q = (x @ weight.T).reshape(seq, heads, d).transpose(0, 1)[None]  # (1, heads, seq, d)
    hf, _ = apply_rotary_pos_emb(q, q, cos.double(), sin.double())
    permuted = (x @ rope_interleave(weight, heads).T).reshape(seq, heads, d).transpose(0, 1)
    ours = interleaved_rope(permuted, positions, config.rope_parameters["rope_theta"])
    # The same rotated vectors up to the same permutation of each head's entries:
    expected = rope_interleave(hf[0].transpose(0, 1).reshape(seq, heads * d).T, heads).T
    torch.testing.assert_close(ours.transpose(0, 1).reshape(seq, heads * d), expected, atol=1e-6, rtol=1e-6)


def test_tensor_names():
    assert gguf_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    with pytest.raises(ValueError, match="no place in llama.cpp"):
        gguf_name("model.layers.0.self_attn.q_norm.weight")


def test_merge_scores_rank_the_first_merge_of_each_token():
    assert merge_scores(["a b", ["ab", "c"], "a bc", "x y"]) == {"ab": 0.0, "abc": -1.0, "xy": -3.0}


@needs_stories
@pytest.mark.parametrize("dtype, tolerance", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3),
                                              ("q8_0", 1e-2)])
def test_per_layer_widths_keys_and_tensors_read_back(tmp_path, dtype, tolerance):
    q8_0_shaped = tiny_config(vocab=512, hidden=64, head_dim=16, n_heads=4, n_kv_heads=2, intermediate=96, tie=False)
    model = tiny_model(q8_0_shaped) if dtype == "q8_0" else pruned_tiny()
    path = tmp_path / "m.gguf"
    summary = export_gguf(model, stories_tokenizer(), path, dtype=dtype)
    fields, tensors = read(path)
    layers = model.model.layers
    heads = [layer.self_attn.q_proj.out_features // layer.self_attn.head_dim for layer in layers]
    kv_heads = [layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in layers]
    channels = [layer.mlp.gate_proj.out_features for layer in layers]
    arch = "deci" if len(set(zip(heads, kv_heads, channels))) > 1 else "llama"
    assert fields["general.architecture"] == arch == summary["architecture"]
    uniform = arch == "llama"
    assert fields[f"{arch}.attention.head_count"] == (heads[0] if uniform else heads)
    assert fields[f"{arch}.attention.head_count_kv"] == (kv_heads[0] if uniform else kv_heads)
    assert fields[f"{arch}.feed_forward_length"] == (channels[0] if uniform else channels)
    assert fields[f"{arch}.attention.key_length"] == model.config.head_dim
    assert len(fields["tokenizer.ggml.tokens"]) == 512 and fields["tokenizer.ggml.model"] == "llama"
    state = model.state_dict()
    for i, layer in enumerate(layers):
        q = rope_interleave(state[f"model.layers.{i}.self_attn.q_proj.weight"], heads[i])
        for name, expected in (("attn_q.weight", q), ("attn_output.weight", layer.self_attn.o_proj.weight),
                               ("ffn_down.weight", layer.mlp.down_proj.weight)):
            tensor = tensors[f"blk.{i}.{name}"]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(expected.shape)
            scale = expected.abs().max().item()
            np.testing.assert_allclose(values, expected.detach().numpy(), atol=tolerance * scale, rtol=0)
        if layer.self_attn.o_proj.bias is not None:  # 1-D tensors stay float32
            np.testing.assert_array_equal(tensors[f"blk.{i}.attn_output.bias"].data,
                                          layer.self_attn.o_proj.bias.detach().numpy())
    assert "output.weight" in tensors  # untied head (tie=False)


@needs_stories
def test_tied_head_is_left_to_llama_cpp(tmp_path):
    model = tiny_model(tiny_config(vocab=512, tie=True))
    export_gguf(model, stories_tokenizer(), tmp_path / "m.gguf", dtype="float32")
    _, tensors = read(tmp_path / "m.gguf")
    assert "token_embd.weight" in tensors and "output.weight" not in tensors


@needs_stories
def test_stories_vocabulary_types_and_padding(tmp_path):
    model = tiny_model(tiny_config(vocab=600))
    export_gguf(model, stories_tokenizer(), tmp_path / "m.gguf", dtype="float32")
    fields, _ = read(tmp_path / "m.gguf")
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [2, 3, 3]
    assert tokens[3] == "<0x00>" and types[3] == 6
    assert tokens[599] == "[PAD599]" and types[599] == 5
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False


def rope_scaled():
    config = tiny_config(vocab=512)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    return tiny_model(config)


@needs_stories
@pytest.mark.parametrize("make, dtype, message", [
    (lambda: MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=16, intermediate_size=8,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
     "float16", "model type 'mistral' is not exported"),
    (rope_scaled, "float16", "RoPE scaling 'linear'"),
    (lambda: pruned_tiny(), "q8_0", "q8_0 needs rows of a multiple of 32"),
    (lambda: pruned_tiny(), "float8", "GGUF dtype 'float8'; allowed"),
])
def test_refusals_write_nothing(tmp_path, make, dtype, message):
    with pytest.raises(ValueError, match=message):
        export_gguf(make(), stories_tokenizer(), tmp_path / "m.gguf", dtype=dtype)
    assert list(tmp_path.iterdir()) == []


def test_no_tokenizer_and_existing_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        export_gguf(tiny_model(tiny_config()), None, tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        export_gguf(tiny_model(tiny_config()), None, tmp_path / "m.gguf")


@needs_stories
def test_export_command_writes_and_refuses(tmp_path, capsys):
    from rcpu_bench.cli import main

    out = tmp_path / "dense.gguf"
    assert main(["export", "--format", "gguf", "--outtype", "bfloat16", str(STORIES), str(out)]) == 0
    assert f"wrote {out} (llama architecture, bfloat16" in capsys.readouterr().out
    assert main(["export", "--format", "gguf", str(STORIES), str(out)]) == 2
    assert "already exists; allowed: a new path, or --overwrite to replace it" in capsys.readouterr().err
    assert main(["export", "--format", "gguf", str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["prune", "--model", str(STORIES), "--export-gguf", str(tmp_path / "p.gguf")]) == 2
    assert "--export-gguf needs --save DIR" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.gguf"]


@needs_stories
@pytest.mark.parametrize("dtype, amx, refused", [("q8_0", True, True), ("float16", True, False),
                                                 ("q8_0", False, False)])
def test_a_quantized_file_is_refused_on_a_llama_cpp_build_with_amx_kernels(tmp_path, dtype, amx, refused):
    """llama.cpp's AMX kernels (a native build on a Xeon with AMX) take only quantized matrices and crash the
    process on them: such a file on such a build is a named refusal before llama.cpp loads it."""
    from rcpu_bench.evaluation.speed_llama_cpp import check_no_amx_quantized

    config = tiny_config(vocab=512, hidden=64, head_dim=16, n_heads=4, n_kv_heads=2, intermediate=96, tie=False)
    export_gguf(tiny_model(config), stories_tokenizer(), tmp_path / "m.gguf", dtype=dtype)
    system_info = "CPU : SSE3 = 1 | AVX2 = 1 | " + ("AMX_INT8 = 1 | " if amx else "") + "OPENMP = 1 | "
    if refused:
        with pytest.raises(RuntimeError, match=r"\(Q8_0\).*AMX.*--no-cache-dir --force-reinstall"):
            check_no_amx_quantized(system_info, tmp_path / "m.gguf")
    else:
        check_no_amx_quantized(system_info, tmp_path / "m.gguf")
