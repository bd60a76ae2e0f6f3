"""Saving pruned models of every family: uniform layers save with the family's own config (no remote code), per-layer
widths with the per-layer format; both reload with plain ``from_pretrained`` bit-exactly, in this process and in
a fresh one, generate, and run as matrix cells. Families: tests/tiny_families.py."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from tiny_families import FAMILIES, family_model
from tiny_matrices import tiny_raw, write_matrix
from tiny_models import STORIES, logits, needs_stories
from transformers import AutoModelForCausalLM, AutoTokenizer

from rcpu_bench.cli import main
from rcpu_bench.evaluation.generation import greedy_continuation
from rcpu_bench.matrix.store import Store
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import load_config, load_model, parameter_count
from rcpu_bench.model.persistence import load_pruned, save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model

STRUCTURES = {  # name: (prune config, the config kind saved)
    "uniform": (PruneConfig(ratio=0.5), "family"),
    "al-am": (PruneConfig(scorer="flap-wifv", compensator="flap-bias", structure="al-am", statistics="one-shot",
                          ratio=0.3), "per_layer"),
}


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (4, 24), generator=torch.Generator().manual_seed(seed))


MLP_ONLY = {"olmo2"}  # its q/k norms span all heads: head pruning is refused


def pruned_family(name: str, structure: str):
    model, config = family_model(name), STRUCTURES[structure][0]
    if name in MLP_ONLY:
        config = replace(config, prune=("mlp",), compensate=("mlp",))
    prune_model(model, ids(1), config, progress=False, registry=default_registry())
    return model


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("name", FAMILIES)
def test_saved_family_loads_with_plain_from_pretrained_bit_exactly(tmp_path, name, structure):
    model = pruned_family(name, structure)
    kind = STRUCTURES[structure][1]
    assert save_pruned(model, tmp_path / "m")["config"] == kind
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    geometries = layer_geometries(model)
    if kind == "family":  # the family's own config with the pruned counts
        assert saved["model_type"] == model.config.model_type and "auto_map" not in saved
        first = geometries[0]
        assert (saved["num_attention_heads"], saved["num_key_value_heads"], saved["intermediate_size"],
                saved["head_dim"]) == (first.n_heads, first.n_kv_heads, first.intermediate, first.head_dim)
    else:
        assert saved["base_config"]["model_type"] == model.config.model_type
        assert saved["layer_num_attention_heads"] == [geometry.n_heads for geometry in geometries]
        assert saved["layer_intermediate_sizes"] == [geometry.intermediate for geometry in geometries]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=False).eval()
    assert isinstance(loaded, type(model))  # the family's own class (for per_layer, a subclass of it)
    assert torch.equal(logits(loaded, ids()), logits(model, ids()))
    assert parameter_count(loaded) == parameter_count(model)
    assert layer_geometries(loaded) == geometries
    assert torch.equal(logits(load_pruned(tmp_path / "m").model, ids()), logits(model, ids()))


FRESH_PROCESS = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
cases = json.loads(Path(sys.argv[1]).read_text())
def run(directory, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()
    with torch.no_grad():
        return model(torch.load(Path(directory) / "ids.pt")).logits
for directory, kind in cases.items():  # uniform: no remote code at all; per_layer: the source saved beside it
    trust = {"trust_remote_code": True} if kind == "per_layer" else {}
    torch.save(run(directory, **trust), Path(directory) / "stock.pt")
assert not any(name.startswith("rcpu_bench") for name in sys.modules), "rcpu_bench was imported"
import rcpu_bench.model  # registers the per-layer format: plain from_pretrained, no remote code
for directory, kind in cases.items():
    torch.save(run(directory, trust_remote_code=False), Path(directory) / "registered.pt")
"""


@pytest.mark.slow
def test_every_family_reloads_bit_exactly_in_a_fresh_process(tmp_path):
    cases, expected = {}, {}
    for name in FAMILIES:
        for structure, (_, kind) in STRUCTURES.items():
            directory = tmp_path / f"{name}-{structure}"
            model = pruned_family(name, structure)
            save_pruned(model, directory)
            torch.save(ids(2), directory / "ids.pt")
            cases[str(directory)], expected[str(directory)] = kind, logits(model, ids(2))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}  # no PYTHONPATH, fresh caches
    subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "cases.json")], env=env, check=True,
                   cwd=tmp_path, timeout=600)
    for directory, reference in expected.items():
        for result in ("stock.pt", "registered.pt"):
            assert torch.equal(torch.load(f"{directory}/{result}"), reference), (directory, result)


@needs_stories
@pytest.mark.parametrize("name, structure", [("qwen2", "al-am"), ("gemma2", "uniform"), ("mistral", "al-am")])
def test_generate_command_on_a_saved_family_model(tmp_path, capsys, name, structure):
    model, tokenizer = pruned_family(name, structure), AutoTokenizer.from_pretrained(STORIES)
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "Once upon a", "--max-new-tokens", "8"]) == 0
    text = greedy_continuation(model, tokenizer, "Once upon a", 8)
    assert capsys.readouterr().out.split("\n")[1] == f"  {tmp_path / 'm'} | Once upon a{text}".rstrip()


@pytest.mark.slow
@needs_stories
def test_one_matrix_cell_per_family_through_rcpu_bench_run(tmp_path):
    tokenizer, models = AutoTokenizer.from_pretrained(STORIES), {}
    for name in FAMILIES:
        family_model(name).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        models[name] = {"model": str(tmp_path / name), "label": name}
    mlp_only = {"prune": ["mlp"], "compensate": ["mlp"]}
    runs = {"families": ([m for name, m in models.items() if name not in MLP_ONLY], {}),
            "mlp-only": ([m for name, m in models.items() if name in MLP_ONLY], mlp_only)}
    labels = []
    for run, (run_models, prune) in runs.items():
        matrix = write_matrix(tmp_path / f"{run}.yaml", tiny_raw(["wanda-sp"], name=run, models=run_models,
                                                                 **({"prune": prune} if prune else {})))
        assert main(["run", "--matrix", str(matrix), "--results", str(tmp_path / run), "--quiet"]) == 0
        for entry in Store(tmp_path / run).entries():
            assert entry.status == "ok", entry.error
            assert entry.record.parameters.removed_fraction > 0
            assert all(torch.isfinite(torch.tensor(p.ppl)) for p in entry.record.perplexity)
            labels.append(entry.cell.model_label)
    assert sorted(labels) == sorted(FAMILIES)


STOCK_TASK = """task: stock_piqa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_target: gold
doc_to_choice: choices
metric_list:
  - metric: acc
"""
STOCK_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
directory, trust, include = sys.argv[1:]
arguments = f"pretrained={directory},trust_remote_code={trust},dtype=float32"
result = lm_eval.simple_evaluate(model="hf", model_args=arguments,
                                 tasks=["stock_piqa"], limit=8, batch_size=4, device="cpu", bootstrap_iters=0,
                                 task_manager=TaskManager(include_path=include, include_defaults=False))
assert not any(name.startswith("rcpu_bench") for name in sys.modules), "rcpu_bench was imported"
print(json.dumps(result["results"]["stock_piqa"]["acc,none"]))
"""


@pytest.mark.slow
@needs_stories
@pytest.mark.parametrize("structure", STRUCTURES)
def test_stock_lm_eval_in_a_process_without_rcpu_bench(tmp_path, structure):
    """lm-eval's own ``--model hf`` on a task of its own format (the shared PIQA jsonl): the family config loads
    with no remote code, the per-layer format with trust_remote_code (rcpu_bench is not there to register it)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    data = STORIES.parent.parent / "data" / "zeroshot" / "mosaic_icl" / "piqa.jsonl"
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "stock_piqa.yaml").write_text(STOCK_TASK.format(data=data))
    model, tokenizer = pruned_family("qwen2", structure), AutoTokenizer.from_pretrained(STORIES)
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    trust = STRUCTURES[structure][1] == "per_layer"
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HOME": str(tmp_path)}
    stock = subprocess.run([sys.executable, "-c", STOCK_LM_EVAL, str(tmp_path / "m"), str(trust),
                            str(tmp_path / "tasks")], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert stock.returncode == 0, stock.stderr[-3000:]
    in_memory = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4), tasks=["stock_piqa"],
                                limit=8, bootstrap_iters=0,
                                task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))
    assert json.loads(stock.stdout.strip().splitlines()[-1]) == in_memory["results"]["stock_piqa"]["acc,none"]


@needs_stories
def test_a_saved_per_layer_model_is_a_model_to_prune_again(tmp_path):
    """``prune --model DIR`` reads a per-layer directory through load_config / load_model like any checkpoint."""
    model = pruned_family("gemma3_text", "al-am")
    save_pruned(model, tmp_path / "m", tokenizer=AutoTokenizer.from_pretrained(STORIES))
    config, _ = load_config(str(tmp_path / "m"))
    assert config.max_position_embeddings == model.config.max_position_embeddings  # read through to the family's
    loaded = load_model(str(tmp_path / "m"))
    assert torch.equal(logits(loaded.model, ids()), logits(model, ids()))
    prune_model(loaded.model, ids(1), PruneConfig(ratio=0.25), progress=False, registry=default_registry())
    assert save_pruned(loaded.model, tmp_path / "again")["config"] == "per_layer"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert torch.equal(logits(again, ids()), logits(loaded.model, ids()))


@pytest.mark.parametrize("family", ["phi3", "olmo2", "llama"])
def test_the_per_layer_format_builds_each_layer_at_its_counts(tmp_path, family):
    """The format alone (families the adapter does not prune yet included): Phi-3's fused qkv_proj / gate_up_proj
    and OLMo-2's q/k norms over all heads follow each layer's counts; the attention implementation set on the
    model reaches every layer; save_pretrained → from_pretrained is bit-exact."""
    from transformers import CONFIG_MAPPING

    from rcpu_bench.model.hf_format import RcpuPrunedConfig

    base = CONFIG_MAPPING[family](vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=4, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)
    heads, kv_heads, channels = [6, 4], [3, 2], [20, 12]
    config = RcpuPrunedConfig.of(base, layer_num_attention_heads=heads, layer_num_key_value_heads=kv_heads,
                                 layer_intermediate_sizes=channels, layer_added_biases=[["self_attn.o_proj"], []])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    assert isinstance(model, type(AutoModelForCausalLM.from_config(base)))
    for layer, h, kv, width in zip(model.model.layers, heads, kv_heads, channels, strict=True):
        shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
        assert shapes["self_attn.o_proj.weight"] == (32, h * 4)
        if family == "phi3":
            assert shapes["self_attn.qkv_proj.weight"] == ((h + 2 * kv) * 4, 32)
            assert shapes["mlp.gate_up_proj.weight"] == (2 * width, 32)
        else:
            assert shapes["self_attn.q_proj.weight"] == (h * 4, 32)
            assert shapes["self_attn.k_proj.weight"] == (kv * 4, 32)
            assert shapes["mlp.gate_proj.weight"] == (width, 32)
        if family == "olmo2":
            assert shapes["self_attn.q_norm.weight"] == (h * 4,) and shapes["self_attn.k_norm.weight"] == (kv * 4,)
    assert [layer.self_attn.o_proj.bias is not None for layer in model.model.layers] == [True, False]
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert all(layer.self_attn.config._attn_implementation == "eager" for layer in loaded.model.layers)
    tokens = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation("eager")
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))
