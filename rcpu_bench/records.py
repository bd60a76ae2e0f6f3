"""The run record: what one experiment measured (:class:`Record`), its provenance, and its JSONL file.

A record is one JSON object per line, appended whole and fsynced (:func:`append_record`). Its keys are the
fields of :class:`Record`, whose parts are typed (:class:`Parameters`, :class:`Perplexity` with its per-window
values, :class:`Timing`), each read and written through its ``from_json`` / ``to_json``; a field that was not
measured is left out, and keys of no field (further evaluations a caller added) are kept in ``extra``.
``schema_version`` says which layout a line has; a record without one was written by an earlier release and is
converted by ``rcpu-bench migrate`` (``rcpu_bench.matrix.migrate``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
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


MIGRATE = "written by an earlier rcpu-bench: convert its store with `rcpu-bench migrate RESULTS_DIR`"


def _strict(kind: type, data: Mapping[str, Any], optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``data``'s keys checked against the fields of the dataclass ``kind``: each field given, save the ``optional``
    ones, and no other key (ValueError naming them)."""
    names = {f.name for f in fields(kind)}
    missing = sorted(names - set(data) - optional)
    unknown = sorted(set(data) - names)
    if missing or unknown:
        raise ValueError(f"a {kind.__name__.lower()} entry {dict(data)!r:.200} lacks {', '.join(missing) or 'nothing'} "
                         f"and has unknown {', '.join(unknown) or 'nothing'}; allowed keys: {', '.join(sorted(names))}")
    return dict(data)


@dataclass(frozen=True)
class Perplexity:
    """The perplexity of one profile (``rcpu_bench.evaluation.perplexity.perplexity``): ppl = exp(nll_mean) over
    ``n_tokens`` predicted tokens of ``n_windows`` windows (or stories) of ``dataset``, and per window, in the
    profile's order, its NLL sum and target count (what a paired bootstrap resamples; None in a summary without
    them, e.g. ``Record.dense_perplexity``)."""

    profile: str
    dataset: str
    seqlen: int
    n_windows: int
    n_tokens: int
    ppl: float
    nll_mean: float
    dataset_sha256: str
    batch_size: int
    window_nll: tuple[float, ...] | None = None
    window_targets: tuple[int, ...] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Perplexity:
        values = _strict(cls, data, frozenset({"window_nll", "window_targets"}))
        windows = {key: tuple(values[key]) for key in ("window_nll", "window_targets") if values.get(key) is not None}
        return cls(**{**values, **windows})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in data.items()
                if value is not None or key not in ("window_nll", "window_targets")}

    def summary(self) -> Perplexity:
        """The result without its per-window values."""
        return replace(self, window_nll=None, window_targets=None)


@dataclass(frozen=True)
class LayerTiming:
    """One decoder layer's seconds in each phase of the layer loop (``rcpu_bench.pruning.timing.PHASES``)."""

    layer: int
    seconds: dict[str, float]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayerTiming:
        return cls(data["layer"], {key: value for key, value in data.items() if key != "layer"})

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, **self.seconds}


@dataclass(frozen=True)
class Timing:
    """Wall time of a run: all of it (``total_seconds``: load, prune, evaluate), the pruning's per phase over the run
    (``prune_seconds``: a declared phase, or a whole-model method's name) and per layer."""

    total_seconds: float
    prune_seconds: dict[str, float]
    layers: tuple[LayerTiming, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timing:
        values = _strict(cls, data)
        return cls(values["total_seconds"], dict(values["prune_seconds"]),
                   tuple(LayerTiming.from_json(layer) for layer in values["layers"]))

    def to_json(self) -> dict[str, Any]:
        return {"total_seconds": self.total_seconds, "prune_seconds": dict(self.prune_seconds),
                "layers": [layer.to_json() for layer in self.layers]}


@dataclass(frozen=True)
class Parameters:
    """Parameter counts of the model before and after pruning, the fraction removed (1 − after / before), and the
    modules asked to be pruned that lost no unit in any layer (None when every one lost some)."""

    before: int
    after: int
    removed_fraction: float
    unpruned_modules: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Parameters:
        values = _strict(cls, data, frozenset({"unpruned_modules"}))
        unpruned = values.get("unpruned_modules")
        return cls(**{**values, "unpruned_modules": None if unpruned is None else tuple(unpruned)})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        unpruned = data.pop("unpruned_modules")
        return data if unpruned is None else {**data, "unpruned_modules": list(unpruned)}


# The typed parts of a record: field → how its JSON value reads (a list: one part per item).
PARTS: dict[str, Any] = {"parameters": Parameters, "timing": Timing, "perplexity": [Perplexity],
                         "dense_perplexity": [Perplexity]}


@dataclass
class Record:
    """The result of one run (:func:`rcpu_bench.experiment.run_experiment`).

    ``experiment`` is the Experiment's fields (``prune`` the PruneConfig's); ``parameters``, ``perplexity`` (one
    per profile), ``timing`` and ``dense_perplexity`` are typed parts (:data:`PARTS`); ``calibration_ppl`` the
    perplexity on the calibration windows themselves (the paper's rule for choosing the ridge λ); ``layers`` the
    pipeline's per-layer report. The optional fields are None where a run did not measure them (a run without
    ``--holdout``, a method without a report, a measurement the run skipped).
    """

    experiment: dict[str, Any]
    parameters: Parameters
    perplexity: tuple[Perplexity, ...]
    timing: Timing
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
    dense_perplexity: tuple[Perplexity, ...] | None = None  # the unpruned model's, when the run saves the model
    extra: dict[str, Any] = field(default_factory=dict)  # further fields a caller added
    schema_version: int = SCHEMA_VERSION

    def ppl(self, profile: str) -> float | None:
        """The perplexity of ``profile``, None when the run did not measure it."""
        return next((p.ppl for p in self.perplexity if p.profile == profile), None)

    def to_json(self) -> dict[str, Any]:
        """The record as its JSON object: the fields that were measured (typed parts as their JSON), then ``extra``."""
        data = {f.name: _part_json(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}
        return {**{key: value for key, value in data.items() if value is not None}, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """A record from its JSON object in today's format (keys of no field go to ``extra``)."""
        names = {f.name for f in fields(cls)} - {"extra", "schema_version"}
        if "schema_version" not in data:
            raise ValueError(f"a record without a schema_version was {MIGRATE}")
        if data["schema_version"] != SCHEMA_VERSION:
            raise ValueError(f"record schema_version {data['schema_version']!r} is not one this rcpu-bench reads "
                             f"({SCHEMA_VERSION})")
        missing = [name for name in cls.required() if name not in data]
        if missing:
            raise ValueError(f"a record needs the field(s) {', '.join(missing)}")
        known = {key: _part(key, value) for key, value in data.items() if key in names}
        extra = {key: value for key, value in data.items() if key not in names and key != "schema_version"}
        return cls(**known, extra=extra)

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The fields every record has (the others are None where a run did not measure them)."""
        return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)

    def add(self, measured: Mapping[str, Any]) -> None:
        """Add further measurements (e.g. ``{"zeroshot": ...}``, as JSON): fields by name, other keys to ``extra``."""
        names = {f.name for f in fields(self)} - {"extra", "schema_version"}
        for key, value in measured.items():
            if key in names:
                setattr(self, key, _part(key, value))
            else:
                self.extra[key] = value


def _part(name: str, value: Any) -> Any:
    """A record field's JSON value as its type: a typed part (:data:`PARTS`) read, any other as it is."""
    kind = PARTS.get(name)
    if kind is None or value is None:
        return value
    return tuple(kind[0].from_json(item) for item in value) if isinstance(kind, list) else kind.from_json(value)


def _part_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [item.to_json() for item in value]
    return value.to_json() if hasattr(value, "to_json") else value


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
