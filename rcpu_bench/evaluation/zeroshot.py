"""Accuracy of an in-memory model through lm-eval: the paper's seven tasks, or any lm-eval task or group.

The model is wrapped in lm-eval's ``HFLM`` as it is (no save and reload) and evaluated with
``lm_eval.simple_evaluate`` (0-shot unless ``num_fewshot`` says otherwise). The paper's tasks (BoolQ,
PIQA, HellaSwag, WinoGrande, ARC-Easy, ARC-Challenge, OpenBookQA) have two data sources:

- ``local``: the task configs ``rcpu_<task>`` shipped in ``rcpu_bench/evaluation/tasks``, which copy the
  built-in task's prompt fields, choices, metrics and version and read the shared zero-shot files
  (``<data>/zeroshot``), converted back to the built-in's document fields;
- ``hub``: lm-eval's built-in task configs, which download their datasets from the Hugging Face hub.

``auto`` uses the hub when it can be reached and no offline flag is set, else the local files, and
says which (a warning and the ``source`` / ``source_reason`` fields of the result). lm-eval's response
cache is never used, so two models can never share answers.

Any other name is looked up in lm-eval's task index (its built-in tasks, groups and tags, plus the
YAML files under ``include_path``) and its tasks are built, datasets included, while the request is
checked: a task whose dataset cannot be had (offline flags set, the download failing) is reported by
name before the model is loaded, and an unknown name with its closest registered names.

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

import difflib
import functools
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import constants

from rcpu_bench import console
from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.evaluation.metric_maps import METRIC_MAPS, TASKS, table_metric
from rcpu_bench.finite import check_metrics, finite_logits
from rcpu_bench.paths import data_dir as default_data_dir

logger = logging.getLogger(__name__)

SOURCES = ("auto", "local", "hub")
TASK_DIR = Path(__file__).with_name("tasks")
# The built-in task configs, relative to lm_eval/tasks.
BUILTIN_YAML = {"boolq": "super_glue/boolq/default.yaml", "piqa": "piqa/piqa.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml",
                "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "openbookqa": "openbookqa/openbookqa.yaml"}
HUB_TIMEOUT_S = 3.0
# The bookkeeping fields of a task_summary / paper_summary (the rest are metrics and their stderr).
TASK_FIELDS = ("n", "n_available", "version", "num_fewshot", "lm_eval_task", "metric", "value")
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed; it seeds only the tasks' own samplers
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


def parse_tasks(text: str) -> tuple[str, ...]:
    """Comma-separated task names, without repeats; a ValueError when there are none."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError(f"no task named in {text!r}; give lm-eval task or group names, e.g. {','.join(TASKS)}")
    return names


@functools.cache
def task_manager(include_path: tuple[str, ...] = ()) -> Any:
    """lm-eval's ``TaskManager`` over its built-in task YAMLs and ``include_path`` (indexing takes ~10-20 s).

    Cached per include path: the index only reads YAML files, and each plan builds its own tasks.
    """
    from lm_eval.tasks import TaskManager

    missing = [path for path in include_path if not Path(path).is_dir()]
    if missing:
        raise FileNotFoundError(f"task include path(s) not found: {', '.join(missing)}")
    return TaskManager(include_path=list(include_path) or None)


def check_known(names: tuple[str, ...], manager: Any) -> None:
    """A ValueError naming each unregistered task name with the closest registered names."""
    known = sorted({*TASKS, *manager.all_tasks})
    problems = []
    for name in names:
        if name not in manager.task_index:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            problems.append(f"unknown task {name!r}; close matches: {', '.join(close) if close else 'none'}")
    if problems:
        raise ValueError("; ".join(problems) + " (all names: `lm-eval ls tasks`, or --include-path DIR for your own)")


def build_tasks(names: tuple[str, ...], manager: Any) -> list[Any]:
    """lm-eval Task / Group objects for registered names, their datasets loaded (downloaded if need be).

    A dataset that cannot be had raises a ValueError naming the task and why (an offline flag, the
    download's own error), instead of lm-eval's traceback.
    """
    built = []
    for name in names:
        try:
            loaded = manager.load([name])
        except OSError as error:  # datasets' ConnectionError, DatasetNotFoundError (a FileNotFoundError), ...
            flag = offline_flag()
            why = (f"needs its dataset from the Hugging Face hub (or another download), not available offline ({flag})"
                   if flag else "could not load its dataset (the download failed)")
            raise ValueError(f"task {name!r} {why}: {type(error).__name__}: {error}") from None
        built += top_level(loaded)
    return built


def top_level(loaded: dict[str, Any]) -> list[Any]:
    """The groups and tasks of a ``TaskManager.load`` result that no loaded group contains (what was asked for)."""
    children = {child for names in loaded["group_map"].values() for child in names}
    items = {**loaded["groups"], **loaded["tasks"]}
    return [item for name, item in items.items() if name not in children]


def offline_flag() -> str | None:
    """``"<VARIABLE> is set"`` for the first Hugging Face offline variable set, or None."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").upper() in _TRUE:
            return f"{variable} is set"
    return None


def hub_problem() -> str | None:
    """Why the hub cannot serve the built-in tasks' datasets (an offline flag, no connection), or None."""
    flag = offline_flag()
    if flag:
        return flag
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as error:
        return f"{endpoint.hostname}:{port} is unreachable ({error})"
    return None


def check_source(source: str) -> None:
    """A ValueError unless ``source`` is one of ``SOURCES``."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; allowed: {', '.join(SOURCES)}")


def resolve_source(source: str) -> tuple[str, str]:
    """The source to use (``local`` or ``hub``) for the requested one, and why."""
    check_source(source)
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


def check_count(name: str, value: Any, *, minimum: int = 1) -> None:
    """A ValueError naming ``name`` unless ``value`` is an integer of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class ZeroShotPlan:
    """A checked request: everything except the model, fixed before any work starts.

    ``tasks`` are the paper's tasks asked for (their data from ``source``); ``other`` the other lm-eval
    names asked for, and ``built`` their lm-eval Task / Group objects with the datasets loaded.
    """

    tasks: tuple[str, ...]
    source: str | None
    source_reason: str
    limit: int | None
    batch_size: int
    metric_map: str
    data_dir: Path
    data_files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256 (local source)
    num_fewshot: int | None = None
    other: tuple[str, ...] = ()
    built: tuple[Any, ...] = ()
    include_path: tuple[str, ...] = ()


def plan_zeroshot(tasks: str | tuple[str, ...] | list[str] = TASKS, *, data_dir: str | os.PathLike | None = None,
                  limit: int | None = None, batch_size: int = 16, source: str = "auto",
                  metric_map: str = "paper", num_fewshot: int | None = None,
                  include_path: str | os.PathLike | list | tuple | None = None) -> ZeroShotPlan:
    """Check a request, resolve the paper tasks' data source and build the other tasks; errors name what is allowed.

    ``tasks`` is a sequence of names or one comma-separated string: the paper's tasks (``TASKS``) or
    any task, group or tag in lm-eval's index, extended by the task YAMLs under ``include_path``.
    ``source`` concerns the paper's tasks only; their local data files must exist when the local
    source is used, and their SHA-256 are recorded. Other tasks' datasets are loaded here (a dataset
    that cannot be had is an error naming the task), so nothing fails after the model is loaded.
    """
    names = parse_tasks(tasks if isinstance(tasks, str) else ",".join(tasks))
    if limit is not None:
        check_count("limit (examples per task)", limit)
    if num_fewshot is not None:
        check_count("num_fewshot", num_fewshot, minimum=0)
    check_count("batch size", batch_size)
    if metric_map not in METRIC_MAPS:
        raise ValueError(f"unknown metric map {metric_map!r}; allowed: {', '.join(METRIC_MAPS)}")
    check_source(source)
    paths = tuple(str(path) for path in ([include_path] if isinstance(include_path, (str, os.PathLike))
                                         else include_path or ()))
    paper = tuple(name for name in names if name in TASKS)
    other = tuple(name for name in names if name not in TASKS)
    built: list[Any] = []
    if other:
        manager = task_manager(paths)
        check_known(other, manager)
        built = build_tasks(other, manager)
    used, reason = resolve_source(source) if paper else (None, "no paper task requested")
    root = resolved_data_dir(data_dir)
    files: dict[str, str] = {}
    if used == "local":
        relative = [name for task in paper for name in local_data_files(task)]
        missing = [str(root / name) for name in relative if not (root / name).is_file()]
        if missing:
            raise FileNotFoundError(f"zero-shot data file(s) not found: {', '.join(missing)} "
                                    f"(set --data-dir or $RCPU_BENCH_DATA)")
        files = {name: file_sha256(root / name) for name in relative}
    return ZeroShotPlan(paper, used, reason, limit, batch_size, metric_map, root, files, num_fewshot, other,
                        tuple(built), paths)


def lm_eval_name(task: str, source: str) -> str:
    """The name lm-eval reports the paper task ``task`` under for ``source``."""
    return f"rcpu_{task}" if source == "local" else task


def task_specs(plan: ZeroShotPlan) -> list[Any]:
    """lm-eval task specs: the paper tasks' local configs or built-in YAML files (by path, not by index),
    then the other tasks' built objects."""
    if plan.source == "local":
        paper: list[Any] = [local_task_config(task, plan.data_dir) for task in plan.tasks]
    else:
        paper = [str(builtin_yaml(task)) for task in plan.tasks]
    return paper + list(plan.built)


def task_summary(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """What lm-eval reports for task or group ``name``: every metric (``metric`` for the ``none`` filter,
    ``metric,filter`` for others, stderr as ``<metric>_stderr``), n, n_available, version, num_fewshot."""
    scores = {key.removesuffix(",none"): value for key, value in raw["results"][name].items() if "," in key}
    counts = raw["n-samples"].get(name, {})
    return {**scores, "n": counts.get("effective"), "n_available": counts.get("original"),
            "version": raw["versions"].get(name), "num_fewshot": raw["n-shot"].get(name), "lm_eval_task": name}


def paper_summary(raw: dict[str, Any], task: str, plan: ZeroShotPlan, samples: dict[str, Any]) -> dict[str, Any]:
    """A paper task's ``task_summary`` with the metric its tables show (``metric``), its ``value``, and that metric
    per document in document order (``items``: what a paired bootstrap or McNemar test of two runs compares)."""
    name = lm_eval_name(task, plan.source)
    summary = task_summary(raw, name)
    metric = table_metric(task, plan.metric_map)
    return {**summary, "metric": metric, "value": summary[metric], "items": item_scores(samples[name], metric)}


def item_scores(samples: list[dict[str, Any]], metric: str) -> list[float]:
    """The metric of each document of one task's lm-eval samples, ordered by ``doc_id`` (accuracies are 0 or 1)."""
    return [float(sample[metric]) for sample in sorted(samples, key=lambda sample: sample["doc_id"])]


def fewshot_notes(plan: ZeroShotPlan) -> list[str]:
    """Where few-shot examples come from when that differs from lm-eval's built-in tasks (logged too)."""
    if plan.source != "local" or not plan.num_fewshot:
        return []
    note = (f"{plan.num_fewshot}-shot on the local copies of {', '.join(plan.tasks)}: their files hold only the "
            "evaluated split, so lm-eval draws the examples from it (never the document itself); the built-in "
            "tasks draw them from their training split")
    logger.warning("%s", note)
    return [note]


def check_output_path(output_path: str | os.PathLike) -> None:
    """Refuse an ``output_path`` lm-eval could not write to, before any work: lm-eval creates the directory
    ``output_path`` (or the parent of a ``.json`` path), so its nearest existing ancestor must be a writable
    directory."""
    path = Path(output_path).expanduser()
    target = path.parent if path.suffix == ".json" else path
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise NotADirectoryError(f"output path {output_path}: {existing} is a file, so lm-eval cannot create "
                                 f"{target} there; give a directory or a .json file in a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"output path {output_path}: the directory {existing} is not writable")


def save_lm_eval_outputs(tracker: Any, raw: dict[str, Any], samples: dict[str, Any] | None, output_path: Path) -> None:
    """Write lm-eval's results (and samples) files, then check the results file is there: lm-eval's tracker logs a
    failed write as a warning and carries on, which must not pass for a written file."""
    tracker.save_results_aggregated(results=raw, samples=samples)
    for name in (samples or {}):
        tracker.save_results_samples(task_name=name, samples=samples[name])
    date_id = getattr(tracker, "date_id", None)
    folder = output_path.parent if output_path.suffix == ".json" else (
        output_path / str(tracker.general_config_tracker.model_name_sanitized))
    name = f"{output_path.stem}_{date_id}.json" if output_path.suffix == ".json" else f"results_{date_id}.json"
    if date_id is None or not (folder / name).is_file():
        raise OSError(f"lm-eval could not write its results under {output_path} (see its warning above)")


def run_zeroshot(model: Any, tokenizer: Any, plan: ZeroShotPlan, *, log_samples: bool = False,
                 output_path: str | os.PathLike | None = None, model_name: str | None = None) -> dict[str, Any]:
    """Evaluate ``model`` as it is in memory on a checked plan; the result record (see ``evaluate_zeroshot``).

    ``output_path`` (a directory or a ``.json`` file) and ``log_samples`` have lm-eval's meanings: its
    results file (and with ``log_samples`` one JSONL of per-document samples per task) is written there,
    under ``model_name`` as lm-eval's command line would; nothing is written without ``output_path``.
    """
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from rcpu_bench.evaluation.lm_eval_model import BoundedHFLM

    if log_samples and output_path is None:
        raise ValueError("log_samples needs an output_path to write the samples to")
    if output_path is not None:
        check_output_path(output_path)
    lm = BoundedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=plan.batch_size,
                     max_length=model.config.max_position_embeddings)
    if not console.showing_bars():  # lm-eval's request bars follow --quiet and the terminal as ours do
        for request_type in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, request_type, functools.partial(getattr(lm, request_type), disable_tqdm=True))
    tracker = EvaluationTracker(output_path=str(output_path)) if output_path is not None else None
    notes = fewshot_notes(plan)
    started = time.perf_counter()
    # No use_cache / cache_requests: lm-eval's caches are keyed by request, not by model. Global seeds None:
    # the caller's random state is left alone; the few-shot seed is lm-eval's default and private to the tasks.
    with finite_logits(model, "zero-shot evaluation"):
        raw = lm_eval.simple_evaluate(model=lm, model_args=f"pretrained={model_name}" if model_name else None,
                                      tasks=task_specs(plan), task_manager=TaskManager(include_defaults=False),
                                      num_fewshot=plan.num_fewshot, limit=plan.limit, log_samples=True,
                                      evaluation_tracker=tracker, random_seed=None, numpy_random_seed=None,
                                      torch_random_seed=None, fewshot_random_seed=FEWSHOT_SEED)
    seconds = time.perf_counter() - started
    samples = raw.pop("samples")  # always logged: the paper tasks' per-document scores join the record
    if tracker is not None:
        save_lm_eval_outputs(tracker, raw, samples if log_samples else None, Path(output_path))
    tasks = {task: paper_summary(raw, task, plan, samples) for task in plan.tasks}
    paper_names = {lm_eval_name(task, plan.source) for task in plan.tasks}
    tasks.update({name: task_summary(raw, name) for name in raw["results"] if name not in paper_names})
    for name, summary in tasks.items():
        check_metrics({k: v for k, v in summary.items() if "_stderr" not in k}, f"zero-shot task {name}")
    examples = sum(raw["n-samples"][name]["effective"] for name in raw["n-samples"])
    return {"tasks": tasks, "metric_map": plan.metric_map,
            "metrics": {task: table_metric(task, plan.metric_map) for task in plan.tasks},
            "mean": sum(tasks[task]["value"] for task in plan.tasks) / len(plan.tasks) if plan.tasks else None,
            "lm_eval_version": metadata.version("lm_eval"), "source": plan.source,
            "source_reason": plan.source_reason, "other_tasks": list(plan.other),
            "include_path": list(plan.include_path), "num_fewshot": plan.num_fewshot, "notes": notes,
            "batch_size": plan.batch_size, "limit": plan.limit,
            "max_length": lm.max_length, "seconds": seconds, "examples": examples,
            "examples_per_second": examples / seconds, "output_path": None if output_path is None else str(output_path),
            "data_dir": str(plan.data_dir) if plan.source == "local" else None, "data_files": plan.data_files}


def evaluate_zeroshot(model: Any, tokenizer: Any, tasks: str | tuple[str, ...] | list[str] = TASKS, *,
                      data_dir: str | os.PathLike | None = None, limit: int | None = None, batch_size: int = 16,
                      source: str = "auto", metric_map: str = "paper", num_fewshot: int | None = None,
                      include_path: str | os.PathLike | list | tuple | None = None) -> dict[str, Any]:
    """Accuracy of an in-memory causal LM on ``tasks`` through lm-eval (0-shot unless ``num_fewshot``).

    ``tasks``: the paper's seven (default) or any lm-eval task / group / tag names, with the task YAMLs
    under ``include_path`` added to lm-eval's index; ``limit`` takes the first N documents of each
    task; ``source`` is ``auto``, ``local`` or ``hub`` for the paper's tasks (module docstring);
    ``metric_map`` (``paper`` or ``slicegpt``, see ``table_metric``) picks the metric a table shows
    per paper task. Returns ``tasks`` (per task or group as lm-eval names it, the paper tasks under
    their own names: every metric with its ``_stderr``, n, n_available, version, num_fewshot,
    lm_eval_task, and for the paper tasks metric and value), ``mean`` of the paper tasks' values (None
    without one), and the run's lm_eval_version, source, source_reason, other_tasks, include_path,
    num_fewshot, notes, batch_size, limit, max_length, seconds, examples, examples_per_second,
    output_path, data_dir and data_files (relative path -> sha256).
    """
    plan = plan_zeroshot(tasks, data_dir=data_dir, limit=limit, batch_size=batch_size, source=source,
                         metric_map=metric_map, num_fewshot=num_fewshot, include_path=include_path)
    return run_zeroshot(model, tokenizer, plan)
