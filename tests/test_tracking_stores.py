"""The experiment trackers end to end, against the real libraries, offline: a matrix run twice (the second resumes)
with ``--report-to mlflow,wandb``, its runs read back through MLflow's client from the SQLite store and through
wandb's own reader of its offline run files (``wandb leet inspect``), each equal to the store's entry; the matrix's
tables and figures; no secret anywhere; and a ``prune --save`` logged to an ``mlflow server`` started on the loopback
address, read through its REST API."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
from processes import stop_group
from registries import builtin_registry
from tiny_matrices import tiny_raw, write_matrix
from tiny_models import STORIES_MHA
from tracker_env import SECRETS, offline

from rcpu_bench import console
from rcpu_bench.commands import main
from rcpu_bench.matrix.spec import expand, load_matrix

pytestmark = pytest.mark.slow
RIDGE = {"name": "ridge", "scorer": "variance", "compensator": "ridge"}
BIN = Path(sys.executable).parent


def flat(mapping: dict[str, Any]) -> dict[str, Any]:
    """A nested mapping flattened with dotted keys, by pandas (an implementation other than the harness's)."""
    return pd.json_normalize(mapping, sep=".").to_dict("records")[0]


def figures(record: dict[str, Any], seconds: float | None = None) -> dict[str, float]:
    """The metrics a tracker must show for ``record`` (and a cell's ``seconds``), spelled out."""
    def name(profile: str) -> str:  # tinystories[900:920] → tinystories_900-920
        return profile.replace("[", "_").replace(":", "-").replace("]", "")

    expected = {f"ppl/{name(p['profile'])}": p["ppl"] for p in record["perplexity"]}
    expected.update({f"dense_ppl/{name(p['profile'])}": p["ppl"] for p in record.get("dense_perplexity") or []})
    expected.update({"ppl/calibration": record["calibration_ppl"], "time/total": record["timing"]["total_seconds"],
                     "parameters/before": record["parameters"]["before"],
                     "parameters/after": record["parameters"]["after"],
                     "parameters/removed_fraction": record["parameters"]["removed_fraction"],
                     "memory/peak_bytes": record["peak_memory_bytes"],
                     "speed/prefill_tokens_per_s": record["inference"]["prefill_tokens_per_s"],
                     "speed/decode_tokens_per_s": record["inference"]["decode_tokens_per_s"]})
    expected.update({f"time/{phase}": value for phase, value in record["timing"]["prune_seconds"].items()})
    if seconds is not None:
        expected["time/cell"] = seconds
    return expected


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A tiny matrix (dense, RCPU, ridge at two λ; at 10 % no head is pruned, which the records say) run twice with
    ``--report-to mlflow,wandb``; its output."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    if not STORIES_MHA.is_dir():
        pytest.skip(f"fixture models not found ({STORIES_MHA})")
    root = tmp_path_factory.mktemp("tracked")
    matrix = write_matrix(root / "tiny.yaml", tiny_raw(["rcpu-rot", RIDGE], lambdas=[0.01, 1.0], include_dense=True,
                                                            ratios=[0.1]))
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as env, redirect_stdout(out), redirect_stderr(out):
        offline(env, root)
        codes = [main(["run", "--matrix", str(matrix), "--results", str(root / "results"), "--report-to",
                       "mlflow,wandb"]) for _ in range(2)]
        labels = {cell.id: cell.describe() for cell in expand(load_matrix(str(matrix)), builtin_registry())}
    console.reset()
    lines = [json.loads(line) for line in (root / "results" / "records.jsonl").read_text().splitlines()]
    return SimpleNamespace(root=root, results=root / "results", codes=codes, output=out.getvalue(), labels=labels,
                           entries={line["cell_id"]: line for line in lines})


def mlflow_runs(results: Path) -> tuple[Any, list[Any]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    return client, client.search_runs([client.get_experiment_by_name("tiny").experiment_id])


def test_each_cell_is_one_mlflow_run_with_its_cell_record_and_figures(tracked):
    client, runs = mlflow_runs(tracked.results)
    cells = {run.data.tags["rcpu_bench.cell_id"]: run for run in runs if "rcpu_bench.cell_id" in run.data.tags}
    assert sorted(cells) == sorted(tracked.entries) and len(tracked.entries) == 4
    unpruned = [entry["record"]["parameters"].get("unpruned_modules") for entry in tracked.entries.values()]
    assert unpruned.count(["attention"]) == 3  # the pruned cells: the record holds more than the counts
    for cell_id, entry in tracked.entries.items():
        run = cells[cell_id]
        assert run.info.run_name == f"{cell_id} {tracked.labels[cell_id]}" and run.info.status == "FINISHED"
        assert run.data.params == {key: str(value) for key, value in flat(entry["cell"]).items()}
        assert run.data.metrics == figures(entry["record"], entry["seconds"])
        assert run.data.tags["rcpu_bench.matrix"] == "tiny" and run.data.tags["rcpu_bench.status"] == "ok"
        local = client.download_artifacts(run.info.run_id, "record.json", str(tracked.root / run.info.run_id))
        assert json.loads(Path(local).read_text()) == entry
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["record.json"]  # no model is saved
    assert (tracked.results / "mlartifacts").is_dir()  # beside the store, not in the working directory


def test_a_resumed_run_logs_no_cell_twice(tracked):
    assert tracked.codes == [0, 0]
    _, runs = mlflow_runs(tracked.results)
    assert len(runs) == len(tracked.entries) + 1  # the cells, and the tables and figures once
    assert len(list((tracked.results / "wandb").glob("offline-run-*"))) == len(tracked.entries) + 1
    assert tracked.output.count("mlflow: 5 runs logged to sqlite:///") == 1
    assert tracked.output.count("wandb: 5 runs of project rcpu-bench written offline") == 1


def test_the_matrix_tables_and_figures_are_logged_at_its_end(tracked, capsys):
    client, runs = mlflow_runs(tracked.results)
    (run,) = [run for run in runs if "rcpu_bench.cell_id" not in run.data.tags]
    assert run.info.run_name == "tiny: tables and figures"
    destination = tracked.root / "matrix-artifacts"
    client.download_artifacts(run.info.run_id, "", str(destination))
    assert main(["tables", "--results", str(tracked.results), "--table", "all"]) == 0
    assert (destination / "tables.md").read_text() == capsys.readouterr().out
    plots = sorted(path.name for path in (tracked.results / "plots").iterdir())
    assert plots and sorted(path.name for path in (destination / "plots").iterdir()) == plots
    for name in plots:
        assert (destination / "plots" / name).read_bytes() == (tracked.results / "plots" / name).read_bytes()


def wandb_runs(directory: Path) -> list[dict[str, Any]]:
    """Every offline run under ``directory``, read by wandb's own reader of its ``.wandb`` files."""
    runs = []
    for path in sorted(directory.glob("offline-run-*/run-*.wandb")):
        done = subprocess.run([str(BIN / "wandb"), "leet", "inspect", "--json", str(path)], capture_output=True,
                              text=True, check=True, timeout=120)
        records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        of = {kind: [r[kind] for r in records if r["type"] == kind] for kind in ("run", "history", "files", "exit")}
        runs.append({**of["run"][0], "dir": path.parent, "exit_code": of["exit"][0].get("exit_code", 0),
                     "history": [{k: v for k, v in h["item"].items() if not k.startswith("_")} for h in of["history"]],
                     "files": [f["path"] for files in of["files"] for f in files["files"]]})
    return runs


def test_wandb_offline_runs_hold_the_cells_config_figures_and_records(tracked):
    runs = wandb_runs(tracked.results / "wandb")
    assert {run["run_group"] for run in runs} == {"tiny"} and {run["project"] for run in runs} == {"rcpu-bench"}
    cells = {run["config"]["update"].get("rcpu_bench.cell_id"): run for run in runs}
    assert sorted(key for key in cells if key) == sorted(tracked.entries)
    for cell_id, entry in tracked.entries.items():
        run = cells[cell_id]
        assert run["display_name"] == f"{cell_id} {tracked.labels[cell_id]}" and run["job_type"] == "cell"
        tags = {"rcpu_bench.cell_id": cell_id, "rcpu_bench.matrix": "tiny", "rcpu_bench.status": "ok"}
        assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == {**flat(entry["cell"]), **tags}
        assert run["history"] == [figures(entry["record"], entry["seconds"])] and run["exit_code"] == 0
        assert "record.json" in run["files"]
        assert json.loads((run["dir"] / "files" / "record.json").read_text()) == entry
    matrix = cells[None]
    assert matrix["job_type"] == "matrix" and "tables.md" in matrix["files"]
    assert {f"plots/{path.name}" for path in (tracked.results / "plots").iterdir()} <= set(matrix["files"])


def test_no_secret_is_in_the_records_logs_or_tracker_files(tracked):
    written = [path for path in tracked.root.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in written) and any(path.name == "mlflow.db" for path in written)
    for secret in SECRETS.values():
        assert secret not in tracked.output
        for path in written:
            assert secret.encode() not in path.read_bytes(), f"{secret!r} written to {path}"


# ------------------------------------------------------------------------------------- an MLflow server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server`` on 127.0.0.1 (a free port), its store and artifacts under ``tmp_path``; its URL."""
    pytest.importorskip("mlflow")
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
                               "--artifacts-destination", str(tmp_path / "server-artifacts")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _answers(f"{url}/health"):
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "mlflow server did not start in 180 s"
            time.sleep(1)
        yield url
    finally:
        stop_group(server, timeout=30)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def rest(url: str, endpoint: str, body: dict[str, Any] | None = None, **query: str) -> Any:
    """A call of the MLflow REST API: GET with ``query``, or POST ``body``; the JSON answer (or bytes of a file)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{endpoint}?{urllib.parse.urlencode(query)}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        content = response.read()
    return content if endpoint == "/get-artifact" else json.loads(content)


def test_a_prune_is_one_run_on_an_mlflow_server_as_its_rest_api_shows(mlflow_server, tmp_path, monkeypatch):
    if not STORIES_MHA.is_dir():
        pytest.skip(f"fixture models not found ({STORIES_MHA})")
    offline(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out, saved = tmp_path / "runs.jsonl", tmp_path / "pruned"
    assert main(["prune", "--model", str(STORIES_MHA), "--ratio", "0.2", "--calib", "tinystories:8x64", "--ppl",
                 "tinystories[900:920]", "--save", str(saved), "--out", str(out), "--report-to", "mlflow",
                 "--quiet"]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    experiment = rest(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name", experiment_name="rcpu-bench-prune")
    (run,) = rest(mlflow_server, "/api/2.0/mlflow/runs/search",
                  {"experiment_ids": [experiment["experiment"]["experiment_id"]]})["runs"]
    run_id = run["info"]["run_id"]
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"].endswith("| stories260K-mha | ρ=0.2")
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params == {key: str(value) for key, value in flat(record["experiment"]).items()}
    assert {m["key"]: m["value"] for m in run["data"]["metrics"]} == figures(record)
    listed = rest(mlflow_server, "/api/2.0/mlflow/artifacts/list", run_id=run_id)["files"]
    assert {(f["path"], f["is_dir"]) for f in listed} == {("record.json", False), ("model", True)}
    assert json.loads(rest(mlflow_server, "/get-artifact", path="record.json", run_uuid=run_id)) == record
    card = rest(mlflow_server, "/get-artifact", path="model/README.md", run_uuid=run_id)
    assert card == (saved / "README.md").read_bytes() and b"# Pruned model (rcpu-bench)" in card
    assert SECRETS["MLFLOW_TRACKING_TOKEN"].encode() not in (tmp_path / "server.log").read_bytes()
