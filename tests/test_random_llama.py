"""benchmarks/make_random_llama.py at a tiny scale: the written directory loads and prunes like a real model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tiny_models import STORIES, TINYSTORIES, needs_stories

from rcpu_bench.experiment import Experiment, run_experiment
from rcpu_bench.model.loading import load_model
from rcpu_bench.pruning.pipeline import PruneConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_random_llama.py"
_spec = importlib.util.spec_from_file_location("make_random_llama", SCRIPT)
make_random_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_random_llama)


def test_full_size_configs_have_llama_widths():
    for shape, (hidden, mlp, heads, layers) in {"7b": (4096, 11008, 32, 32), "13b": (5120, 13824, 40, 40)}.items():
        config = make_random_llama.llama_config(shape)
        assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.head_dim,
                config.num_hidden_layers, config.vocab_size) == (hidden, mlp, heads, 128, layers, 32000)
    config = make_random_llama.llama_config("llama3.2-1b")  # Llama-3.2-1B's config.json, RoPE scaling aside
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings,
            config.rope_parameters["rope_theta"]) == (2048, 8192, 32, 8, 64, 16, 128256, True, 500000.0)


@pytest.mark.parametrize("bad", [{"shape": "70b"}, {"shape": "7b", "scale": 0}, {"shape": "7b", "scale": 1.5}])
def test_bad_shape_or_scale_is_rejected(bad):
    with pytest.raises(ValueError, match="shape=|scale="):
        make_random_llama.llama_config(**bad)


@pytest.mark.parametrize("device", ["cuda:0", "mps"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_bad_or_missing_device_is_refused_before_writing(tmp_path, device):
    out = tmp_path / "random-llama"
    config = make_random_llama.llama_config("7b", scale=0.02, layers=1)
    with pytest.raises(ValueError, match="device="):
        make_random_llama.write_model(out, config, "float16", tmp_path, device=device)
    assert not out.exists()


@pytest.mark.slow
@needs_stories
@pytest.mark.skipif(not TINYSTORIES.is_file(), reason="TinyStories fixture not found")
def test_tiny_scale_model_loads_prunes_and_evaluates(tmp_path):
    out = tmp_path / "random-llama"
    assert make_random_llama.main(["--shape", "7b", "--scale", "0.02", "--layers", "2", "--dtype", "float16",
                                   "--tokenizer-from", str(STORIES), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 220, 2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # embeddings/head shard + one per layer

    loaded = load_model(str(out), dtype="float32")
    params = sum(p.numel() for p in loaded.model.parameters())
    assert params == 2 * 32000 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * 220 + 2 * 64)
    std = loaded.model.model.layers[1].mlp.down_proj.weight.std().item()
    assert 0.018 < std < 0.022  # N(0, 0.02²) survived the float16 round trip and the load

    record = run_experiment(Experiment(model=str(out), prune=PruneConfig(compensator="procrustes", ratio=0.25),
                                       calib="tinystories:4x32", ppl_profiles=("tinystories[0:4]",)), progress=False)
    assert record.parameters.after < record.parameters.before
    assert torch.isfinite(torch.tensor(record.perplexity[0].ppl))


def test_existing_output_directory_is_refused(tmp_path, capsys):
    assert make_random_llama.main(["--scale", "0.02", "--layers", "1", "--tokenizer-from", str(STORIES),
                                   "--out", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err
