"""Zero-shot accuracy of an in-memory model through lm-eval: BoolQ, PIQA, HellaSwag, WinoGrande, ARC, OBQA.

The model is wrapped in lm-eval's ``HFLM`` as it is (no save and reload) and evaluated 0-shot with
``lm_eval.simple_evaluate``. Two data sources:

- ``local``: the task configs ``rcpu_<task>`` shipped in ``rcpu_bench/tasks``, which copy the
  built-in task's prompt fields, choices, metrics and version and read the shared zero-shot files
  (``<data>/zeroshot``), converted back to the built-in's document fields;
- ``hub``: lm-eval's built-in task configs, which download their datasets from the Hugging Face hub.

``auto`` uses the hub when it can be reached and no offline flag is set, else the local files, and
says which (a warning and the ``source`` / ``source_reason`` fields of the result). lm-eval's response
cache is never used, so two models can never share answers.

Local documents against the hub's (tests/test_zeroshot.py proves the requests equal the built-in
tasks' on the same documents, and the conversions lossless with respect to the local files):

- PIQA: the original release files, i.e. the built-in's documents (the Mosaic copy strips whitespace
  from 118 solutions, so it is not used).
- HellaSwag: a 1000-example subset of the 10,042 validation examples, in the file's order: scores are
  not comparable with full-set numbers.
- BoolQ: recovered from Mosaic's query except that Mosaic turned every " question" inside a passage
  into "\\nQuestion" (33 times, 22 passages); the space is restored, the word's case is not
  recoverable (see ``tasks.utils.boolq_fields``).
- ARC, OpenBookQA: the choice labels are re-made as A, B, C, D (the prompts use only texts and the
  answer's index). Every Mosaic question has exactly 4 choices and no surrounding whitespace; that
  these match the originals cannot be checked offline.
- WinoGrande: option1/option2 are split at the longest common prefix of the two filled-in contexts,
  so they may be shorter than the originals, but the requests depend only on the contexts and the
  continuation, which are kept exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import constants
from tabulate import tabulate

from rcpu_bench.models import (
    LoadedModel,
    load_config,
    load_model,
    model_source,
    parameter_count,
    resolve_device,
    resolve_dtype,
)
from rcpu_bench.paths import data_dir as default_data_dir
from rcpu_bench.persistence import MANIFEST, load_saved, read_manifest
from rcpu_bench.metric_maps import METRIC_MAPS, TASKS, table_metric
from rcpu_bench.records import append_record, library_versions

logger = logging.getLogger(__name__)

SOURCES = ("auto", "local", "hub")
TASK_DIR = Path(__file__).with_name("tasks")
# The built-in task configs, relative to lm_eval/tasks.
BUILTIN_YAML = {"boolq": "super_glue/boolq/default.yaml", "piqa": "piqa/piqa.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml",
                "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "openbookqa": "openbookqa/openbookqa.yaml"}
STATISTICS = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
HUB_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}

def resolved_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """``data_dir``, or ``$RCPU_BENCH_DATA`` / the shared data directory when None."""
    return Path(data_dir) if data_dir else default_data_dir()


def local_yaml(task: str) -> Path:
    """Our task config for ``task`` (package data)."""
    return TASK_DIR / f"rcpu_{task}.yaml"


def builtin_yaml(task: str) -> Path:
    """lm-eval's built-in task config for ``task``."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / BUILTIN_YAML[task]


def _load_yaml(path: Path, *, resolve_func: bool) -> dict[str, Any]:
    """lm-eval's task-YAML loader (it resolves ``!function``); lm-eval is imported only when needed (~6 s)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=resolve_func)


def local_task_config(task: str, data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``rcpu_<task>`` config as an lm-eval task spec, reading its files from ``data_dir``."""
    config = _load_yaml(local_yaml(task), resolve_func=True)
    config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_dir": str(resolved_data_dir(data_dir))}
    return config


def local_data_files(task: str) -> list[str]:
    """The data files of ``task``'s local config, relative to the data directory."""
    splits = _load_yaml(local_yaml(task), resolve_func=False)["dataset_kwargs"]["data_files"]
    return [name for files in splits.values() for name in files]


def sha256(path: Path) -> str:
    """The SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_tasks(text: str) -> tuple[str, ...]:
    """Comma-separated task names, checked against ``TASKS``; a ValueError lists the allowed ones."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown or [text]}; allowed: {', '.join(TASKS)}")
    return names


def hub_problem() -> str | None:
    """Why the hub cannot serve the built-in tasks' datasets (an offline flag, no connection), or None."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").upper() in _TRUE:
            return f"{variable} is set"
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as error:
        return f"{endpoint.hostname}:{port} is unreachable ({error})"
    return None


def resolve_source(source: str) -> tuple[str, str]:
    """The source to use (``local`` or ``hub``) for the requested one, and why."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; allowed: {', '.join(SOURCES)}")
    if source == "local":
        return "local", "requested"
    problem = hub_problem()
    if source == "hub":
        if problem:
            raise ValueError(f"source 'hub' requested but the hub cannot be used: {problem}; use source 'local'")
        return "hub", "requested"
    if problem:
        logger.warning("zero-shot data: local files, because the hub cannot be used: %s", problem)
        return "local", f"auto: hub not used, {problem}"
    return "hub", "auto: hub reachable"


def check_positive(name: str, value: Any) -> None:
    """A ValueError naming ``name`` unless ``value`` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ZeroShotPlan:
    """A checked zero-shot request: everything except the model, fixed before any work starts."""

    tasks: tuple[str, ...]
    source: str
    source_reason: str
    limit: int | None
    batch_size: int
    metric_map: str
    data_dir: Path
    data_files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256 (local source)


def plan_zeroshot(tasks: str | tuple[str, ...] | list[str] = TASKS, *, data_dir: str | os.PathLike | None = None,
                  limit: int | None = None, batch_size: int = 16, source: str = "auto",
                  metric_map: str = "paper") -> ZeroShotPlan:
    """Check a zero-shot request and resolve its data source; errors name what is allowed.

    ``tasks`` is a sequence of names or one comma-separated string.
    The local data files must exist when the local source is used; their SHA-256 are recorded.
    """
    tasks = parse_tasks(tasks if isinstance(tasks, str) else ",".join(tasks))
    if limit is not None:
        check_positive("limit (examples per task)", limit)
    check_positive("batch size", batch_size)
    if metric_map not in METRIC_MAPS:
        raise ValueError(f"unknown metric map {metric_map!r}; allowed: {', '.join(METRIC_MAPS)}")
    used, reason = resolve_source(source)
    root = resolved_data_dir(data_dir)
    files: dict[str, str] = {}
    if used == "local":
        names = [name for task in tasks for name in local_data_files(task)]
        missing = [str(root / name) for name in names if not (root / name).is_file()]
        if missing:
            raise FileNotFoundError(f"zero-shot data file(s) not found: {', '.join(missing)} "
                                    f"(set --data-dir or $RCPU_BENCH_DATA)")
        files = {name: sha256(root / name) for name in names}
    return ZeroShotPlan(tasks, used, reason, limit, batch_size, metric_map, root, files)


def lm_eval_name(task: str, source: str) -> str:
    """The name lm-eval reports ``task`` under for ``source``."""
    return f"rcpu_{task}" if source == "local" else task


def task_specs(plan: ZeroShotPlan) -> list[dict[str, Any] | str]:
    """lm-eval task specs: our local configs, or the built-in YAML files (loaded by path, not by index)."""
    if plan.source == "local":
        return [local_task_config(task, plan.data_dir) for task in plan.tasks]
    return [str(builtin_yaml(task)) for task in plan.tasks]


def task_summary(raw: dict[str, Any], task: str, plan: ZeroShotPlan) -> dict[str, Any]:
    """One task's statistics, size, version and table metric from lm-eval's results."""
    name = lm_eval_name(task, plan.source)
    scores = raw["results"][name]
    summary = {stat: scores[f"{stat},none"] for stat in STATISTICS if f"{stat},none" in scores}
    metric = table_metric(task, plan.metric_map)
    return {**summary, "n": raw["n-samples"][name]["effective"], "n_available": raw["n-samples"][name]["original"],
            "version": raw["versions"][name], "num_fewshot": raw["n-shot"][name], "lm_eval_task": name,
            "metric": metric, "value": summary[metric]}


def run_zeroshot(model: Any, tokenizer: Any, plan: ZeroShotPlan) -> dict[str, Any]:
    """Evaluate ``model`` as it is in memory on a checked plan; the result record (see ``evaluate_zeroshot``)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=plan.batch_size,
              max_length=model.config.max_position_embeddings)
    started = time.perf_counter()
    # No use_cache / cache_requests: lm-eval's caches are keyed by request, not by model. Seeds None:
    # 0-shot multiple choice draws nothing, and the caller's random state is left alone.
    raw = lm_eval.simple_evaluate(model=lm, tasks=task_specs(plan), task_manager=TaskManager(include_defaults=False),
                                  limit=plan.limit, log_samples=False, random_seed=None, numpy_random_seed=None,
                                  torch_random_seed=None, fewshot_random_seed=None)
    seconds = time.perf_counter() - started
    tasks = {task: task_summary(raw, task, plan) for task in plan.tasks}
    examples = sum(task["n"] for task in tasks.values())
    return {"tasks": tasks, "metric_map": plan.metric_map,
            "metrics": {task: table_metric(task, plan.metric_map) for task in tasks},
            "mean": sum(task["value"] for task in tasks.values()) / len(tasks),
            "lm_eval_version": metadata.version("lm_eval"), "source": plan.source,
            "source_reason": plan.source_reason, "batch_size": plan.batch_size, "limit": plan.limit,
            "max_length": lm.max_length, "seconds": seconds, "examples": examples,
            "examples_per_second": examples / seconds,
            "data_dir": str(plan.data_dir) if plan.source == "local" else None, "data_files": plan.data_files}


def evaluate_zeroshot(model: Any, tokenizer: Any, tasks: str | tuple[str, ...] | list[str] = TASKS, *,
                      data_dir: str | os.PathLike | None = None, limit: int | None = None, batch_size: int = 16,
                      source: str = "auto", metric_map: str = "paper") -> dict[str, Any]:
    """Zero-shot accuracy of an in-memory causal LM on ``tasks`` through lm-eval.

    ``limit`` takes the first N documents of each task; ``source`` is ``auto``, ``local`` or ``hub``
    (module docstring); ``metric_map`` (``paper`` or ``slicegpt``, see ``table_metric``)
    picks the metric a table shows per task. Returns ``tasks`` (per task: acc, acc_stderr and, where
    the task has it, acc_norm, acc_norm_stderr; n, n_available, version, num_fewshot, lm_eval_task,
    metric, value), ``mean`` of the values, and the run's lm_eval_version, source, source_reason,
    batch_size, limit, max_length, seconds, examples, examples_per_second, data_dir and data_files
    (relative path -> sha256).
    """
    plan = plan_zeroshot(tasks, data_dir=data_dir, limit=limit, batch_size=batch_size, source=source,
                         metric_map=metric_map)
    return run_zeroshot(model, tokenizer, plan)


def _with_stderr(task: dict[str, Any], stat: str) -> str:
    """``stat ± stderr`` of one task, or "-" where the task has no such metric."""
    if stat not in task:
        return "-"
    stderr = task.get(f"{stat}_stderr")
    return f"{task[stat]:.4f} ± {stderr:.4f}" if isinstance(stderr, float) else f"{task[stat]:.4f}"


def format_table(result: dict[str, Any]) -> str:
    """The per-task table of an ``evaluate_zeroshot`` result, with the table metric and its mean."""
    rows = [(task, t["n"], t["version"], _with_stderr(t, "acc"), _with_stderr(t, "acc_norm"), t["metric"],
             f"{t['value']:.4f}") for task, t in result["tasks"].items()]
    rows.append(("mean", "", "", "", "", result["metric_map"], f"{result['mean']:.4f}"))
    return tabulate(rows, headers=["task", "n", "version", "acc", "acc_norm", "metric", "value"])


# ----------------------------------------------------------------------------------------------- CLI


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to an ``add_subparsers()`` object and return its parser."""
    p = commands.add_parser("eval", help="zero-shot accuracy (BoolQ, PIQA, HellaSwag, WinoGrande, ARC, OBQA) "
                            "of a model through lm-eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True,
                   help="hub id, Hugging Face model directory, or directory written by save_pruned / --save")
    p.add_argument("--revision", help="hub revision (branch, tag or commit) to pin")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    p.add_argument("--limit", type=int, help="first N examples of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="local files, the hub's datasets, or the hub when reachable else local")
    p.add_argument("--metric-map", choices=tuple(METRIC_MAPS), default="paper",
                   help="metric per task in the table and the mean")
    p.add_argument("--data-dir", help="data directory (default: $RCPU_BENCH_DATA or ../shared/data)")
    p.add_argument("--out", metavar="JSONL", help="append the result record to this file")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.set_defaults(func=cmd_eval)
    return p


def pruned_directory(name: str) -> Path | None:
    """``name`` as a directory written by ``save_pruned`` (it has a manifest), or None."""
    path = Path(name).expanduser()
    return path if (path / MANIFEST).is_file() else None


def check_model_argument(name: str, revision: str | None) -> None:
    """Reject a missing path, a pruned directory without tokenizer, or an unsupported model, before loading."""
    directory = pruned_directory(model_source(name))
    if directory is None:
        load_config(name, revision)
        return
    read_manifest(directory)
    if not (directory / "tokenizer_config.json").is_file():
        raise ValueError(f"{directory} has no tokenizer (save_pruned was called without one)")


def load_for_eval(name: str, *, revision: str | None, dtype: str, device: str) -> LoadedModel:
    """``load_saved`` for a directory written by save_pruned (or a model method), else ``load_model``."""
    directory = pruned_directory(name)
    if directory is not None:
        return load_saved(directory, dtype=dtype, device=device)
    return load_model(name, dtype=dtype, device=device, revision=revision)


def cmd_eval(args: argparse.Namespace) -> int:
    """``rcpu-bench eval``: check everything, load the model, evaluate, print the table, append the record."""
    try:
        resolve_dtype(args.dtype)
        resolve_device(args.device)
        check_model_argument(args.model, args.revision)
        plan = plan_zeroshot(args.tasks, data_dir=args.data_dir, limit=args.limit, batch_size=args.batch_size,
                             source=args.source, metric_map=args.metric_map)
    except (ValueError, OSError) as error:
        print(f"rcpu-bench: error: {error}", file=sys.stderr)
        return 2
    loaded = load_for_eval(args.model, revision=args.revision, dtype=args.dtype, device=args.device)
    result = run_zeroshot(loaded.model, loaded.tokenizer, plan)
    print(format_table(result))
    print(f"source: {result['source']} ({result['source_reason']}); {result['examples']} examples in "
          f"{result['seconds']:.1f} s ({result['examples_per_second']:.1f}/s); lm-eval {result['lm_eval_version']}")
    if args.out:
        record = {"command": "eval", "model_provenance": loaded.provenance,
                  "parameters": parameter_count(loaded.model), "versions": library_versions(), "zeroshot": result}
        append_record(args.out, record)
        print(f"record appended to {args.out}")
    return 0
