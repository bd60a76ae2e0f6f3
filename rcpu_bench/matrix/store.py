"""The result store of a matrix run: ``<results_dir>/records.jsonl``, one entry per finished cell.

Why append-only JSONL and not SQLite (WAL): the results are committed under ``results/``, where a
text file is human-readable, diff-able and merge-able, and a database file is an opaque blob. There is
one writer: the runner's driver process (the Ray executor ships results back to the driver, which
writes them). For one writer, appending a whole line and fsyncing it before the next cell starts is
crash-safe: a cell's entry is either complete on disk or absent. A kill in the middle of a write can
leave at most a torn last line; the reader skips it and the writer cuts it off before appending, so it
never merges with the next entry. A lock on the file refuses a second writer. What SQLite would add
(concurrent writers, queries) is not needed: the whole file is read once per run.

An entry (:class:`Entry`: its ``cell`` a :class:`rcpu_bench.matrix.cells.Cell`, its ``record`` a
:class:`rcpu_bench.records.Record`, each read and written through ``from_json`` / ``to_json``)::

    {"cell_id": "<16 hex>", "status": "ok" | "failed",
     "error": null | {"type", "message", "traceback"},
     "cell": {"matrix", "model", "model_label", "method", "method_label", "n_calib", "seqlen", "calib",
              "prune", "ppl_profiles", "eval", "revision", "dtype", "device", "eval_batch_size", "zeroshot_limit"},
     "record": <run_experiment's Record, as JSON> | null, "finished_at": ISO time, "seconds": float,
     "fingerprint": {"model", "calibration", "evaluation"} (ok entries; rcpu_bench.matrix.fingerprints),
     and for a λ-grid cell's two phases (rcpu_bench.matrix.phases) "phase", "lambda_rule", "chosen_from",
     "reproduced"}

The ratio and λ of a cell are in its ``prune`` (``prune.ratio``, ``prune.compensator_params.lam``). An entry
written by an earlier release is refused, naming ``rcpu-bench migrate`` (:mod:`rcpu_bench.matrix.migrate`), which
converts the store. A cell may have several entries (a failure, then a retry); the newest one counts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from rcpu_bench.matrix.cells import Cell, check_options, portable
from rcpu_bench.records import Record, append_record, read_records
from rcpu_bench.registry import failed_method

T = TypeVar("T")

RECORDS = "records.jsonl"
OK, FAILED = "ok", "failed"
RESULTS_ROOT = Path("results")


def matrix_results_dir(matrix_name: str) -> Path:
    """Where ``rcpu-bench run`` writes a matrix's store unless told otherwise: ``results/<matrix name>``."""
    return RESULTS_ROOT / matrix_name


log = logging.getLogger(__name__)


def error_info(error: BaseException) -> dict[str, str]:
    """An exception as the entry's ``error``: its type, message (naming the registered method that raised it, where
    one did: ``registry.failed_method``) and formatted traceback."""
    return {"type": type(error).__name__, "message": failed_method(error) or str(error),
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


@dataclass
class Entry:
    """One line of a results store: a finished cell, ok with its record or failed with its error (module docstring).

    The optional fields are written only when set, so entries keep their format; keys of no field are kept as they
    were (``extra``)."""

    cell_id: str
    status: str  # OK or FAILED
    cell: Cell
    record: Record | None = None
    error: dict[str, str] | None = None
    seconds: float = 0.0
    finished_at: str | None = None
    fingerprint: dict[str, str] | None = None
    phase: str | None = None
    lambda_rule: str | None = None
    chosen_from: list[str] | None = None
    reproduced: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of no field, kept as they were

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object: the always-written keys, the optional ones that are set, then ``extra``."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        data.update(cell=self.cell.to_json(), record=None if self.record is None else self.record.to_json())
        always = ("cell_id", "status", "error", "cell", "record", "finished_at", "seconds")
        return {**{k: v for k, v in data.items() if k in always or v is not None}, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        """An entry from its JSON object in today's format (missing optional keys read as unset)."""
        names = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in names}
        cell, record = Cell.from_json(values["cell"]), values.get("record")
        if record is not None:
            check_options(record["experiment"]["prune"], "its record's experiment.prune")
        values.update(cell=cell, record=None if record is None else Record.from_json(record))
        return cls(**values, extra={k: v for k, v in data.items() if k not in names})


# The record fields that hold a local path (part, key).
PATH_FIELDS = (("experiment", "model"), ("experiment", "data_dir"), ("model_provenance", "name_or_path"),
               ("calibration", "origin"), ("zeroshot", "data_dir"))


def portable_paths(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry (its JSON object) with the record's paths inside the shared fixtures written as ``${shared}/...``
    (:data:`PATH_FIELDS`): a store reads the same on every machine, and names no directory of the one it ran on."""
    record = entry.get("record")
    if not record:
        return entry
    parts = {part: {**record[part], key: portable(record[part][key])} for part, key in PATH_FIELDS
             if isinstance((record.get(part) or {}).get(key), str)}
    return {**entry, "record": {**record, **parts}} if parts else entry


def make_entry(cell: Cell, *, seconds: float, record: Record | None = None,
               error: dict[str, str] | None = None) -> Entry:
    """The store entry of a finished cell: ok with its record (its local paths :func:`portable_paths`), or failed
    with its error."""
    entry = Entry(cell.id, FAILED if error else OK, cell, record, error, seconds,
                  datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return entry if record is None else Entry.from_json(portable_paths(entry.to_json()))


class StoreBusyError(OSError):
    """Another process is writing the same store."""


class Store:
    """The entries of one results directory."""

    def __init__(self, results_dir: str | Path):
        self.dir = Path(results_dir)
        self.path = self.dir / RECORDS

    def entries(self) -> list[Entry]:
        """Every complete entry, oldest first (a torn last line and lines that are not entries are skipped); an entry
        that does not read is a ValueError naming its line."""
        if not self.path.exists():
            return []
        return [_entry(line, f"{self.path}:{number}")
                for number, line in _numbered_entries(read_records(self.path), self.path)]

    def latest(self) -> dict[str, Entry]:
        """The newest entry of each cell id, in the order the newest entries were written."""
        return newest_entries(self.entries())

    def finished(self) -> set[str]:
        """Ids of the cells whose newest entry is ok: a resumed run skips them."""
        return {cell_id for cell_id, entry in self.latest().items() if entry.ok}

    @contextmanager
    def writing(self) -> Iterator[Callable[[Entry], None]]:
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

    def append(self, entry: Entry) -> None:
        """Append one entry as a line and fsync it."""
        append_record(self.path, entry.to_json())

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


# ------------------------------------------------------------------------------------------ the one reader

@dataclass(frozen=True)
class StoredResult:
    """A finished cell (``status == "ok"``) of a store: the cell it ran and run_experiment's record.

    The fields below are what every reader uses; ``cell`` keeps the whole cell."""

    cell_id: str
    cell: Cell
    record: Record
    seconds: float

    @classmethod
    def from_entry(cls, entry: Entry) -> StoredResult:
        """The result of a finished store entry."""
        if entry.record is None:
            raise ValueError(f"entry {entry.cell_id} has no record (status {entry.status})")
        return cls(entry.cell_id, entry.cell, entry.record, entry.seconds)

    @property
    def model_label(self) -> str:
        """The model's label as tables and figures show it: with what its weights are when they are not the
        original model's (a real model's dequantized GGUF, ``rcpu_bench.model.real_models``)."""
        real = (self.record.model_provenance or {}).get("real_model") or {}
        return f"{self.cell.model_label} ({real['weights']})" if real.get("weights") else self.cell.model_label

    @property
    def ratio(self) -> float:
        return self.cell.ratio

    @property
    def n_calib(self) -> int:
        return self.cell.n_calib

    @property
    def lam(self) -> float | None:
        """The ridge λ of the cell, None for a method without a λ grid."""
        return self.cell.lam

    @property
    def prune(self) -> dict[str, Any]:
        """The PruneConfig fields the run recorded."""
        return self.record.experiment["prune"]


@dataclass(frozen=True)
class StoredResults:
    """The finished results of a store, in the order they finished; failed cells are only counted."""

    results: tuple[StoredResult, ...]
    failed: int

    def note_failed(self) -> None:
        """Tell stderr how many failed entries were skipped."""
        if self.failed:
            print(f"rcpu-bench: {self.failed} failed entries skipped", file=sys.stderr)


def read_results(results_dir: str | Path, *, missing_ok: bool = False) -> StoredResults:
    """The newest entry of each cell of ``<results_dir>/records.jsonl``, the ok ones as typed results.

    A torn last line (a killed writer) is skipped; a cell with several entries (a failure, then a retry) counts
    by its newest one. A missing store is a FileNotFoundError (``missing_ok``: no results); a finished entry that
    does not read (another format, a missing field) is a ValueError naming its line."""
    path = Path(results_dir) / RECORDS
    if not path.is_file():
        if missing_ok:
            return StoredResults((), 0)
        raise FileNotFoundError(f"no results store {path} (expected {RECORDS} in the --results directory)")
    numbered = _numbered_entries(read_records(path), path)  # a line that is not JSON: a ValueError naming it
    newest = newest_entries(numbered, cell_id=lambda entry: entry[1]["cell_id"])
    ok = [(number, line) for number, line in newest.values() if line.get("status") == OK]
    results = tuple(StoredResult.from_entry(_entry(line, f"{path}:{number}")) for number, line in ok)
    return StoredResults(results, len(newest) - len(ok))


def _entry(line: dict[str, Any], where: str) -> Entry:
    """The entry of a store line; a ValueError naming ``where`` and the entry when it cannot be read."""
    try:
        return Entry.from_json(line)
    except (ValueError, KeyError, TypeError) as error:
        message = error.args[0] if isinstance(error, KeyError) else error
        raise ValueError(f"{where}: entry {line.get('cell_id')}: {message}") from None


def _numbered_entries(lines: list[Any], path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, entry) of each line that is a cell entry; any other line (``{}``, no cell id, an unknown
    status) is skipped with a warning naming it, not counted as a failed cell."""
    entries = []
    for number, line in enumerate(lines, start=1):
        if is_entry(line):
            entries.append((number, line))
        else:
            log.warning("%s:%d is not a cell entry (no cell_id, or status not %s/%s); skipped", path, number, OK,
                        FAILED)
    return entries


def newest_entries(entries: Iterable[T], cell_id: Callable[[T], Any] = lambda entry: entry.cell_id  # type: ignore
                   ) -> dict[Any, T]:
    """The newest entry of each cell id (a later entry of a cell replaces its earlier ones), in the order the
    newest entries were written: the one rule by which a store's cells are read."""
    newest: dict[Any, T] = {}
    for entry in entries:
        key = cell_id(entry)
        newest.pop(key, None)
        newest[key] = entry
    return newest


def is_entry(line: Any) -> bool:
    """Whether a line of a store is a cell entry: a cell id and an ok or failed status."""
    return (isinstance(line, dict) and isinstance(line.get("cell_id"), str) and bool(line["cell_id"])
            and line.get("status") in (OK, FAILED))
