"""Experiment trackers: ``--report-to`` and the matrix key ``report_to`` checked before any work, metric names every
tracker takes, the record's figures as metrics, a missing extra or a failing tracker (one line each), and a failed
cell logged as a failed run. The end-to-end runs against MLflow's stores and W&B's offline files are in
``test_tracking_stores.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_matrices import tiny_matrix, tiny_raw, write_matrix
from tiny_models import STORIES_MHA, needs_stories
from tracker_env import offline

from rcpu_bench.commands import main, subcommand_parser
from rcpu_bench.compensation import compensators
from rcpu_bench.hookspecs import hookimpl
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import MatrixError, parse_matrix
from rcpu_bench.matrix.store import Store
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.registry import build_registry
from rcpu_bench.tracking.content import metric_key, record_metrics


@pytest.fixture
def tracker_env(monkeypatch, tmp_path):
    """The trackers offline, their own files under ``tmp_path`` (``tracker_env.offline``)."""
    offline(monkeypatch, tmp_path)
    return monkeypatch


# ------------------------------------------------------------------------------------------ the declaration


def test_report_to_is_a_comma_list_of_trackers_or_none_on_prune_and_run(capsys):
    prune = subcommand_parser("prune")
    assert prune.parse_args([]).report_to == ()
    assert prune.parse_args(["--report-to", "wandb,mlflow"]).report_to == ("wandb", "mlflow")
    assert prune.parse_args(["--report-to", "none"]).report_to == ()
    assert subcommand_parser("run").parse_args(["--matrix", "smoke"]).report_to is None  # the matrix's
    for bad, named in (("mlflow,tensorboard", "['tensorboard']"), ("mlflow,mlflow", "('mlflow', 'mlflow')")):
        with pytest.raises(SystemExit) as stopped:
            subcommand_parser("run").parse_args(["--matrix", "smoke", "--report-to", bad])
        assert stopped.value.code == 2
        assert named in capsys.readouterr().err


def test_the_matrix_key_report_to_takes_a_list_a_comma_list_or_none():
    read = {repr(value): parse_matrix(tiny_raw(["rcpu-rot"], report_to=value)).report_to
            for value in (["wandb"], "mlflow,wandb", "none", None)}
    assert read == {"['wandb']": ("wandb",), "'mlflow,wandb'": ("mlflow", "wandb"), "'none'": (), "None": ()}
    assert tiny_matrix(["rcpu-rot"]).report_to == ()
    with pytest.raises(MatrixError, match=r"report_to: .*unknown value\(s\) \['comet'\]; allowed: a comma list of "
                                          r"mlflow, wandb, or none"):
        parse_matrix(tiny_raw(["rcpu-rot"], report_to=["mlflow", "comet"]))
    with pytest.raises(MatrixError, match="report_to: expected a list or a comma list, got 3"):
        parse_matrix(tiny_raw(["rcpu-rot"], report_to=3))


def test_a_missing_extra_is_one_line_naming_the_pip_install_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import both say so
    out = tmp_path / "runs.jsonl"
    assert main(["prune", "--report-to", "wandb", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rcpu-bench prune: error: --report-to wandb needs wandb, not installed: "
                   "pip install 'rcpu-bench[wandb]'")
    matrix = write_matrix(tmp_path / "tiny.yaml", tiny_raw(["rcpu-rot"], report_to=["mlflow", "wandb"]))
    assert main(["run", "--matrix", str(matrix), "--results", str(tmp_path / "results")]) == 2
    assert "pip install 'rcpu-bench[wandb]'" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "results").exists()


def test_prune_without_a_place_for_the_tracker_files_is_refused_before_any_work(tracker_env, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    assert main(["prune", "--report-to", "mlflow"]) == 2
    assert "give --out FILE (the store is then mlflow.db beside it) or set MLFLOW_TRACKING_URI" in (
        capsys.readouterr().err)
    assert main(["prune", "--report-to", "wandb"]) == 2
    assert "give --out FILE (they then go beside it, under wandb/) or set WANDB_DIR" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- content


@given(base=st.sampled_from(["rcpu128", "rcpu128-bos", "std2048", "tinystories", "wikitext2"]),
       slices=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 10**6)), min_size=2, max_size=6, unique=True))
def test_metric_names_are_valid_mlflow_names_one_per_evaluation_slice(base, slices):
    validation = pytest.importorskip("mlflow.utils.validation")
    names = [metric_key("ppl", f"{base}[{start}:{stop}]") for start, stop in slices]
    for name in [*names, metric_key("ppl", base), metric_key("zeroshot", "arc_easy", "acc_norm")]:
        validation._validate_metric_name(name)  # the check every MLflow store runs
    assert len(set(names)) == len(slices)
    assert metric_key("ppl", "rcpu128[0:1024]") == "ppl/rcpu128_0-1024"


def test_the_record_figures_become_metrics():
    record = {"perplexity": [{"profile": "rcpu128[0:8]", "ppl": 31.5}, {"profile": "tinystories", "ppl": 7.25}],
              "dense_perplexity": [{"profile": "tinystories", "ppl": 6.5}], "calibration_ppl": None,
              "parameters": {"before": 1000, "after": 800, "removed_fraction": 0.2, "unpruned_modules": ["attention"]},
              "timing": {"total_seconds": 12.0, "prune_seconds": {"statistics": 2.0, "solve": 0.5}, "layers": []},
              "peak_memory_bytes": 4096, "inference": {"prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 40.0,
                                                       "device": "cpu", "repeats": 3},
              "zeroshot": {"mean": 0.45, "tasks": {"piqa": {"acc": 0.6, "acc_norm": 0.55, "value": 0.6, "n": 50},
                                                   "boolq": {"acc": 0.3, "value": 0.3, "acc_stderr": 0.1}}}}
    assert record_metrics(record) == {
        "ppl/rcpu128_0-8": 31.5, "ppl/tinystories": 7.25, "dense_ppl/tinystories": 6.5,
        "zeroshot/piqa": 0.6, "zeroshot/piqa/acc": 0.6, "zeroshot/piqa/acc_norm": 0.55, "zeroshot/boolq": 0.3,
        "zeroshot/boolq/acc": 0.3, "zeroshot/mean": 0.45, "parameters/before": 1000.0, "parameters/after": 800.0,
        "parameters/removed_fraction": 0.2, "time/total": 12.0, "time/statistics": 2.0, "time/solve": 0.5,
        "memory/peak_bytes": 4096.0, "speed/prefill_tokens_per_s": 900.0, "speed/decode_tokens_per_s": 40.0}


# ------------------------------------------------------------------------------- failures of a tracker


@pytest.mark.slow
@needs_stories
def test_a_failing_tracker_is_one_warning_line_and_every_result_is_written(tracker_env, tmp_path, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    (tmp_path / "a-file").write_text("")
    tracker_env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/a-file/mlflow.db")  # below a file: no store
    tracker_env.setenv("WANDB_MODE", "no-such-mode")
    matrix = write_matrix(tmp_path / "tiny.yaml", tiny_raw(["rcpu-rot", "wanda-sp"], report_to="mlflow,wandb"))
    assert main(["run", "--matrix", str(matrix), "--results", str(tmp_path / "results")]) == 0
    entries = Store(tmp_path / "results").entries()
    assert [entry.status for entry in entries] == ["ok", "ok"]
    out = tmp_path / "runs.jsonl"
    assert main(["prune", "--model", str(STORIES_MHA), "--ratio", "0.2", "--calib", "tinystories:8x64",
                 "--ppl", "tinystories[900:920]", "--out", str(out), "--report-to", "mlflow", "--quiet"]) == 0
    assert len(out.read_text().splitlines()) == 1
    err = capsys.readouterr().err.splitlines()
    mlflow_lines = [line for line in err if "mlflow: run " in line]
    wandb_lines = [line for line in err if "wandb: run " in line]
    assert len(mlflow_lines) == 2 and len(wandb_lines) == 1  # once per command, though the matrix had 3 runs
    assert all("check the tracking URI sqlite:///" in line and "(MLFLOW_TRACKING_URI)" in line and
               "the results are written" in line for line in mlflow_lines)
    assert "not logged (ValidationError: " in wandb_lines[0] and "no-such-mode" in wandb_lines[0]
    assert "check WANDB_MODE" in wandb_lines[0]


class ExplodingPlugin:
    @hookimpl
    def register_compensators(self, register):
        def explode(weight, stats, kept, pruned):
            """Raises on a real module (passes the registry's 3 × 4 trial)."""
            if weight.shape[0] > 3:
                raise RuntimeError("simulated failure\nsecond line")
            return compensators.none(weight, stats, kept, pruned)
        register("explode", explode)


@pytest.mark.slow
@needs_stories
def test_a_failed_cell_is_a_failed_run_with_its_error_and_entry_logged_after_it_is_stored(tracker_env, tmp_path):
    client_module = pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from rcpu_bench.commands.run import log_cell
    from rcpu_bench.tracking.mlflow_tracker import MlflowTracker
    from rcpu_bench.tracking.trackers import Trackers
    from rcpu_bench.tracking.wandb_tracker import WandbTracker

    registry = build_registry(plugin_manager([("exploding", ExplodingPlugin())]))
    matrix = tiny_matrix([{"name": "explode", "scorer": "variance", "compensator": "explode"}, "rcpu-rot"])
    log = log_cell(Trackers([MlflowTracker.local(tmp_path), WandbTracker(tmp_path)]), "tiny")
    stored_first = []

    def observe(entry, cell):
        as_stored = json.loads(json.dumps(entry.to_json()))  # tuples as lists
        stored_first.append(as_stored in [stored.to_json() for stored in Store(tmp_path).entries()])
        log(entry, cell)

    summary = run_matrix(matrix, tmp_path, progress=False, registry=registry, observe=observe)
    assert (summary.ok, summary.failed) == (1, 1) and stored_first == [True, True]
    client = client_module.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    entries = {entry.cell_id: entry for entry in Store(tmp_path).entries()}
    assert sorted(run.data.tags["rcpu_bench.cell_id"] for run in runs) == sorted(entries)
    for run in runs:
        entry = entries[run.data.tags["rcpu_bench.cell_id"]]
        assert run.info.status == ("FINISHED" if entry.ok else "FAILED")
        assert run.data.tags["rcpu_bench.status"] == entry.status
        cell = pd.json_normalize(entry.cell.to_json(), sep=".").to_dict("records")[0]
        assert run.data.params == {k: str(v) for k, v in cell.items()}
        logged = client.download_artifacts(run.info.run_id, "record.json", str(tmp_path / run.info.run_id))
        assert json.loads(Path(logged).read_text()) == entry.to_json()
        if not entry.ok:
            assert run.data.tags["rcpu_bench.error"] == ("RuntimeError: compensator 'explode' from exploding failed on "
                                                         "layer 0: RuntimeError: simulated failure")
            assert set(run.data.metrics) == {"time/cell"}
    exits = {}
    for path in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"):
        summary = json.loads(subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary",
                                             "--json", str(path)], capture_output=True, text=True, check=True,
                                            timeout=120).stdout)
        exits[summary["config"]["rcpu_bench.status"]] = (summary["state"], summary["exit_code"])
    assert exits == {"ok": ("finished", 0), "failed": ("failed", 1)}
