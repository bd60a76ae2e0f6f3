"""The run record: what one experiment measured (:class:`Record`), its provenance, and its JSONL file.

A record is one JSON object per line, appended whole and fsynced (:func:`append_record`). Its keys are the
fields of :class:`Record`; a field that was not measured is left out, and keys of no field (further evaluations
a caller added) are kept in ``extra``. ``schema_version`` says which layout a line has; lines written before it
existed have none and the same layout, version 1.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from rcpu_bench import strict_json
from rcpu_bench.atomic_file import write_error, writing

SCHEMA_VERSION = 1
_LIBRARIES = ("rcpu-bench", "torch", "transformers", "datasets", "lm_eval", "pluggy")
NOT_AVAILABLE = "n/a"
UNKNOWN = "unknown"
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass
class Record:
    """The result of one run (:func:`rcpu_bench.experiment.run_experiment`).

    ``experiment`` is the Experiment's fields (``prune`` the PruneConfig's); ``parameters`` ``before``, ``after``
    and ``removed_fraction``; ``perplexity`` one entry per profile (``profile``, ``ppl``, ``n_windows``,
    ``n_tokens``, ``seqlen``); ``calibration_ppl`` the perplexity on the calibration windows themselves (the
    paper's rule for choosing the ridge λ); ``timing`` ``total_seconds``, ``prune_seconds`` and per ``layers``;
    ``layers`` the pipeline's per-layer report. The optional fields are None where a run did not measure them
    (older records, a run without ``--holdout``, a method without a report).
    """

    experiment: dict[str, Any]
    parameters: dict[str, Any]
    perplexity: list[dict[str, Any]]
    timing: dict[str, Any]
    peak_memory_bytes: int
    calibration_ppl: float | None = None
    layers: list[dict[str, Any]] | None = None
    model_provenance: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None  # the calibration data's provenance (rcpu_bench.data)
    versions: dict[str, str] | None = None  # library_versions()
    environment: dict[str, Any] | None = None  # environment(device)
    inference: dict[str, Any] | None = None  # rcpu_bench.evaluation.speed.inference_speed
    inference_llama_cpp: dict[str, Any] | None = None  # speed_llama_cpp.model_speed (a matrix's eval speed-llama-cpp)
    sample: dict[str, str] | None = None  # rcpu_bench.evaluation.generation.text_sample
    generalisation: dict[str, Any] | None = None  # rcpu_bench.compensation.diagnostics.summary (--holdout)
    method_report: dict[str, Any] | None = None  # a whole-model method's own report
    zeroshot: dict[str, Any] | None = None  # rcpu_bench.evaluation.zeroshot.evaluate_zeroshot (a matrix's eval)
    dense_perplexity: list[dict[str, Any]] | None = None  # the unpruned model's, when the run saves the model
    extra: dict[str, Any] = field(default_factory=dict)  # further fields a caller added
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record as its JSON object: the fields that were measured, then ``extra``."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{key: value for key, value in data.items() if value is not None}, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """A record from its JSON object (any schema version so far; keys of no field go to ``extra``)."""
        names = {f.name for f in fields(cls)} - {"extra", "schema_version"}
        known = {key: value for key, value in data.items() if key in names}
        extra = {key: value for key, value in data.items() if key not in names and key != "schema_version"}
        version = data.get("schema_version", 1)
        if version != SCHEMA_VERSION:
            raise ValueError(f"record schema_version {version!r} is not one this rcpu-bench reads ({SCHEMA_VERSION})")
        missing = [name for name in cls.required() if name not in known]
        if missing:
            raise ValueError(f"a record needs the field(s) {', '.join(missing)}")
        return cls(**known, extra=extra)

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The fields every record has (the others are None where a run did not measure them)."""
        return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)

    def add(self, measured: Mapping[str, Any]) -> None:
        """Add further measurements (e.g. ``{"zeroshot": ...}``): fields by name, other keys to ``extra``."""
        names = {f.name for f in fields(self)} - {"extra", "schema_version"}
        for key, value in measured.items():
            if key in names:
                setattr(self, key, value)
            else:
                self.extra[key] = value


# ------------------------------------------------------------------------------------------- provenance

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


def append_record(path: str | Path, record: Record | Mapping[str, Any]) -> None:
    """Append one record (or any JSON object: a store entry) as a single strict-JSON line (no NaN, no tensors:
    ValueError naming the field) and fsync. The line is written whole or not at all: a failed write (a full disk)
    truncates the file back to its previous size (removes it, when this write created it) and is one OSError naming
    ``path``."""
    path = Path(path)
    line = strict_json.dumps(record.to_json() if isinstance(record, Record) else dict(record), sort_keys=True) + "\n"
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(descriptor).st_size
        try:
            _write_all(descriptor, line.encode("utf-8"))
            os.fsync(descriptor)
        except BaseException as error:
            os.ftruncate(descriptor, size)
            if created and size == 0:  # the file this write made goes too
                path.unlink(missing_ok=True)
            if isinstance(error, OSError):
                raise write_error(path, error) from error
            raise
    finally:
        os.close(descriptor)


def _write_all(descriptor: int, data: bytes) -> None:
    """``data`` written to ``descriptor`` by as few ``os.write`` calls as the system allows (one, for a line)."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view):]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete JSON objects of a JSONL file (a torn last line from a killed writer is skipped)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.endswith("\n"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}, line {number}: not a JSON record ({error.msg} at character "
                                     f"{error.pos}); allowed: one JSON object per line (remove or repair the line)"
                                     ) from None
    return records
