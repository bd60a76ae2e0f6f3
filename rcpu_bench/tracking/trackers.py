"""The trackers of one command (:class:`Trackers`), opened from ``--report-to`` before any work.

Each tracker is a :class:`Tracker`: it logs a :class:`~rcpu_bench.tracking.content.TrackedRun` and says, when the
command ends, where its runs are. Opening checks what needs no tracker call: that each tracker's library is
installed (else one ImportError naming the ``pip install``) and that its local files have a place (the results
directory, or the directory of ``prune --out``, unless the tracker's own environment names one). Logging happens only
after the result is written; a tracker that fails is one warning line naming it and what to check, and is off for the
rest of the command (a server that does not answer is not asked again for every cell), while the run goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from rcpu_bench.tracking import TRACKERS
from rcpu_bench.tracking.content import TrackedRun

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One experiment tracker: ``name`` (as ``--report-to`` spells it), what to check when it fails, a run logged,
    and the line saying where its runs are (None when it logged none)."""

    name: str

    def check(self) -> str: ...

    def log(self, run: TrackedRun) -> None: ...

    def where(self) -> str | None: ...


def require_extras(names: Iterable[str]) -> None:
    """An ImportError naming the ``pip install`` when the library of one of the trackers ``names`` is missing."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"--report-to {','.join(missing)} needs {' and '.join(missing)}, not installed: "
                          f"pip install 'rcpu-bench[{','.join(missing)}]'")


def redacted(text: str) -> str:
    """``text`` with the credentials of any URL in it (``//user:password@``) replaced by ``***``."""
    return re.sub(r"//[^/@\s]+@", "//***@", text)


def open_trackers(names: Iterable[str], *, local_dir: Path | None, local_flag: str) -> Trackers:
    """The trackers ``names`` (of :data:`TRACKERS`), their local files under ``local_dir`` unless their environment
    says otherwise (``MLFLOW_TRACKING_URI``, ``WANDB_DIR``); a ValueError naming ``local_flag`` when neither gives a
    place. Nothing is written and no tracker is called yet."""
    names = tuple(names)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"--report-to {','.join(unknown)}: unknown tracker; allowed: {', '.join(TRACKERS)} or none")
    require_extras(names)
    trackers: list[Tracker] = []
    if "mlflow" in names:
        from rcpu_bench.tracking.mlflow_tracker import MlflowTracker

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            trackers.append(MlflowTracker(uri))
        elif local_dir is not None:
            trackers.append(MlflowTracker.local(local_dir))
        else:
            raise ValueError(f"--report-to mlflow: no tracking store; give {local_flag} (the store is then "
                             "mlflow.db beside it) or set MLFLOW_TRACKING_URI")
    if "wandb" in names:
        from rcpu_bench.tracking.wandb_tracker import WandbTracker

        if not os.environ.get("WANDB_DIR") and local_dir is None:
            raise ValueError(f"--report-to wandb: no directory for its run files; give {local_flag} (they then go "
                             "beside it, under wandb/) or set WANDB_DIR")
        trackers.append(WandbTracker(None if os.environ.get("WANDB_DIR") else local_dir))
    return Trackers(trackers)


class Trackers:
    """The trackers of one command: :meth:`log` gives a run to each of them; a failure is one warning line."""

    def __init__(self, trackers: Iterable[Tracker] = ()):
        self.trackers = list(trackers)
        self.active = list(self.trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, run: TrackedRun) -> None:
        """Log ``run`` to every tracker still on; one that raises is reported in one warning line and turned off."""
        for tracker in list(self.active):
            try:
                tracker.log(run)
            except Exception as error:  # noqa: BLE001 - a tracker never loses or blocks a result: warn, go on
                self.active.remove(tracker)
                message = " ".join(str(error).split())[:300]  # one line
                log.warning(redacted(f"{tracker.name}: run {run.name!r} not logged ({type(error).__name__}: "
                                     f"{message}); check {tracker.check()}; the results are written, {tracker.name} "
                                     "logging is off for the rest of this command"))

    def where(self) -> list[str]:
        """One line per tracker that logged runs: how many, where, and how to open them."""
        lines = (tracker.where() for tracker in self.trackers)
        return [redacted(line) for line in lines if line]
