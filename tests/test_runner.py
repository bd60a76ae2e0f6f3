"""The matrix runner: complete entries, resume, failing cells recorded, no cell lost to a kill, model reuse, CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from registries import builtin_registry
from test_tables import entry as table_entry
from test_tables import perplexity
from tiny_matrices import tiny_matrix, tiny_raw, write_matrix
from tiny_models import logits, needs_stories, tiny_config, tiny_model, tokens

from rcpu_bench.commands import main
from rcpu_bench.compensation import compensators
from rcpu_bench.experiment import Experiment, run_experiment
from rcpu_bench.hookspecs import hookimpl
from rcpu_bench.matrix import executors
from rcpu_bench.matrix.executors import ModelCache, clone_to, make_executor, run_cell
from rcpu_bench.matrix.runner import (
    _outcome,
    default_cell_seconds,
    estimate_seconds,
    run_matrix,
)
from rcpu_bench.matrix.spec import MatrixError, expand, load_matrix
from rcpu_bench.matrix.store import Store, read_results
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.records import Record
from rcpu_bench.registry import build_registry

REGISTRY = builtin_registry()
TIMEOUT_S = 120


def cli(*args: str) -> int:
    """``rcpu-bench run ARGS``."""
    return main(["run", *args])


@pytest.mark.slow
@needs_stories
def test_a_run_stores_a_complete_entry_per_cell_and_a_rerun_skips_them(tmp_path):
    matrix = tiny_matrix(["wanda-sp", "rcpu-rot"], include_dense=True)
    summary = run_matrix(matrix, tmp_path, progress=False)
    assert (summary.total, summary.ok, summary.failed, summary.skipped) == (3, 3, 0, 0)
    entries = Store(tmp_path).entries()
    assert [e.cell.method for e in entries] == ["original", "wanda-sp", "rcpu-rot"]
    for entry in entries:
        assert entry.status == "ok" and entry.error is None and entry.seconds > 0
        assert entry.record.experiment["prune"]["ratio"] == entry.cell.prune["ratio"]
        assert "ratio" not in entry.cell.to_json() and "lam" not in entry.cell.to_json()  # stored once, in prune
        assert entry.record.perplexity[0].profile == "tinystories[900:920]"
    removed = [e.record.parameters.removed_fraction for e in entries]
    assert removed[0] == 0 < removed[1] == removed[2]
    # Every cell prunes its own copy of the cached dense model: the last one equals a run that loads the model.
    fresh = run_experiment(expand(matrix, REGISTRY)[-1].experiment(), progress=False)
    assert entries[-1].record.perplexity == fresh.perplexity
    assert entries[-1].record.calibration_ppl == fresh.calibration_ppl
    again = run_matrix(matrix, tmp_path, progress=False)
    assert (again.ok, again.failed, again.skipped) == (0, 0, 3) and len(Store(tmp_path).entries()) == 3
    rerun = run_matrix(tiny_matrix(["wanda-sp"]), tmp_path, resume=False, progress=False)
    assert rerun.ok == 1 and len(Store(tmp_path).entries()) == 4 and len(Store(tmp_path).latest()) == 3


def test_a_clone_shares_no_tensor_with_the_dense_model_and_keeps_its_ties():
    model = tiny_model(tiny_config(tie=True))
    clone = clone_to(model, "cpu")
    assert clone.lm_head.weight is clone.model.embed_tokens.weight
    originals = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not originals & {t.data_ptr() for t in [*clone.parameters(), *clone.buffers()]}
    ids = tokens(61)
    before = logits(model, ids)
    torch.testing.assert_close(logits(clone, ids), before, rtol=0, atol=0)
    with torch.no_grad():
        for param in clone.parameters():
            param.mul_(0.5)
    torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)


# --- a plugin whose methods pass the registry's trial run (3 x 4) but break on a real module ----------

def explode(weight, stats, kept, pruned):
    """Raises on a real module."""
    if weight.shape[0] > 3:
        raise RuntimeError("simulated plugin failure")
    return compensators.none(weight, stats, kept, pruned)


def nan_weights(weight, stats, kept, pruned):
    """NaN weights on a real module (the registry's contract check refuses them)."""
    result = compensators.none(weight, stats, kept, pruned)
    if weight.shape[0] > 3:
        result.weight = torch.full_like(result.weight, float("nan"))
    return result


class FaultyPlugin:
    @hookimpl
    def register_compensators(self, register):
        register("explode", explode)
        register("nan-weights", nan_weights)


@pytest.mark.slow
@needs_stories
def test_failing_cells_are_recorded_with_their_traceback_the_run_goes_on_and_a_rerun_retries_them(tmp_path):
    registry = build_registry(plugin_manager([("faulty", FaultyPlugin())]))
    faulty = [{"name": name, "scorer": "variance", "compensator": name} for name in ("explode", "nan-weights")]
    matrix = tiny_matrix([faulty[0], "rcpu-rot", faulty[1]])
    summary = run_matrix(matrix, tmp_path, progress=False, registry=registry)
    assert (summary.ok, summary.failed) == (1, 2)
    entries = {e.cell.method_label: e for e in Store(tmp_path).entries()}
    assert entries["RCPU (Rot.)"].status == "ok"
    exploded, nan = entries["explode"].error, entries["nan-weights"].error
    for name in ("explode", "nan-weights"):
        assert entries[name].status == "failed" and entries[name].record is None
    assert exploded["type"] == "RuntimeError" and "in explode" in exploded["traceback"]
    # the cell's line names the plugin and the layer, as prune's error does
    assert _outcome(entries["explode"]) == ("RuntimeError: compensator 'explode' from faulty failed on layer 0: "
                                            "RuntimeError: simulated plugin failure")
    assert nan["type"] == "PluginContractError" and "NaN" in nan["message"] and "faulty" in nan["message"]
    again = run_matrix(matrix, tmp_path, progress=False, registry=registry)
    assert (again.ok, again.failed, again.skipped) == (0, 2, 1)


def test_a_non_finite_perplexity_fails_the_cell(monkeypatch):
    (cell,) = expand(tiny_matrix(["rcpu-rot"]), REGISTRY)
    record = Record.from_json({**table_entry("rcpu-rot", 0.2, 14.0)["record"], "calibration_ppl": 5.0,
                               "perplexity": [perplexity("tinystories[900:920]", 14.0)]})
    record.perplexity = (replace(record.perplexity[0], ppl=float("nan")),)
    monkeypatch.setattr(executors, "run_experiment", lambda *args, **kwargs: record)
    entry = run_cell(cell, REGISTRY, ModelCache())
    assert entry.status == "failed" and entry.record is None
    assert entry.error["type"] == "FloatingPointError"
    assert "non-finite perplexity: {'tinystories[900:920]': nan}" in entry.error["message"]


@pytest.fixture
def fake_zeroshot(monkeypatch):
    """A stand-in for rcpu_bench.evaluation.zeroshot (lm-eval over seven tasks is far too slow for a test)."""
    module = types.ModuleType("rcpu_bench.evaluation.zeroshot")
    module.plan_zeroshot = lambda: types.SimpleNamespace(data_files={"boolq.jsonl": "sha256:0"})
    module.evaluate_zeroshot = lambda model, tokenizer, limit: {"mean": 0.5, "limit": limit,
                                                                "parameters": model.num_parameters()}
    monkeypatch.setitem(sys.modules, "rcpu_bench.evaluation.zeroshot", module)
    return module


@pytest.mark.slow
@needs_stories
def test_zeroshot_cells_evaluate_the_pruned_model_into_the_record(tmp_path, fake_zeroshot):
    run_matrix(tiny_matrix(["rcpu-rot"], eval=["ppl", "zeroshot"], zeroshot_limit=7), tmp_path, progress=False)
    (entry,) = Store(tmp_path).entries()
    assert entry.record.zeroshot == {"mean": 0.5, "limit": 7,
                                           "parameters": entry.record.parameters.after}


@needs_stories
def test_missing_zeroshot_data_is_reported_before_any_cell_runs(tmp_path, fake_zeroshot):
    def plan_zeroshot():
        raise FileNotFoundError("zero-shot data file(s) not found: boolq.jsonl")

    fake_zeroshot.plan_zeroshot = plan_zeroshot
    with pytest.raises(MatrixError, match="eval zeroshot: zero-shot data file"):
        run_matrix(tiny_matrix(["rcpu-rot"], eval=["ppl", "zeroshot"]), tmp_path, progress=False)
    assert not (tmp_path / "records.jsonl").exists()


@needs_stories
def test_llama_cpp_speed_without_llama_cpp_is_refused_before_any_cell_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(MatrixError, match=r"eval speed-llama-cpp: .*pip install 'rcpu-bench\[gguf\]'"):
        run_matrix(tiny_matrix(["rcpu-rot"], eval=["ppl", "speed-llama-cpp"]), tmp_path, progress=False)
    assert not (tmp_path / "records.jsonl").exists()


# --- kills ----------------------------------------------------------------------------------------

RUNNER_SCRIPT = """\
import sys
from rcpu_bench.commands import main
sys.exit(main(sys.argv[1:]))
"""


def start_runner(script: Path, matrix_file: Path, results: Path, log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(script), "run", "--matrix", str(matrix_file), "--results",
                             str(results), "--quiet"], stdout=log, stderr=subprocess.STDOUT, env=env)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def kill_at(process: subprocess.Popen, store: Store, n_entries: int) -> None:
    """SIGKILL the runner as soon as the store holds ``n_entries`` lines."""
    deadline = time.monotonic() + TIMEOUT_S
    while lines(store.path) < n_entries:
        assert process.poll() is None, "the runner ended before it could be killed"
        assert time.monotonic() < deadline, "no entry in time"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(TIMEOUT_S)


@pytest.mark.slow
@needs_stories
def test_killed_runs_lose_no_finished_cell_and_a_rerun_completes_the_matrix(tmp_path):
    matrix_file = write_matrix(tmp_path / "kill.yaml", tiny_raw(["wanda-sp", "rcpu-rot", "rcpu-rot-scale"],
                                                                ratios=[0.1, 0.2]))
    ids = {cell.id for cell in expand(load_matrix(str(matrix_file)), REGISTRY)}
    script, store = tmp_path / "run_matrix.py", Store(tmp_path / "results")
    script.write_text(RUNNER_SCRIPT, encoding="utf-8")
    finished: set[str] = set()
    with open(tmp_path / "runner.log", "wb") as log:
        for n_entries in (1, 3):
            kill_at(start_runner(script, matrix_file, store.dir, log), store, n_entries)
            stored = [entry.cell_id for entry in store.entries()]  # every line reads back
            assert len(stored) == len(set(stored)) and finished <= set(stored) <= ids
            finished = set(stored)
        with open(store.path, "ab") as handle:
            handle.write(b'{"cell_id": "torn')  # a write cut short by a kill
        assert start_runner(script, matrix_file, store.dir, log).wait(TIMEOUT_S) == 0
    entries = store.entries()
    assert sorted(e.cell_id for e in entries) == sorted(ids) and {e.status for e in entries} == {"ok"}


# --- command line ---------------------------------------------------------------------------------

def test_a_dry_run_lists_the_cells_without_running_them(capsys, tmp_path):
    assert cli("--matrix", "smoke", "--dry-run", "--results", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("46 cells") and "RCPU (Rot.+Scale)" in out and "wanda-sp+ridge" in out
    assert not any(tmp_path.iterdir())
    assert cli("--matrix", "smoke", "--dry-run", "--ratios", "0.5", "--set", "lambdas=[1.0]") == 0
    assert capsys.readouterr().out.rstrip().endswith(f"{1 + 2 * 5 + 1} cells")


@needs_stories
@pytest.mark.parametrize("args, message", [
    (["--matrix", "smok"], "shipped: ablation, factorial, full, ncalib, paper, quick, real-gemma3"),
    (["--matrix", "smoke", "--set", "colour=red"], "unknown key 'colour'"),
    (["--matrix", "smoke", "--model", "/no/such/model"], "/no/such/model"),
    (["--matrix", "smoke", "--set", "calib.seqlen=100000", "--set", "calib.n_calib=[8]"], "seqlen 100000 exceeds"),
    pytest.param(["--matrix", "ablation"], "huggyllama/llama-7b", marks=pytest.mark.slow),  # ~20 s: a hub id offline
])
def test_bad_input_is_reported_before_any_cell_runs(capsys, tmp_path, args, message):
    assert cli(*args, "--results", str(tmp_path), "--quiet") == 2
    err = capsys.readouterr().err
    assert "rcpu-bench run: error:" in err and message in err
    assert not (tmp_path / "records.jsonl").exists()


def test_the_ray_executor_says_how_to_install_ray_when_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'rcpu-bench[ray]'")):
        make_executor("ray")


@pytest.mark.slow
@needs_stories
def test_run_prints_the_plan_then_plain_cell_lines_then_the_table_and_plots(capsys, tmp_path):
    """Not a terminal (capsys): no bar, one line per cell; the plan first, the ppl table and plots at the end."""
    matrix_file = write_matrix(tmp_path / "m.yaml", tiny_raw(["wanda-sp", "rcpu-rot"], include_dense=True))
    results = tmp_path / "results"
    assert cli("--matrix", str(matrix_file), "--results", str(results)) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    plan, cells = out.split("  estimated time: about ", 1)
    assert plan.splitlines() == ["matrix tiny: models mha", "  methods: Original, WANDA-sp, RCPU (Rot.)",
                                 "  ratios: 0%, 20%", "  3 cells: 3 to run, 0 already finished",
                                 f"  results: {results / 'records.jsonl'}"]
    assert "(an estimate; mha: 6 s/cell, the default for its size (no cell stored yet))" in cells
    assert len(re.findall(r"^\[    ok\] ", out, flags=re.MULTILINE)) == 3
    assert "### TinyStories perplexity (tinystories[900:920], lower is better)" in out
    assert f"plots (3 files: PNG, PDF, SVG) in {results / 'plots'}" in out
    assert sorted(p.suffix for p in (results / "plots").iterdir()) == [".pdf", ".png", ".svg"]
    # A rerun estimates nothing (nothing to run), and a new cell is estimated from the stored cells' mean.
    assert cli("--matrix", str(matrix_file), "--results", str(results), "--quiet") == 0
    assert "3 cells: 0 to run, 3 already finished" in capsys.readouterr().out
    stored = read_results(results).results
    mean = sum(r.seconds for r in stored) / 3
    seconds, how = estimate_seconds(expand(tiny_matrix(["rcpu-rot-scale"]), REGISTRY), stored)
    assert seconds == pytest.approx(mean) and how == f"mha: {mean:.1f} s/cell, the mean of its 3 stored cells"


def test_the_default_cell_seconds_follow_the_parameter_count():
    assert [default_cell_seconds(n) for n in (3e5, 1.1e9, 7e9, 7e10)] == [6.0, 300.0, 900.0, 1800.0]


def test_each_cell_is_checked_once_and_its_run_checks_nothing_again(tmp_path, monkeypatch):
    """Options per cell as the matrix expands, inputs (model config, tokenizer, windows, profiles) per setting and
    budgets per cell before the first cell runs; the run itself neither checks nor reads the config or tokenizer
    again."""
    from collections import Counter

    from rcpu_bench import experiment as experiment_module

    calls: Counter[str] = Counter()

    def counting(name, original):
        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return counted

    for name in ("check_options", "check_inputs", "check_budget", "validate"):
        monkeypatch.setattr(experiment_module.Experiment, name, counting(name, getattr(Experiment, name)))
    for name in ("load_config", "load_tokenizer"):
        monkeypatch.setattr(experiment_module, name, counting(name, getattr(experiment_module, name)))
    summary = run_matrix(tiny_matrix(["wanda-sp", "rcpu-rot"], ratios=[0.1, 0.2], include_dense=True), tmp_path,
                         progress=False, registry=REGISTRY)
    assert summary.ok == 5
    assert calls == {"check_options": 5, "check_inputs": 1, "check_budget": 5, "load_config": 1, "load_tokenizer": 1}
