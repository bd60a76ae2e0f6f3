"""The result store of a matrix run: ``<results_dir>/records.jsonl``, one entry per finished cell.

Why append-only JSONL and not SQLite (WAL): the results are committed under ``results/``, where a
text file is human-readable, diff-able and merge-able, and a database file is an opaque blob. There is
one writer: the runner's driver process (the Ray executor ships results back to the driver, which
writes them). For one writer, appending a whole line and fsyncing it before the next cell starts is
crash-safe: a cell's entry is either complete on disk or absent. A kill in the middle of a write can
leave at most a torn last line; the reader skips it and the writer cuts it off before appending, so it
never merges with the next entry. A lock on the file refuses a second writer. What SQLite would add
(concurrent writers, queries) is not needed: the whole file is read once per run.

An entry (read by the tables; keep the format)::

    {"cell_id": "<16 hex>", "status": "ok" | "failed",
     "error": null | {"type", "message", "traceback"},
     "cell": {"matrix", "model", "model_label", "method", "method_label", "ratio", "n_calib", "seqlen",
              "calib", "lam", "prune", "ppl_profiles", "eval", "revision", "dtype", "device"},
     "record": <run_experiment's record> | null, "finished_at": ISO time, "seconds": float}

A cell may have several entries (a failure, then a retry); the newest one counts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rcpu_bench.matrix.spec import Cell, load_matrix
from rcpu_bench.matrix.records import STORE_FILE, append_record, read_records

RECORDS = STORE_FILE
OK, FAILED = "ok", "failed"
RESULTS_ROOT = Path("results")


def matrix_results_dir(matrix_name: str) -> Path:
    """Where ``rcpu-bench run`` writes a matrix's store unless told otherwise: ``results/<matrix name>``."""
    return RESULTS_ROOT / matrix_name


def add_results_options(parser: Any) -> None:
    """``--results DIR`` or ``--matrix NAME`` (its default results directory), for the commands that read a store."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results", metavar="DIR", help=f"results directory holding {RECORDS}")
    where.add_argument("--matrix", metavar="NAME_OR_YAML",
                       help=f"read the results directory that `rcpu-bench run --matrix` writes: {RESULTS_ROOT}/<name>")


def results_dir_of(args: Any) -> Path:
    """The results directory named by ``--results`` or ``--matrix``; neither is a ValueError saying what to give."""
    if args.results:
        return Path(args.results)
    if args.matrix:
        return matrix_results_dir(load_matrix(args.matrix).name)
    raise ValueError(f"say which results to read: --results DIR, or --matrix NAME for {RESULTS_ROOT}/<matrix name> "
                     "(where `rcpu-bench run --matrix NAME` writes)")

log = logging.getLogger(__name__)


def error_info(error: BaseException) -> dict[str, str]:
    """An exception as the entry's ``error``: its type, message and formatted traceback."""
    return {"type": type(error).__name__, "message": str(error),
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


def make_entry(cell: Cell, *, seconds: float, record: dict[str, Any] | None = None,
               error: dict[str, str] | None = None) -> dict[str, Any]:
    """The store entry of a finished cell: ok with its record, or failed with its error."""
    return {"cell_id": cell.id, "status": FAILED if error else OK, "error": error, "cell": cell.to_dict(),
            "record": record, "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": seconds}


class StoreBusyError(RuntimeError):
    """Another process is writing the same store."""


class Store:
    """The entries of one results directory."""

    def __init__(self, results_dir: str | Path):
        self.dir = Path(results_dir)
        self.path = self.dir / RECORDS

    def entries(self) -> list[dict[str, Any]]:
        """Every complete entry, oldest first (a torn last line is skipped)."""
        return read_records(self.path) if self.path.exists() else []

    def latest(self) -> dict[str, dict[str, Any]]:
        """The newest entry of each cell id."""
        return {entry["cell_id"]: entry for entry in self.entries()}

    def finished(self) -> set[str]:
        """Ids of the cells whose newest entry is ok: a resumed run skips them."""
        return {cell_id for cell_id, entry in self.latest().items() if entry["status"] == OK}

    @contextmanager
    def writing(self) -> Iterator[Callable[[dict[str, Any]], None]]:
        """Lock the file and yield ``append(entry)``; a torn last line from a killed writer is cut first.

        The lock (flock, advisory, released by the kernel when the process dies) keeps a second run out.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusyError(f"{self.path} is being written by another run") from None
            self._cut_torn_tail()
            yield self.append

    def append(self, entry: dict[str, Any]) -> None:
        """Append one entry as a line and fsync it."""
        append_record(self.path, entry)

    def _cut_torn_tail(self) -> None:
        if not self.path.exists():
            return
        content = self.path.read_bytes()
        keep = content.rfind(b"\n") + 1
        if keep < len(content):
            log.warning("%s: dropping a torn last line (%d bytes) left by a killed run", self.path, len(content) - keep)
            with open(self.path, "r+b") as handle:
                handle.truncate(keep)
                os.fsync(handle.fileno())
