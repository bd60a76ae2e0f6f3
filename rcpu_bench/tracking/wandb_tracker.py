"""Weights & Biases (``--report-to wandb``): each run one W&B run, through ``wandb`` and its own environment.

W&B reads its own variables: ``WANDB_MODE`` (``offline`` writes the runs locally with no network, and ``wandb sync``
uploads them later), ``WANDB_ENTITY``, ``WANDB_API_KEY`` (or ``wandb login``) and ``WANDB_DIR``; ``WANDB_PROJECT``
names the project (default ``rcpu-bench``). The run files go to ``WANDB_DIR`` when set, else under ``wandb/`` in
the results directory (beside ``prune --out``). A matrix's runs form the W&B group named by the matrix (a
``prune`` takes W&B's own ``WANDB_RUN_GROUP``). Nothing but the run is captured: no console, code, git state or
system metrics.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from rcpu_bench.tracking.content import TrackedRun, runs

PROJECT = "rcpu-bench"


class WandbTracker:
    """Runs logged with ``wandb.init`` … ``finish``, their files under ``directory`` (None: W&B's ``WANDB_DIR``)."""

    name = "wandb"

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.logged = 0
        self.offline_dir: Path | None = None  # where the offline runs are, once one is logged offline

    def check(self) -> str:
        return ("WANDB_MODE (offline needs no network), WANDB_API_KEY or `wandb login`, WANDB_PROJECT and "
                "WANDB_ENTITY")

    def where(self) -> str | None:
        if not self.logged:
            return None
        project = os.environ.get("WANDB_PROJECT") or PROJECT
        if self.offline_dir is not None:
            return (f"wandb: {runs(self.logged)} of project {project} written offline under {self.offline_dir} "
                    f"(upload with wandb sync {self.offline_dir}/offline-run-*)")
        return f"wandb: {runs(self.logged)} logged to project {project}"

    def log(self, run: TrackedRun) -> None:
        """One W&B run: parameters and tags as its config, metrics logged once (its summary), artifacts as its
        files, finished with exit code 1 when the run failed."""
        import wandb

        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_code=True, disable_git=True,
                                  disable_job_creation=True, x_disable_stats=True)
        tracked = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, group=run.group, name=run.name,
                             job_type=run.kind, config={**run.params, **run.tags},
                             tags=[run.kind, "ok" if run.ok else "failed"],
                             dir=None if self.directory is None else str(self.directory), reinit="create_new",
                             settings=settings)
        try:
            if run.metrics:
                tracked.log(run.metrics)
            for path, text in run.texts.items():
                _save(tracked, path, lambda target, text=text: target.write_text(text, encoding="utf-8"))
            for path, source in run.files.items():
                _save(tracked, path, lambda target, source=source: shutil.copyfile(source, target))
        finally:
            tracked.finish(exit_code=0 if run.ok else 1)
        if tracked.settings.mode == "offline":
            self.offline_dir = Path(tracked.dir).parent.parent  # <dir>/wandb/offline-run-<id>/files
        self.logged += 1


def _save(tracked: Any, path: str, write: Any) -> None:
    """Write a file into the run's files directory (``write(target)``) and register it with the run, so that it is
    uploaded with it (``wandb sync`` for an offline run)."""
    target = Path(tracked.dir) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    write(target)
    tracked.save(str(target), base_path=tracked.dir, policy="now")
