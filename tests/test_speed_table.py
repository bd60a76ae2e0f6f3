"""benchmarks/speed_table.py without timing anything: its variants, speed-ups, Markdown and memory estimate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


speed_table = load_script("speed_table")


def row(variant: str, scale: float) -> dict:
    engines = {engine: {"prefill_tokens_per_s": 100.0 * scale, "decode_tokens_per_s": 10.0 * scale ** 2,
                        "logits_max_abs_diff": 1e-5} for engine in speed_table.ENGINES}
    return {"model": "m", "variant": variant, "ppl": 5.0 * scale, "parameters": int(1000 / scale), **engines}


def test_variants_are_dense_uniform_rounded_and_al_am_at_20_percent():
    options = [v.options for v in speed_table.variants(64)]
    assert options == [("--ratio", "0"), ("--ratio", "0.2"), ("--ratio", "0.2", "--round-to", "64"),
                       ("--ratio", "0.2", "--structure", "al-am")]


def test_speedups_divide_by_the_dense_rate_of_the_same_engine_and_the_table_shows_them():
    rows = [row("dense", 1.0), row("uniform 20%", 1.25)]
    speed_table.add_speedups(rows)
    for engine in speed_table.ENGINES:
        assert rows[0][engine]["prefill_speedup"] == rows[0][engine]["decode_speedup"] == 1.0
        assert rows[1][engine]["prefill_speedup"] == 125.0 / 100.0
        assert rows[1][engine]["decode_speedup"] == 15.625 / 10.0
    result = {"command": "python benchmarks/speed_table.py --quick", "machine": speed_table.machine(2),
              "setting": {**speed_table.asdict(speed_table.QUICK), "quick": True}, "rows": rows}
    text = speed_table.markdown(result)
    lines = [line for line in text.splitlines() if line.startswith("| uniform 20%")]
    assert len(lines) == 1 and "| 125 (1.25×) | 16 (1.56×) |" in lines[0] and "| 800 | 6.250 |" in lines[0]
    assert text.count("## m") == 1 and "2 threads" in text


def test_the_full_size_1b_shape_has_the_parameters_the_memory_estimate_assumes():
    """1.24 B parameters (tied embeddings counted once): 4.9 GB in float32, as the script's docstring says."""
    config = load_script("make_random_llama").llama_config("llama3.2-1b")
    with torch.device("meta"):
        parameters = LlamaForCausalLM(config).num_parameters()
    assert round(parameters / 1e9, 2) == 1.24 and round(parameters * 4 / 1e9, 1) == 4.9
    assert "1.24 B parameters, 4.9 GB in float32" in speed_table.__doc__.replace("\n", " ")
