"""Result records: one JSON object per run, appended durably to a JSONL file."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

STORE_FILE = "records.jsonl"  # a results directory's store (rcpu_bench.store)
_LIBRARIES = ("rcpu-bench", "torch", "transformers", "datasets", "lm_eval", "pluggy")


def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries a result depends on."""
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as a single JSON line and fsync, so a crash never leaves half a record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (a torn last line from a killed writer is skipped)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.endswith("\n"):
                records.append(json.loads(line))
    return records
