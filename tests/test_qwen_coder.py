"""Qwen2.5-Coder-1.5B by name (the [models-large] extra, `make test-large`): attention heads pruned on a real model.

Checked against independent computations: the assembled GGUF's pinned sha256 and the converted parameter count; the
dense perplexity against a plain float64 transformers computation and against llama.cpp running the original
quantized GGUF; heads and channels pruned under the query rule with every built-in compensator equal to the dense
model with those heads and channels zeroed and the same compensated weights written by hand (the removed heads' q/k/v
rows and biases gone, the kept ones untouched), on the model's first layers; and the paper's setting on the whole
model (rotation, 20 %): a plain `from_pretrained` reload, generation, stock lm-eval, and a GGUF that llama.cpp
tokenizes and runs as transformers does. A ratio whose rule removes no head says so before any weights load.

The float32 model is 7.1 GB: the tests hold at most two copies (the float64 reference alone: 14.2 GB).
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from registries import builtin_registry
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rcpu_bench import corpora, data
from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.cli import main
from rcpu_bench.evaluation.perplexity import perplexity
from rcpu_bench.evaluation.speed_llama_cpp import load_gguf
from rcpu_bench.experiment import Experiment
from rcpu_bench.model import real_models
from rcpu_bench.model.loading import load_model, parameter_count
from rcpu_bench.model.persistence import save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model

pytestmark = pytest.mark.large_model

NAME = "qwen2.5-coder-1.5b"
WINDOWS = 4  # 128-token windows of each profile in the perplexity checks
PROFILES = ("rcpu128", "cpython128")
FLOAT64_RTOL = 1e-4
# llama.cpp multiplies the Q4_K / Q6_K weights with activations quantized to 8 bits (Q8_K); the harness multiplies
# the dequantized weights in float32.
LLAMA_CPP_RTOL = 0.03
HEADS = {"prune": ("attention", "mlp"), "gqa_rule": "query"}  # ⌊0.2·6⌋ = 1 query head of each key/value group
LAYERS = 4  # of the real model, for the per-compensator comparisons


@functools.cache
def directory():
    """The converted directory (assembled and converted on first use); the test fails when a part is missing."""
    model = real_models.get(NAME)
    try:
        real_models.check_installed(model)
    except (ModuleNotFoundError, ValueError) as error:
        pytest.fail(f"{error} (the large-model tests need the [models-large] extra: make test-large)")
    return real_models.resolve(NAME)


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(directory())


def windows(profile: str) -> torch.Tensor:
    """The profile's first WINDOWS windows, cut here from the raw file as the protocol says (not by the harness)."""
    if profile == "cpython128":
        text = corpora.cpython_text(split="test").documents[0]
    else:
        with open(corpora.wikitext2_text(split="test").origin, encoding="utf-8") as handle:
            text = "\n\n".join(row if row.strip() else "" for row in handle)
    ids = torch.tensor(tokenizer()(text)["input_ids"])  # Qwen's tokenizer adds no BOS
    return ids[: WINDOWS * 128].view(WINDOWS, 128)


def reference_ppl(model, rows: torch.Tensor) -> float:
    """exp(mean NLL of every window token after the first), one window at a time, in float64 on the logits."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in rows:
            logits = model(window[None]).logits[0, :-1].double()
            nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += len(window) - 1
    return math.exp(nll / count)


def free(*objects) -> None:
    del objects
    gc.collect()


@pytest.fixture(scope="module")
def harness_ppl():
    """The harness's dense perplexity of each profile's first windows (the float32 model freed afterwards)."""
    loaded = load_model(NAME)
    result = {profile: perplexity(loaded.model, loaded.tokenizer, f"{profile}[0:{WINDOWS}]")["ppl"]
              for profile in PROFILES}
    free(loaded)
    return result


def test_the_assembled_gguf_and_the_converted_model_are_the_pinned_ones():
    model = real_models.get(NAME)
    converted = directory()
    assert real_models.cache_problem(model, converted) is None
    assert file_sha256(real_models.gguf_path(model)) == model.sha256
    source = real_models.read_source(converted)
    assert source["package_version"] == model.version and source["quantization"] == "Q4_K_M"
    config = AutoConfig.from_pretrained(converted)
    with torch.device("meta"):
        assert parameter_count(AutoModelForCausalLM.from_config(config)) == model.parameters
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (28, 12, 2, 8960)


def test_dense_perplexity_equals_a_float64_transformers_computation(harness_ppl):
    reference = AutoModelForCausalLM.from_pretrained(directory(), dtype=torch.float64).eval()
    try:
        for profile in PROFILES:
            expected = reference_ppl(reference, windows(profile))
            print(f"{profile}[0:{WINDOWS}]: harness {harness_ppl[profile]:.6f}, float64 {expected:.6f}, "
                  f"relative difference {harness_ppl[profile] / expected - 1:+.2e}")
            assert harness_ppl[profile] == pytest.approx(expected, rel=FLOAT64_RTOL), profile
    finally:
        free(reference)


def test_llama_cpp_running_the_original_gguf_is_close_to_the_dequantized_model(harness_ppl):
    llm = load_gguf(real_models.gguf_path(real_models.get(NAME)), n_ctx=256, logits_all=True, float32_cache=True)
    try:
        for profile in PROFILES:
            nll, count = 0.0, 0
            for window in windows(profile).tolist():
                llm.reset()
                llm.eval(window)
                logits = np.array(llm.scores[: len(window)], dtype=np.float64)[:-1]
                top = logits.max(axis=1, keepdims=True)
                log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
                nll += float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum())
                count += len(window) - 1
            ppl = math.exp(nll / count)
            print(f"{profile}[0:{WINDOWS}]: llama.cpp on the Q4_K_M file {ppl:.4f}, dequantized model "
                  f"{harness_ppl[profile]:.4f}, relative difference {ppl / harness_ppl[profile] - 1:+.2e}")
            assert ppl == pytest.approx(harness_ppl[profile], rel=LLAMA_CPP_RTOL), profile
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------ heads, by hand


@pytest.fixture(scope="module")
def first_layers():
    """The real model cut to its first LAYERS decoder layers (real weights, real head geometry and q/k/v biases)."""
    model = AutoModelForCausalLM.from_pretrained(directory(), dtype=torch.float32, num_hidden_layers=LAYERS).eval()
    yield model
    free(model)


def masked_by_hand(dense, pruned, report: list[dict]):
    """The dense model with each pruned query head's o_proj columns and q rows (and q bias) zeroed and each pruned
    channel's gate/up rows and down_proj column zeroed, the kept columns of o_proj / down_proj set to the pruned
    model's compensated weights and their biases to the pruned model's."""
    masked = copy.deepcopy(dense)
    head_dim = dense.config.hidden_size // dense.config.num_attention_heads
    with torch.no_grad():
        for layer, small, entry in zip(masked.model.layers, pruned.model.layers, report, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            heads = entry["attention"]["pruned_units"]
            rows = torch.tensor([h * head_dim + j for h in heads for j in range(head_dim)], dtype=torch.long)
            dropped = set(rows.tolist())
            kept = torch.tensor([c for c in range(attn.o_proj.in_features) if c not in dropped])
            attn.q_proj.weight[rows] = 0
            attn.q_proj.bias[rows] = 0
            attn.o_proj.weight.zero_()
            attn.o_proj.weight[:, kept] = small.self_attn.o_proj.weight
            attn.o_proj.bias = None if small.self_attn.o_proj.bias is None else \
                torch.nn.Parameter(small.self_attn.o_proj.bias.clone())
            channels = torch.tensor(entry["mlp"]["pruned_units"], dtype=torch.long)
            dropped = set(channels.tolist())
            kept = torch.tensor([c for c in range(mlp.down_proj.in_features) if c not in dropped])
            mlp.gate_proj.weight[channels] = 0
            mlp.up_proj.weight[channels] = 0
            mlp.down_proj.weight.zero_()
            mlp.down_proj.weight[:, kept] = small.mlp.down_proj.weight
            mlp.down_proj.bias = None if small.mlp.down_proj.bias is None else \
                torch.nn.Parameter(small.mlp.down_proj.bias.clone())
    return masked


COMPENSATORS = sorted(m.name for m in builtin_registry().methods("compensator"))  # the ones rcpu-bench ships
# 32 windows of 128 tokens (4,096) are fewer than down_proj's 7,168 kept columns: the ridge needs a λ that makes
# G_KK + λI invertible (the shipped matrices' middle value); the default 1e-4 is refused as singular.
PARAMS = {"ridge": {"lam": 10.0}}


@pytest.mark.parametrize("compensator", COMPENSATORS)
def test_pruned_heads_and_channels_equal_the_masked_dense_model(first_layers, compensator):
    config = PruneConfig(ratio=0.2, compensator=compensator, compensator_params=PARAMS.get(compensator, {}), **HEADS)
    pruned = copy.deepcopy(first_layers)
    calib = data.calibration_data("cpython:32x128", tokenizer())
    report = prune_model(pruned, calib.tokens, config, registry=default_registry(), progress=False).layers
    dense_attn = first_layers.model.layers[0].self_attn
    for layer, entry in zip(pruned.model.layers, report, strict=True):
        heads = entry["attention"]["pruned_units"]
        assert entry["attention"]["units_pruned"] == 2 and len({h // 6 for h in heads}) == 2  # one in each group
        assert entry["mlp"]["units_pruned"] == int(0.2 * 8960)
        attn = layer.self_attn
        assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (1280, 256, 256)
        assert attn.q_proj.bias.shape == (1280,) and attn.k_proj.bias.shape == (256,)
    kept_rows = torch.tensor([h * 128 + j for h in range(12) if h not in report[0]["attention"]["pruned_units"]
                              for j in range(128)])
    torch.testing.assert_close(pruned.model.layers[0].self_attn.q_proj.weight, dense_attn.q_proj.weight[kept_rows],
                               rtol=0, atol=0)
    torch.testing.assert_close(pruned.model.layers[0].self_attn.q_proj.bias, dense_attn.q_proj.bias[kept_rows],
                               rtol=0, atol=0)
    torch.testing.assert_close(pruned.model.layers[0].self_attn.k_proj.bias, dense_attn.k_proj.bias, rtol=0, atol=0)
    masked = masked_by_hand(first_layers, pruned, report)
    ids = windows("cpython128")[:2]
    with torch.no_grad():
        expected, got = masked(ids).logits, pruned(ids).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_a_ratio_that_removes_no_head_says_so_before_any_weights_load(monkeypatch, caplog):
    directory()
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    experiment = Experiment(model=NAME, prune=PruneConfig(ratio=0.1, **HEADS), calib="cpython:8x64")
    with caplog.at_level(logging.WARNING):
        experiment.validate(default_registry())
    assert "ratio=0.1 prunes none of the 6 query heads of a key/value group of attention" in caplog.text


# ---------------------------------------------------------------------------- the paper's setting, whole model


@pytest.fixture(scope="module")
def paper_setting(tmp_path_factory):
    """The whole model with 20 % of its query heads (2 of 12 per layer) and MLP channels pruned and compensated by
    the rotation, saved; returns the directory and the pruned model's logits on two code windows."""
    loaded = load_model(NAME)
    calib = data.calibration_data("cpython:32x128", loaded.tokenizer)
    prune_model(loaded.model, calib.tokens, PruneConfig(ratio=0.2, **HEADS), registry=default_registry(),
                progress=False)
    saved = tmp_path_factory.mktemp("qwen") / "pruned"
    manifest = save_pruned(loaded.model, saved, tokenizer=loaded.tokenizer, provenance=loaded.provenance)
    ids = windows("cpython128")[:2]
    with torch.no_grad():
        logits = loaded.model(ids).logits
    free(loaded)
    return saved, manifest, ids, logits


PLAIN_RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model.eval()(ids).logits, sys.argv[2])
assert "rcpu_bench" not in sys.modules and type(model).__name__ == "Qwen2ForCausalLM"
"""


def test_the_saved_model_reloads_with_plain_from_pretrained(paper_setting, tmp_path):
    saved, manifest, ids, logits = paper_setting
    assert manifest["config"] == "family" and manifest["provenance"]["real_model"]["name"] == NAME
    torch.save(ids, tmp_path / "io.pt")
    subprocess.run([sys.executable, "-c", PLAIN_RELOAD, str(saved), str(tmp_path / "io.pt")], check=True,
                   cwd=tmp_path)
    torch.testing.assert_close(torch.load(tmp_path / "io.pt"), logits, rtol=0, atol=1e-5)


def test_the_saved_model_generates(paper_setting, capsys):
    saved = paper_setting[0]
    assert main(["generate", "--model", str(saved), "--prompt", "def fibonacci(n):", "--max-new-tokens", "8",
                 "--quiet"]) == 0
    assert "| def fibonacci(n):" in capsys.readouterr().out


def test_stock_lm_eval_on_the_saved_model_equals_the_harness(paper_setting):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from rcpu_bench.evaluation.zeroshot import evaluate_zeroshot, local_task_config

    saved = paper_setting[0]
    stock = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={saved},dtype=float32", batch_size=8, device="cpu",
        tasks=[local_task_config("arc_easy")], limit=20, log_samples=False,
        task_manager=TaskManager(include_defaults=False))
    loaded = load_model(str(saved))
    try:
        ours = evaluate_zeroshot(loaded.model, loaded.tokenizer, ("arc_easy",), limit=20, source="local",
                                 batch_size=8)
    finally:
        free(loaded)
    for metric in ("acc", "acc_norm"):
        assert ours["tasks"]["arc_easy"][metric] == stock["results"]["rcpu_arc_easy"][f"{metric},none"], metric


def test_gguf_export_runs_in_llama_cpp_with_matching_tokens_and_logits(paper_setting, tmp_path):
    from rcpu_bench.commands.export import export_model

    saved, _, _, _ = paper_setting
    summary = export_model(str(saved), str(tmp_path / "pruned.gguf"), "float32")
    assert summary["architecture"] == "llama" and summary["heads"] == [10] * 28 and summary["kv_heads"] == [2] * 28
    text = "def mean(values: list[float]) -> float:\n    return sum(values) / len(values)  # 2024's API\n"
    ids = tokenizer()(text)["input_ids"]
    llm = load_gguf(tmp_path / "pruned.gguf", n_ctx=128, threads=2, logits_all=True, float32_cache=True)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids  # the same Qwen2 split and merges
        llm.eval(ids)
        ours = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    try:
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].double().numpy()
    finally:
        free(model)
    assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()
