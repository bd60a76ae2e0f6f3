"""Result records: one JSON object per run, appended durably to a JSONL file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from rcpu_bench import strict_json

STORE_FILE = "records.jsonl"  # a results directory's store (rcpu_bench.matrix.store)
_LIBRARIES = ("rcpu-bench", "torch", "transformers", "datasets", "lm_eval", "pluggy")
NOT_AVAILABLE = "n/a"
UNKNOWN = "unknown"
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries a result depends on."""
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _command_output(*command: str, cwd: Path | None = None) -> str | None:
    """The stripped stdout of ``command``, or None when it cannot run or fails (missing tool, not a repository)."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor() or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def harness_commit(path: Path = PACKAGE_DIR) -> dict[str, Any]:
    """{"commit": HEAD of the git checkout holding ``path``, "dirty": whether tracked files under ``path``
    differ from it}; both "unknown" outside a git checkout. Files elsewhere (results being written) do not count.
    Read-only: takes no lock and writes nothing in the checkout."""
    commit = _command_output("git", "rev-parse", "HEAD", cwd=path)
    if commit is None:
        return {"commit": UNKNOWN, "dirty": UNKNOWN}
    # --no-optional-locks: a plain `git status` refreshes the index and takes .git/index.lock in the user's checkout.
    changes = _command_output("git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no", "--", ".",
                              cwd=path)
    return {"commit": commit, "dirty": UNKNOWN if changes is None else bool(changes)}


def environment(device: str) -> dict[str, Any]:
    """Where a result was measured: the device's name (the GPU's for a CUDA device, else the CPU model), the
    CUDA and driver versions ("n/a" without CUDA), torch's intra-op thread count and the harness's git commit."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    driver = None
    if cuda:
        index = torch.device(device).index or 0
        driver = _command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index))
    return {"device": device,
            "device_name": torch.cuda.get_device_name(torch.device(device)) if cuda else cpu_model(),
            "cuda_version": (torch.version.cuda or NOT_AVAILABLE) if cuda else NOT_AVAILABLE,
            "driver_version": driver or NOT_AVAILABLE,
            "threads": torch.get_num_threads(),
            "harness": harness_commit()}


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as a single strict-JSON line (no NaN, no tensors: ValueError naming the field) and fsync,
    so a crash never leaves half a record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = strict_json.dumps(record, sort_keys=True) + "\n"
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
