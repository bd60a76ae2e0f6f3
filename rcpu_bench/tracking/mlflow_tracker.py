"""MLflow (``--report-to mlflow``): each run one MLflow run, through MLflow's own client, to any tracking URI.

The tracking URI is MLflow's ``MLFLOW_TRACKING_URI`` when set (a server, a database, Databricks: MLflow's own
variables such as ``MLFLOW_TRACKING_TOKEN`` authenticate it); otherwise a local SQLite store, ``mlflow.db`` in the
results directory (beside ``prune --out``), with the artifacts in ``mlartifacts/`` beside it, which
``mlflow ui --backend-store-uri sqlite:///<dir>/mlflow.db`` opens with no server set up. A matrix's runs go to the
MLflow experiment named by the matrix; a ``prune`` goes to ``MLFLOW_EXPERIMENT_NAME`` or ``rcpu-bench-prune``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from rcpu_bench.tracking.content import TrackedRun, runs

PRUNE_EXPERIMENT = "rcpu-bench-prune"
STORE, ARTIFACTS = "mlflow.db", "mlartifacts"
# What the MLflow UI shows an experiment as: runs with parameters and metrics (model development), not GenAI traces.
KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"


def local_uri(directory: Path) -> str:
    """The tracking URI of the SQLite store in ``directory``."""
    return f"sqlite:///{(directory / STORE).resolve()}"


class MlflowTracker:
    """Runs logged through ``mlflow.MlflowClient`` to ``uri``; ``artifacts``: where a new experiment keeps its
    artifacts (None: where the tracking server or MLflow decides)."""

    name = "mlflow"

    def __init__(self, uri: str, artifacts: Path | None = None):
        self.uri, self.artifacts = uri, artifacts
        self.logged = 0
        self._client: Any = None
        self._experiments: dict[str, str] = {}

    @classmethod
    def local(cls, directory: Path) -> MlflowTracker:
        """The SQLite store ``<directory>/mlflow.db``, its artifacts in ``<directory>/mlartifacts``."""
        return cls(local_uri(directory), (directory / ARTIFACTS).resolve())

    def check(self) -> str:
        return f"the tracking URI {self.uri} (MLFLOW_TRACKING_URI) and that its store or server answers"

    def where(self) -> str | None:
        if not self.logged:
            return None
        browse = (f"mlflow ui --backend-store-uri {self.uri}" if self.uri.startswith("sqlite:")
                  else "the tracking server's UI")
        return f"mlflow: {runs(self.logged)} logged to {self.uri} (open with {browse})"

    def log(self, run: TrackedRun) -> None:
        """One MLflow run: parameters (MLflow's text of each value), metrics, tags, artifacts, then its status."""
        from mlflow.entities import Metric, Param, RunStatus

        client = self.client()
        experiment = self.experiment(run.group or os.environ.get("MLFLOW_EXPERIMENT_NAME") or PRUNE_EXPERIMENT)
        created = client.create_run(experiment, run_name=run.name, tags=run.tags, start_time=_millis(run.started))
        run_id = created.info.run_id
        try:
            stamp = _millis(run.ended)
            client.log_batch(run_id, metrics=[Metric(key, value, stamp, 0) for key, value in run.metrics.items()],
                             params=[Param(key, str(value)) for key, value in run.params.items()])
            for path, text in run.texts.items():
                client.log_text(run_id, text, path)
            for path, source in run.files.items():
                parent = Path(path).parent.as_posix()
                client.log_artifact(run_id, str(source), None if parent == "." else parent)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the logging is the one to report
                client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
            raise
        status = RunStatus.FINISHED if run.ok else RunStatus.FAILED
        client.set_terminated(run_id, RunStatus.to_string(status), end_time=_millis(run.ended))
        self.logged += 1

    def client(self) -> Any:
        """The MLflow client (made once; the SQLite store's directory created first)."""
        if self._client is None:
            from mlflow import MlflowClient

            if self.artifacts is not None:
                self.artifacts.parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def experiment(self, name: str) -> str:
        """The id of the MLflow experiment ``name``, created when missing (with its artifacts in ``artifacts``)."""
        if name not in self._experiments:
            found = self.client().get_experiment_by_name(name)
            if found is not None:
                self._experiments[name] = found.experiment_id
            else:
                location = self.artifacts.as_uri() if self.artifacts is not None else None
                self._experiments[name] = self.client().create_experiment(name, artifact_location=location,
                                                                          tags={KIND: MODEL_DEVELOPMENT})
        return self._experiments[name]


def _millis(seconds: float | None) -> int | None:
    """Epoch seconds as MLflow's milliseconds (None: MLflow's now)."""
    return None if seconds is None else int(seconds * 1000)
