"""Exported GGUF files run in llama.cpp (llama-cpp-python) as the model runs in transformers: per-token logits
within a stated tolerance, the same greedy continuation, the same tokens, for a dense model, a uniformly
pruned one and an AL-AM one (per-layer widths: llama.cpp's ``deci`` graph), with biases. Skipped without
llama_cpp (``pip install 'rcpu-bench[gguf]'``; ``make test`` installs it)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_matrices import tiny_matrix
from tiny_models import STORIES, STORIES_MHA, apply_plan, needs_stories, random_plan, tiny_config, tiny_model
from transformers import AutoTokenizer

from rcpu_bench.commands.export import export_model
from rcpu_bench.evaluation.speed import NEW_TOKENS as SPEED_NEW_TOKENS
from rcpu_bench.evaluation.speed import PROMPT_TOKENS
from rcpu_bench.evaluation.speed_llama_cpp import greedy_token, llama_cpp_speed, load_gguf
from rcpu_bench.export.gguf import export_gguf
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.store import Store, read_results
from rcpu_bench.model.loading import load_model
from rcpu_bench.model.persistence import load_saved, save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.tables.layout import build_tables, spec

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

PROMPT = "Once upon a time, there was a little girl named Lily. She"
NEW_TOKENS = 16
# |logit_llama.cpp − logit_transformers| ≤ TOLERANCE[outtype] · max |logit_transformers| over the prompt:
# float32 (with a float32 KV cache) differs only by summation order; float16 rounds the weights and llama.cpp's
# matmul inputs to 11 bits.
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    llm = load_gguf(path, n_ctx=64, threads=1, logits_all=True, float32_cache=True)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def llama_cpp_greedy(path, ids: list[int], new_tokens: int) -> list[int]:
    llm = load_gguf(path, n_ctx=64, threads=1, float32_cache=True)
    llm.eval(ids)
    out = []
    for _ in range(new_tokens):
        out.append(greedy_token(llm))
        llm.eval(out[-1:])
    return out


def transformers_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def transformers_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Argmax continuation, each step a full forward pass (no cache, EOS not special: as llama_cpp_greedy)."""
    out = []
    for _ in range(new_tokens):
        out.append(int(transformers_logits(model, ids + out)[-1].argmax()))
    return out


def assert_same_model(model, path, ids: list[int], outtype: str = "float32") -> None:
    expected, got = transformers_logits(model, ids), llama_cpp_logits(path, ids)
    assert got.shape == expected.shape
    scale = np.abs(expected).max()
    worst = np.abs(got - expected).max()
    assert worst <= TOLERANCE[outtype] * scale, f"max |Δlogit| {worst:.3g} > {TOLERANCE[outtype]} × {scale:.3g}"
    assert llama_cpp_greedy(path, ids, NEW_TOKENS) == transformers_greedy(model, ids, NEW_TOKENS)


@needs_stories
@pytest.mark.parametrize("tie", [True, False])
def test_tiny_per_layer_widths_with_biases_match(tmp_path, tie):
    """GQA, head size 6, a different head / key-value head / channel count in every layer, o/down biases."""
    model = tiny_model(tiny_config(vocab=512, tie=tie), attn="sdpa")
    model = apply_plan(model, random_plan(model, bias=True, seed=5))
    summary = export_gguf(model, AutoTokenizer.from_pretrained(STORIES), tmp_path / "m.gguf", dtype="float32")
    assert summary["architecture"] == "deci" and len(set(summary["heads"])) > 1
    assert_same_model(model, tmp_path / "m.gguf", [1, *range(40, 60)])


@needs_stories
def test_tokenizer_matches(tmp_path):
    loaded = load_model(str(STORIES_MHA))
    export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf", dtype="float32")
    llm = load_gguf(tmp_path / "m.gguf", n_ctx=64)
    # Not a text that starts with a space: transformers' Metaspace adds no "▁" before one, sentencepiece itself
    # and llama.cpp do (" a" is [▁a] in transformers, [▁, ▁a] in llama.cpp).
    for text in (PROMPT, "Tom and Sue's dog ran 3 laps!", "two  spaces  inside ", "naïve café – ok"):
        assert llm.tokenize(text.encode(), add_bos=True) == loaded.tokenizer(text)["input_ids"], text


def pruned_stories(kind: str):
    """stories260K-mha dense, pruned uniformly (RCPU defaults) or by FLAP's recipe (AL-AM, bias compensation)."""
    loaded = load_model(str(STORIES_MHA))
    if kind == "dense":
        return loaded
    calib = torch.randint(3, loaded.model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    config = (PruneConfig(ratio=0.3) if kind == "uniform" else
              PruneConfig(ratio=0.3, scorer="flap-wifv", compensator="flap-bias", structure="al-am",
                          statistics="one-shot"))
    model = copy.deepcopy(loaded.model)
    prune_model(model, calib, config, progress=False, registry=default_registry())
    return type(loaded)(model, loaded.tokenizer, loaded.provenance)


@pytest.mark.slow
@needs_stories
@pytest.mark.parametrize("kind, architecture", [("dense", "llama"), ("uniform", "llama"), ("al-am", "deci")])
def test_stories_dense_uniform_and_al_am_match_through_a_saved_directory(tmp_path, kind, architecture):
    pruned = pruned_stories(kind)
    save_pruned(pruned.model, tmp_path / "saved", tokenizer=pruned.tokenizer)
    summary = export_model(str(tmp_path / "saved"), str(tmp_path / "m.gguf"), "float32")
    assert summary["architecture"] == architecture
    reloaded = load_saved(tmp_path / "saved").model
    assert_same_model(reloaded, tmp_path / "m.gguf", pruned.tokenizer(PROMPT)["input_ids"])


@pytest.mark.slow
@needs_stories
@pytest.mark.parametrize("structure", ["uniform", "al-am"])
def test_llama_3_2_1b_shaped_model_pruned_with_round_to_matches(tmp_path, structure):
    """Llama-3.2-1B's shape (benchmarks/make_random_llama.py) at head size 4 and 2 layers: GQA 32/8 heads, tied
    128,256-token embeddings (the stories vocabulary padded), RoPE θ = 500,000; pruned with round_to=64."""
    from test_random_llama import make_random_llama

    config = make_random_llama.llama_config("llama3.2-1b", scale=0.05, layers=2)
    model = tiny_model(config, attn="sdpa")
    calib = torch.randint(3, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    options = {"structure": "al-am", "scorer": "flap-wifv", "compensator": "flap-bias"} if structure == "al-am" else {}
    prune_model(model, calib, PruneConfig(ratio=0.3, round_to=64, **options), progress=False,
                registry=default_registry())
    assert all(layer.mlp.gate_proj.out_features % 64 == 0 for layer in model.model.layers)
    export_gguf(model, AutoTokenizer.from_pretrained(STORIES), tmp_path / "m.gguf", dtype="float32")
    assert_same_model(model, tmp_path / "m.gguf", AutoTokenizer.from_pretrained(STORIES)(PROMPT)["input_ids"])


@pytest.mark.slow
@needs_stories
def test_stories_al_am_float16_within_its_tolerance(tmp_path):
    pruned = pruned_stories("al-am")
    export_gguf(pruned.model, pruned.tokenizer, tmp_path / "m.gguf", dtype="float16")
    ids = pruned.tokenizer(PROMPT)["input_ids"]
    expected, got = transformers_logits(pruned.model, ids), llama_cpp_logits(tmp_path / "m.gguf", ids)
    assert np.abs(got - expected).max() <= TOLERANCE["float16"] * np.abs(expected).max()


@needs_stories
def test_llama_cpp_speed_fields(tmp_path):
    loaded = load_model(str(STORIES_MHA))
    export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf", dtype="float16")
    result = llama_cpp_speed(tmp_path / "m.gguf", prompt_tokens=16, new_tokens=4, repeats=2, threads=1)
    assert (result["prompt_tokens"], result["new_tokens"], result["repeats"], result["threads"]) == (16, 4, 2, 1)
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0


@needs_stories
def test_speed_command_times_both_engines(capsys):
    from rcpu_bench.cli import main

    common = ["speed", "--model", str(STORIES_MHA), "--prompt-tokens", "8", "--new-tokens", "2", "--repeats", "1",
              "--quiet"]
    assert main([*common, "--engine", "transformers", "--engine", "llama.cpp", "--threads", "1",
                 "--eval-batch-size", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(str(STORIES_MHA))]
    assert [row[1] for row in rows] == ["transformers", "llama.cpp"] and rows[0][2] == rows[1][2] == "280,512"
    assert main([*common, "--engine", "llama.cpp", "--eval-batch-size", "2"]) == 2
    assert "llama.cpp is timed at batch 1 only" in capsys.readouterr().err


@pytest.mark.slow
@needs_stories
def test_a_matrix_cell_records_llama_cpp_speed_and_the_efficiency_table_shows_it(tmp_path):
    """eval speed-llama-cpp: the pruned model's GGUF export timed at batch 1 on torch's threads, into the record's
    typed field, and two further efficiency columns holding the record's figures (not the timing values)."""
    run_matrix(tiny_matrix(["rcpu-rot"], eval=["ppl", "speed-llama-cpp"]), tmp_path, progress=False)
    (entry,) = Store(tmp_path).entries()
    speed = entry.record.inference_llama_cpp
    assert (speed["batch_size"], speed["gguf_dtype"], speed["threads"]) == (1, "float16", torch.get_num_threads())
    assert (speed["prompt_tokens"], speed["new_tokens"]) == (PROMPT_TOKENS, SPEED_NEW_TOKENS)
    assert speed["prefill_tokens_per_s"] > 0 and speed["decode_tokens_per_s"] > 0
    (table,) = build_tables(read_results(tmp_path).results, spec("efficiency"), None)
    columns = {column.header: j for j, column in enumerate(table.columns)}
    (row,) = table.rows
    assert row.cells[columns["llama.cpp (CPU) prefill tok/s"]] == speed["prefill_tokens_per_s"]
    assert row.cells[columns["llama.cpp (CPU) decode tok/s"]] == speed["decode_tokens_per_s"]


@needs_stories
def test_q8_0_runs_within_its_tolerance(tmp_path):
    """llama.cpp's 8-bit quantisation (blocks of 32 values, one scale each) against transformers running the very
    weights the file holds (quantised and dequantised by the gguf library): llama.cpp also quantises the
    activations to 8 bits, so logits agree to 3e-2 × max |logit| (weights of std 0.02, as LLaMA's init)."""
    config = tiny_config(vocab=512, hidden=64, head_dim=16, n_heads=4, n_kv_heads=2, intermediate=96, tie=False)
    config.initializer_range = 0.02
    model = tiny_model(config, attn="sdpa")
    export_gguf(model, AutoTokenizer.from_pretrained(STORIES), tmp_path / "m.gguf", dtype="q8_0")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            held = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), q8_0), q8_0).reshape(weight.shape)
            weight.copy_(torch.from_numpy(held))
    ids = AutoTokenizer.from_pretrained(STORIES)(PROMPT)["input_ids"]
    expected, got = transformers_logits(model, ids), llama_cpp_logits(tmp_path / "m.gguf", ids)
    assert np.abs(got - expected).max() <= 3e-2 * np.abs(expected).max()


# Qwen2 / Qwen2.5's split (their tokenizer.json's Split pre-tokenizer), as llama.cpp's "qwen2" pre-tokenizer applies it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
CODE = "def mean(values: list[float]) -> float:\n    return sum(values) / len(values)  # it's 2024's API\n"


def qwen2_like_tokenizer():
    """A byte-level BPE with Qwen2's split and NFC normalizer, its merges learned here from Python source."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    corpus = [CODE * 3, "import os\nfor name in os.listdir('.'):\n    print(name, len(name))\n",
              "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.mark.parametrize("compensator", ["procrustes", "flap-bias"])
def test_a_qwen2_with_query_heads_pruned_tokenizes_and_runs_as_in_transformers(tmp_path, compensator):
    """q/k/v biases of the kept heads (one of the 4 query heads of each key/value group removed), o_proj's added
    bias with flap-bias, and Qwen2's split as llama.cpp's "qwen2" pre-tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = qwen2_like_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, rope_theta=1e6, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(0.2 * torch.randn_like(parameter))
        calib = torch.randint(1, len(tokenizer), (8, 32))
    prune_model(model, calib, PruneConfig(ratio=0.25, prune=("attention", "mlp"), gqa_rule="query",
                                          compensator=compensator), registry=default_registry(), progress=False)
    assert model.model.layers[0].self_attn.q_proj.bias.shape == (48,)
    summary = export_gguf(model, tokenizer, tmp_path / "qwen2.gguf", dtype="float32")
    assert summary["architecture"] == "llama" and summary["heads"] == [6, 6]
    ids = tokenizer(CODE)["input_ids"]
    llm = load_gguf(tmp_path / "qwen2.gguf", n_ctx=128)
    try:
        assert llm.tokenize(CODE.encode(), add_bos=False, special=False) == ids
        assert llm.tokenize(b"x  =  'naive' \n\n  y", add_bos=False, special=False) == \
            tokenizer("x  =  'naive' \n\n  y")["input_ids"]
    finally:
        llm.close()
    assert_same_model(model, tmp_path / "qwen2.gguf", ids[:40])
