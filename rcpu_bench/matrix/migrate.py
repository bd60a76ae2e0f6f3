"""Result stores written by earlier rcpu-bench releases, brought to today's format (``rcpu-bench migrate``).

This module is the one place that knows the history of the store's format; every reader knows today's alone and
refuses an older entry, naming this command. What changed, and how an entry is brought up to date:

- cells kept copies of their ratio and λ beside ``prune`` (``cell.ratio``, ``cell.lam``): dropped, after checking
  that they agree with ``prune.ratio`` and ``prune.compensator_params.lam``;
- cell fields added later (``skip``, ``zeroshot_limit``): their unset value (what a cell meant before them);
- pruning options added later (``allocation``, ``holdout``, ``round_to``, ...), in ``cell.prune`` and in the
  record's ``experiment.prune``: their default, which is what runs did before the option existed;
- experiment fields added later (``trust_remote_code``, ``skip``): false and none;
- records without a ``schema_version``: version 1 (the layout those records have);
- records that named the local paths of the machine they ran on (the model, the calibration file, the zero-shot
  data): the paths inside the shared fixtures as ``${shared}/...`` (:func:`rcpu_bench.matrix.store.portable_paths`);
- ok entries without a fingerprint: the calibration sha256 that their record holds (the model and evaluation data
  an old entry was computed from cannot be fingerprinted after the fact; a resumed run still reuses it by path).

Every entry keeps its cell id: the options and fields added later enter the id only when set away from their unset
value (:func:`rcpu_bench.matrix.cells.cell_id`), and a migrated entry whose id would change is an error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcpu_bench import strict_json
from rcpu_bench.atomic_file import write_file_atomically
from rcpu_bench.matrix import cells
from rcpu_bench.matrix.store import OK, RECORDS, Store, is_entry, portable_paths
from rcpu_bench.pruning import options
from rcpu_bench.records import SCHEMA_VERSION, read_records

EXPERIMENT_ADDED: dict[str, Any] = {"trust_remote_code": False, "skip": []}  # experiment fields added later, unset


@dataclass(frozen=True)
class Migrated:
    """What migrating one store did: its entries, and how many of them changed."""

    path: Path
    entries: int
    changed: int


def migrate_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry (its JSON object) in today's format; ValueError when it cannot be (copies that disagree, or a cell id
    that would change)."""
    new = copy.deepcopy(entry)
    cell = new["cell"]
    for name, path in cells.DERIVED.items():
        if name in cell:
            copied = cell.pop(name)
            if copied != cells.derived(cell["prune"], name):
                raise ValueError(f"entry {entry['cell_id']}: its cell's {name} {copied!r} disagrees with prune.{path} "
                                 f"{cells.derived(cell['prune'], name)!r}")
    for name, unset in cells.HASHED_WHEN_SET.items():
        cell.setdefault(name, copy.deepcopy(unset))
    _add_options(cell["prune"])
    record = new.get("record")
    if record is not None:
        record.setdefault("schema_version", SCHEMA_VERSION)
        for name, unset in EXPERIMENT_ADDED.items():
            record["experiment"].setdefault(name, copy.deepcopy(unset))
        _add_options(record["experiment"]["prune"])
        calibration = (record.get("calibration") or {}).get("sha256")
        if new["status"] == OK and new.get("fingerprint") is None and calibration is not None:
            new["fingerprint"] = {"calibration": calibration}
    if cells.cell_id(cell) != entry["cell_id"]:
        raise ValueError(f"entry {entry['cell_id']}: today's format would give it the id {cells.cell_id(cell)}")
    return portable_paths(new)


def _add_options(prune: dict[str, Any]) -> None:
    """The pruning options added after a configuration was stored, at their defaults (tuples as JSON lists)."""
    for name, default in options.HASHED_WHEN_SET.items():
        prune.setdefault(name, list(default) if isinstance(default, tuple) else copy.deepcopy(default))


def migrate_store(results_dir: str | Path, *, dry_run: bool = False) -> Migrated:
    """Rewrite ``<results_dir>/records.jsonl`` in today's format (atomically, under the store's lock), every entry
    checked first; ``dry_run``: only count the entries that would change. Lines that are not entries are kept."""
    store = Store(results_dir)
    if not store.path.is_file():
        raise FileNotFoundError(f"no results store {store.path} (expected {RECORDS} in the directory)")
    with store.writing():  # refuses a store being written; cuts a torn last line
        lines = read_records(store.path)
        migrated = [migrate_entry(line) if is_entry(line) else line for line in lines]
        changed = sum(new != old for new, old in zip(migrated, lines, strict=True))
        if changed and not dry_run:
            text = "".join(strict_json.dumps(line, sort_keys=True) + "\n" for line in migrated)
            write_file_atomically(store.path, lambda path: _write(path, text))
    return Migrated(store.path, sum(map(is_entry, lines)), changed)


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
