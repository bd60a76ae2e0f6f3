"""``rcpu-bench eval``: zero-shot accuracy (any lm-eval task) of a model or a saved pruned directory, and the
per-task table it prints (:mod:`rcpu_bench.evaluation.zeroshot` does the evaluation).

lm-eval's files (``--output-path``) are written whole or not at all: lm-eval writes them into a hidden staging
directory, each is checked to be whole JSON and renamed into place with the user's file modes; a failed write
leaves nothing behind."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tabulate import tabulate

from rcpu_bench import console
from rcpu_bench.atomic_file import follow_umask, staging_sibling, write_error, writing
from rcpu_bench.commands import command
from rcpu_bench.commands.shared import check_models
from rcpu_bench.evaluation.metric_maps import METRIC_MAPS, TASKS
from rcpu_bench.evaluation.zeroshot import SOURCES, TASK_FIELDS, check_output_path, plan_zeroshot, run_zeroshot
from rcpu_bench.experiment import MODEL, add_flags
from rcpu_bench.model.loading import model_source, parameter_count
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import check_not_input, check_output_dir, check_output_file
from rcpu_bench.plugins import default_registry
from rcpu_bench.records import append_record, library_versions


def _with_stderr(task: dict[str, Any], stat: str) -> str:
    """``stat ± stderr`` of one task, or "-" where the task has no such metric."""
    if stat not in task:
        return "-"
    value, stderr = task[stat], task.get(stderr_key(stat))
    number = f"{value:.4f}" if isinstance(value, float) else str(value)
    return f"{number} ± {stderr:.4f}" if isinstance(stderr, float) else number


def stderr_key(metric: str) -> str:
    """The key of ``metric``'s stderr in a ``task_summary``: ``acc`` -> ``acc_stderr``,
    ``exact_match,flexible-extract`` -> ``exact_match_stderr,flexible-extract`` (lm-eval's naming)."""
    name, comma, filter_name = metric.partition(",")
    return f"{name}_stderr{comma}{filter_name}"


def metric_names(task: dict[str, Any]) -> list[str]:
    """The metrics of a ``task_summary``: its keys that are neither bookkeeping nor a stderr."""
    return [key for key in task if key not in TASK_FIELDS and not key.partition(",")[0].endswith("_stderr")]


def format_table(result: dict[str, Any]) -> str:
    """The per-task tables of an ``evaluate_zeroshot`` result: the paper tasks with their table metric and
    mean, then every metric of the other tasks and groups."""
    paper = {task: t for task, t in result["tasks"].items() if task in result["metrics"]}
    parts = []
    if paper:
        rows = [(task, t["n"], t["version"], _with_stderr(t, "acc"), _with_stderr(t, "acc_norm"), t["metric"],
                 f"{t['value']:.4f}") for task, t in paper.items()]
        rows.append(("mean", "", "", "", "", result["metric_map"], f"{result['mean']:.4f}"))
        parts.append(tabulate(rows, headers=["task", "n", "version", "acc", "acc_norm", "metric", "value"]))
    rows = [(name, t["n"], t["num_fewshot"], t["version"], metric, _with_stderr(t, metric))
            for name, t in result["tasks"].items() if name not in paper for metric in metric_names(t)]
    if rows:
        parts.append(tabulate(rows, headers=["task", "n", "shots", "version", "metric", "value"]))
    return "\n\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="hub id, Hugging Face model directory, or directory written by save_pruned / --save")
    add_flags(p, MODEL)
    p.add_argument("--tasks", default=",".join(TASKS),
                   help="comma-separated lm-eval task, group or tag names (offline, the paper's seven read "
                   "the shipped local copies)")
    p.add_argument("--include-path", action="append", metavar="DIR",
                   help="a directory of your own lm-eval task YAMLs, added to lm-eval's index (repeatable)")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt; unset: each task's own number, else 0")
    p.add_argument("--limit", type=int, help="first N examples of each task (default: all)")
    p.add_argument("--output-path", metavar="PATH",
                   help="write lm-eval's results JSON here (a directory, or a .json file), as lm-eval does")
    p.add_argument("--log-samples", action="store_true",
                   help="also write every document, prompt and response under --output-path (lm-eval's samples)")
    add_flags(p, ["eval_batch_size"])
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="data of the seven paper tasks: local files, the hub's datasets, or the hub when "
                   "reachable else local")
    p.add_argument("--metric-map", choices=tuple(METRIC_MAPS), default="paper",
                   help="metric per task in the table and the mean")
    p.add_argument("--data-dir", help="data directory (default: $RCPU_BENCH_DATA or ../shared/data)")
    p.add_argument("--out", metavar="JSONL", help="append the result record to this file")
    console.add_quiet_option(p)


STAGING = "lm-eval"  # lm-eval's files are staged in .lm-eval.<pid>.<random>.partial inside their directory


def output_directory(output_path: str) -> Path:
    """The directory lm-eval writes its files under for ``--output-path``: the path, or a ``.json`` path's parent."""
    path = Path(output_path).expanduser()
    return path.parent if path.suffix == ".json" else path


def check_destinations(args: argparse.Namespace) -> None:
    """``--output-path`` and ``--out``: writable (tried by creating and removing a file) and none of the command's
    inputs (the model's files, the data directory, the task directories)."""
    inputs = [model_source(args.model), args.data_dir, *(args.include_path or [])]
    if args.output_path:
        check_output_path(args.output_path)
        check_not_input(args.output_path, inputs, "--output-path")
        check_output_dir(output_directory(args.output_path), "--output-path directory")
    if args.out:
        check_not_input(args.out, inputs, "--out file")
        check_output_file(args.out, "--out file")


@contextlib.contextmanager
def staged_output(output_path: str | None) -> Iterator[str | None]:
    """The ``output_path`` to hand lm-eval: the same name inside a hidden staging directory, whose files are
    published whole (``publish``) when the block ends; the staging is removed whatever happens."""
    if output_path is None:
        yield None
        return
    directory = output_directory(output_path)
    staging = staging_sibling(directory / STAGING, directory=True)
    staged = str(staging / Path(output_path).name) if Path(output_path).suffix == ".json" else str(staging)
    try:
        yield staged
        publish(staging, directory)
    except OSError as error:  # lm-eval's own message names the staging path: name the user's
        raise OSError(str(error).replace(staged, output_path)) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, directory: Path) -> None:
    """Move every file lm-eval wrote under ``staging`` to the same place under ``directory``, after checking each
    is whole (JSON, or JSON lines: lm-eval logs a failed write and carries on) and giving it the user's modes."""
    files = sorted(path for path in staging.rglob("*") if path.is_file())
    for path in files:
        check_whole(path, directory / path.relative_to(staging))
    follow_umask(staging)
    for path in files:
        target = directory / path.relative_to(staging)
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)


def check_whole(path: Path, target: Path) -> None:
    """An OSError naming ``target`` unless lm-eval's file ``path`` is whole: JSON, or JSON lines for a ``.jsonl``."""
    text = path.read_text(encoding="utf-8", errors="replace")
    documents = text.splitlines() if path.suffix == ".jsonl" else [text]
    try:
        for document in documents:
            if document.strip():
                json.loads(document)
    except ValueError as error:
        raise write_error(target, OSError(f"lm-eval wrote it torn ({error}); is the disk full?")) from None


@contextlib.contextmanager
def continuations_fit(model: Any) -> Iterator[None]:
    """lm-eval's assertion that an answer (a continuation) fits the model's context, as one line saying so."""
    try:
        yield
    except AssertionError as error:
        frames = traceback.extract_tb(error.__traceback__)
        if not frames or "continuation_enc" not in (frames[-1].line or ""):
            raise
        raise ValueError(f"a document's answer is longer than the model's context "
                         f"({model.config.max_position_embeddings} tokens), which lm-eval cannot score; allowed: a "
                         "model whose context holds the task's answers, or fewer documents (--limit)") from None


@command()
def run(args: argparse.Namespace) -> int:
    """Check everything, load the model, evaluate, print the table, append the record."""
    check_models([args.model], args)
    if args.log_samples and not args.output_path:
        raise ValueError("--log-samples needs --output-path (where lm-eval writes the samples)")
    check_destinations(args)
    plan = plan_zeroshot(args.tasks, data_dir=args.data_dir, limit=args.limit, batch_size=args.eval_batch_size,
                         source=args.source, metric_map=args.metric_map, num_fewshot=args.num_fewshot,
                         include_path=args.include_path)
    loaded = load_saved_or_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device,
                                 registry=default_registry(), trust_remote_code=args.trust_remote_code)
    with staged_output(args.output_path) as output_path, continuations_fit(loaded.model):
        result = run_zeroshot(loaded.model, loaded.tokenizer, plan, log_samples=args.log_samples,
                              output_path=output_path, model_name=args.model)
    result["output_path"] = args.output_path
    print(format_table(result))
    print(f"source: {result['source']} ({result['source_reason']}); {result['examples']} examples in "
          f"{result['seconds']:.1f} s ({result['examples_per_second']:.1f}/s); lm-eval {result['lm_eval_version']}")
    for note in result["notes"]:
        print(f"note: {note}")
    if args.output_path:
        print(f"lm-eval results{' and samples' if args.log_samples else ''} written under {args.output_path}")
    if args.out:
        record = {"command": "eval", "model_provenance": loaded.provenance,
                  "parameters": parameter_count(loaded.model), "versions": library_versions(), "zeroshot": result}
        append_record(args.out, record)
        print(f"record appended to {args.out}")
    return 0
