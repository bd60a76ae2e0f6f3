"""What a tracker run holds (:class:`TrackedRun`), and how a run record, a matrix's store entry or a matrix's tables
and figures become one.

Parameters are the run's options flattened under dotted names (``prune.scorer``, ``prune.compensator_params.lam``):
a ``prune`` logs its record's ``experiment``, a matrix cell its stored ``cell`` (the matrix's labels beside the
recipe and experiment options). Metrics are the record's figures (:func:`record_metrics`), under names every tracker
takes (:func:`metric_key`: MLflow allows letters, digits, ``_ - . /`` and spaces)::

    ppl/<profile>                perplexity per evaluation profile (rcpu128[0:1024] is written rcpu128_0-1024)
    ppl/calibration              on the calibration windows, when measured
    dense_ppl/<profile>          the dense model's, when measured (prune --save)
    zeroshot/<task>              the accuracy a table shows per task (acc or acc_norm), and /acc, /acc_norm
    zeroshot/mean                their mean over the paper's tasks
    parameters/before, parameters/after, parameters/removed_fraction
    time/total                   seconds of the run, loading to record
    time/<phase>                 seconds of each pruning phase over all layers (capture, statistics, score, ...)
    time/cell                    seconds of a matrix cell, as its store entry says
    memory/peak_bytes            peak memory of the pruning
    speed/<figure>, speed_llama_cpp/<figure>   prefill and decode tokens/s, when measured

Artifacts: ``record.json`` (a ``prune``'s record; a cell's whole store entry, the record inside), the saved model's
card as ``model/README.md`` (``prune --save``), a matrix's tables as ``tables.md`` and its figures under ``plots/``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

PREFIX = "rcpu_bench."  # of the tags rcpu-bench sets
SPEED = {"inference": "speed", "inference_llama_cpp": "speed_llama_cpp"}
SPEED_FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s")
ACCURACIES = ("acc", "acc_norm")
PARAMETERS = ("before", "after", "removed_fraction")  # the counts of a record's parameters (not its unpruned_modules)


@dataclass(frozen=True)
class TrackedRun:
    """One tracker run: its name, group (the MLflow experiment and W&B group: a matrix's name; None: the tracker's
    own default) and kind (``prune``, ``cell`` or ``matrix``: a W&B job type), flattened parameters, metrics, tags,
    and artifacts: ``texts`` (artifact path → text) and ``files`` (artifact path → a file to copy). ``ok``: the run
    finished (a failed matrix cell is logged as a failed run). ``started``/``ended``: epoch seconds (None: now)."""

    name: str
    group: str | None
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    ok: bool = True
    started: float | None = None
    ended: float | None = None


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level, keys joined by dots (``prune.compensator_params.lam``); an empty mapping is
    left out, lists and scalars are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def metric_key(*parts: str) -> str:
    """Parts joined by ``/``, each with ``[a:b]`` written ``_a-b`` and any other character a tracker refuses as
    ``_``: ``metric_key("ppl", "rcpu128[0:1024]") == "ppl/rcpu128_0-1024"``."""
    cleaned = (re.sub(r"[^\w.\- ]", "_", part.replace("[", "_").replace(":", "-").replace("]", "")) for part in parts)
    return "/".join(cleaned)


def record_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The figures of a run record (its JSON object) as metrics, named as the module docstring lists them."""
    metrics: dict[str, float] = {}
    for key, name in (("perplexity", "ppl"), ("dense_perplexity", "dense_ppl")):
        for entry in record.get(key) or []:
            metrics[metric_key(name, entry["profile"])] = entry["ppl"]
    if record.get("calibration_ppl") is not None:
        metrics["ppl/calibration"] = record["calibration_ppl"]
    metrics.update(_zeroshot(record.get("zeroshot") or {}))
    metrics.update({metric_key("parameters", key): record["parameters"][key] for key in PARAMETERS})
    timing = record["timing"]
    metrics["time/total"] = timing["total_seconds"]
    metrics.update({metric_key("time", phase): seconds for phase, seconds in timing["prune_seconds"].items()})
    metrics["memory/peak_bytes"] = record["peak_memory_bytes"]
    for key, name in SPEED.items():
        speed = record.get(key) or {}
        metrics.update({metric_key(name, figure): speed[figure] for figure in SPEED_FIGURES if figure in speed})
    return {name: float(value) for name, value in metrics.items() if value is not None}


def _zeroshot(zeroshot: Mapping[str, Any]) -> dict[str, float]:
    """Per task the accuracy a table shows (``value``) and acc / acc_norm; the mean of the paper's tasks."""
    metrics = {}
    for task, result in (zeroshot.get("tasks") or {}).items():
        if result.get("value") is not None:
            metrics[metric_key("zeroshot", task)] = result["value"]
        metrics.update({metric_key("zeroshot", task, m): result[m] for m in ACCURACIES if result.get(m) is not None})
    if zeroshot.get("mean") is not None:
        metrics["zeroshot/mean"] = zeroshot["mean"]
    return metrics


def runs(count: int) -> str:
    """``1 run``, ``2 runs``."""
    return f"{count} run{'' if count == 1 else 's'}"


def as_json(data: Mapping[str, Any]) -> str:
    """A record or store entry as the ``record.json`` artifact: indented JSON, keys sorted."""
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def prune_run(record: Mapping[str, Any], *, name: str, model_card: Path | None = None) -> TrackedRun:
    """The tracker run of one ``rcpu-bench prune``: its record's experiment as parameters, its figures as metrics,
    the record (and the saved model's card) as artifacts; the record as its JSON file holds it (tuples as lists)."""
    record = json.loads(as_json(record))
    ended = time.time()
    return TrackedRun(name, None, "prune", params=flatten(record["experiment"]), metrics=record_metrics(record),
                      tags={f"{PREFIX}command": "prune"}, texts={"record.json": as_json(record)},
                      files={"model/README.md": model_card} if model_card else {},
                      started=ended - record["timing"]["total_seconds"], ended=ended)


def cell_run(entry: Mapping[str, Any], *, name: str, group: str) -> TrackedRun:
    """The tracker run of one store entry of a matrix (ok or failed): its cell as parameters, its record's figures
    and the cell's seconds as metrics, the entry as ``record.json``, tags naming the cell, phase and error; the entry
    as the store holds it (tuples as lists)."""
    entry = json.loads(as_json(entry))
    ok, record = entry["status"] == "ok", entry.get("record")
    metrics = {**(record_metrics(record) if ok and record else {}), "time/cell": float(entry["seconds"])}
    tags = {f"{PREFIX}cell_id": entry["cell_id"], f"{PREFIX}matrix": group, f"{PREFIX}status": entry["status"]}
    if entry.get("phase"):
        tags[f"{PREFIX}phase"] = entry["phase"]
    if not ok and entry.get("error"):
        error = entry["error"]
        tags[f"{PREFIX}error"] = f"{error['type']}: {(error['message'].splitlines() or [''])[0]}"[:500]
    ended = datetime.fromisoformat(entry["finished_at"]).timestamp() if entry.get("finished_at") else time.time()
    return TrackedRun(name, group, "cell", params=flatten(entry["cell"]), metrics=metrics, tags=tags,
                      texts={"record.json": as_json(entry)}, ok=ok, started=ended - entry["seconds"], ended=ended)


def matrix_run(group: str, *, tables: str | None, figures: Sequence[Path], figures_dir: Path) -> TrackedRun:
    """The tracker run of a matrix's end: its tables (Markdown) as ``tables.md`` and its figures under ``plots/``."""
    return TrackedRun(f"{group}: tables and figures", group, "matrix", tags={f"{PREFIX}matrix": group},
                      texts={"tables.md": tables} if tables else {},
                      files={f"plots/{path.relative_to(figures_dir).as_posix()}": path for path in figures})
