"""``rcpu-bench eval``: zero-shot accuracy (any lm-eval task) of a model or a saved pruned directory, and the
per-task table it prints (:mod:`rcpu_bench.evaluation.zeroshot` does the evaluation)."""

from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from rcpu_bench import console, experiment_options
from rcpu_bench.commands import command
from rcpu_bench.commands.shared import check_models
from rcpu_bench.evaluation.metric_maps import METRIC_MAPS, TASKS
from rcpu_bench.evaluation.zeroshot import SOURCES, TASK_FIELDS, check_output_path, plan_zeroshot, run_zeroshot
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.model.persistence import load_saved_or_model
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
    experiment_options.add_arguments(p, experiment_options.MODEL)
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
    experiment_options.add_arguments(p, ["eval_batch_size"])
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="data of the seven paper tasks: local files, the hub's datasets, or the hub when "
                   "reachable else local")
    p.add_argument("--metric-map", choices=tuple(METRIC_MAPS), default="paper",
                   help="metric per task in the table and the mean")
    p.add_argument("--data-dir", help="data directory (default: $RCPU_BENCH_DATA or ../shared/data)")
    p.add_argument("--out", metavar="JSONL", help="append the result record to this file")
    console.add_quiet_option(p)


@command()
def run(args: argparse.Namespace) -> int:
    """Check everything, load the model, evaluate, print the table, append the record."""
    check_models([args.model], args)
    if args.log_samples and not args.output_path:
        raise ValueError("--log-samples needs --output-path (where lm-eval writes the samples)")
    if args.output_path:
        check_output_path(args.output_path)
    plan = plan_zeroshot(args.tasks, data_dir=args.data_dir, limit=args.limit, batch_size=args.eval_batch_size,
                         source=args.source, metric_map=args.metric_map, num_fewshot=args.num_fewshot,
                         include_path=args.include_path)
    loaded = load_saved_or_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device,
        registry=default_registry(),
                                 trust_remote_code=args.trust_remote_code)
    result = run_zeroshot(loaded.model, loaded.tokenizer, plan, log_samples=args.log_samples,
                          output_path=args.output_path, model_name=args.model)
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
