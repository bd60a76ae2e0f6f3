"""Run a benchmark matrix: check every cell first, skip the finished ones, run the rest, store each as it ends.

Each finished cell is appended (and fsynced) to ``<results_dir>/records.jsonl`` the moment it ends, so
Ctrl-C or a SIGKILL loses only the cell in progress; a rerun skips the cells whose newest entry is ok
and retries the failed ones. One failing cell is recorded with its traceback and the run goes on.
λ-grid cells that ask for zero-shot run it only at λ_best, in a second phase (rcpu_bench.matrix.phases).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from tqdm.auto import tqdm

from rcpu_bench.experiment import Inputs
from rcpu_bench.matrix.executors import Executor, make_executor
from rcpu_bench.matrix.fingerprints import Fingerprints, changes, stored_fingerprint
from rcpu_bench.matrix.phases import (
    PHASE_LAMBDA_BEST,
    PhasePlan,
    lambda_best_entry,
    phase1_entries,
    phase2_cell,
    plan_phases,
)
from rcpu_bench.matrix.spec import (
    Cell,
    Matrix,
    MatrixError,
    error_message,
    expand,
)
from rcpu_bench.matrix.store import (
    RECORDS,
    Entry,
    Store,
    StoredResult,
    read_results,
)
from rcpu_bench.model.loading import load_config
from rcpu_bench.paths import check_output_dir
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.methods import percent
from rcpu_bench.pruning.pipeline import PruneConfig
from rcpu_bench.registry import Registry

log = logging.getLogger(__name__)

# Seconds per cell assumed for a model with no cell stored yet, by parameter count (upper bound, seconds):
# stories260K on a 2-core CPU with the smoke matrix's evaluation subset, then rough guesses for a 1B model on a
# CPU and for 7B/13B models on one GPU with the full rcpu128 evaluation. Only an estimate.
DEFAULT_CELL_SECONDS = ((10e6, 6.0), (1.5e9, 300.0), (10e9, 900.0), (float("inf"), 1800.0))


def preflight(cells: list[Cell], registry: Registry, *, here: bool = True) -> None:
    """Every check that needs no model weights, before the first cell runs, each once.

    ``expand`` checked each cell's options (``Experiment.check_options``); here the inputs of each distinct setting
    of the rest of the experiment (model, calibration and hold-out count, profiles, dtype, device:
    ``Experiment.check_inputs``), each cell's budgets against its model's weightless skeleton
    (``Experiment.check_budget``), the zero-shot tasks' data once when a cell asks for them, llama-cpp-python and
    the models' GGUF export when a cell asks for llama.cpp speed. The cells then run without checking again
    (``run_experiment(..., validated=True)``).
    ``here``: the cells run in this process, so their device must exist here (not so for a Ray cluster's
    workers).
    """
    checked: set[str] = set()
    inputs: dict[tuple[str, str | None], Inputs] = {}
    for cell in cells:
        try:
            experiment = cell.experiment()
            held_out = PruneConfig(holdout=experiment.prune.holdout)  # checked against the source per setting
            setting = json.dumps(replace(experiment, prune=held_out).to_dict(), sort_keys=True, default=str)
            if setting not in checked:
                inputs.setdefault((experiment.model, experiment.revision), experiment.check_inputs(here=here))
                checked.add(setting)
            experiment.check_budget(inputs[experiment.model, experiment.revision], registry)
        except (ValueError, KeyError, OSError) as error:
            where = f"cell {cell.id} ({cell.describe()}, model {cell.model})"
            raise MatrixError(f"{where}: {error_message(error)}") from None
    if any("zeroshot" in cell.eval for cell in cells):
        from rcpu_bench.evaluation.zeroshot import (
            plan_zeroshot,  # lm-eval: imported only when asked for
        )

        try:
            plan_zeroshot()
        except (ValueError, OSError) as error:
            raise MatrixError(f"eval zeroshot: {error}") from None
    if any("speed-llama-cpp" in cell.eval for cell in cells):
        from rcpu_bench.evaluation.speed_llama_cpp import require_llama_cpp
        from rcpu_bench.export.gguf import check_config

        try:
            require_llama_cpp()
            for name, revision in dict.fromkeys((cell.experiment().model, cell.revision) for cell in cells
                                                if "speed-llama-cpp" in cell.eval):
                check_config(load_config(name, revision)[0])
        except (ImportError, ValueError) as error:
            raise MatrixError(f"eval speed-llama-cpp: {error}") from None


@dataclass
class RunSummary:
    """What a run did: cells in the matrix, finished ok or failed now, skipped as already finished; with λ groups
    (rcpu_bench.matrix.phases), the zero-shot runs at λ_best likewise, and the groups waiting for failed cells."""

    results_dir: Path
    total: int
    skipped: int
    ok: int = 0
    failed: int = 0
    groups: int = 0
    best_ok: int = 0
    best_failed: int = 0
    best_skipped: int = 0
    best_waiting: int = 0

    def add(self, entry: Entry) -> None:
        ok = entry.ok
        if entry.phase == PHASE_LAMBDA_BEST:
            self.best_ok, self.best_failed = self.best_ok + ok, self.best_failed + (not ok)
        else:
            self.ok, self.failed = self.ok + ok, self.failed + (not ok)

    @property
    def any_failed(self) -> bool:
        return bool(self.failed or self.best_failed)

    def counts(self) -> str:
        cells = f"ok={self.ok} failed={self.failed} skipped={self.skipped}"
        if not self.groups:
            return cells
        return (f"{cells}; zero-shot at λ_best: ok={self.best_ok} failed={self.best_failed} "
                f"skipped={self.best_skipped} waiting={self.best_waiting}")


def _outcome(entry: Entry) -> str:
    """The perplexities of an ok entry, or the error type and first message line of a failed one; for a zero-shot
    run at λ_best, how many λ it was chosen from and whether the re-pruned model reproduced phase 1."""
    if not entry.ok:
        error = entry.error or {"type": "error", "message": ""}
        return f"{error['type']}: {(error['message'].splitlines() or [''])[0]}"
    record = entry.record
    if entry.phase == PHASE_LAMBDA_BEST and entry.reproduced is not None:
        first, again = entry.reproduced["calibration_ppl"]
        same = "identical" if entry.reproduced["identical"] else f"NOT identical: calibration {first} vs {again}"
        return f"zero-shot at λ_best of {len(entry.chosen_from or [])} λ (re-pruned model {same})"
    assert record is not None  # an ok entry has its record
    ppl = [f"{p.profile} {p.ppl:.3f}" for p in record.perplexity]
    calibration = record.calibration_ppl  # None: skipped
    return ", ".join([*ppl, *([f"calibration {calibration:.3f}"] if calibration is not None else [])])


class Progress:
    """A bar over the cells to run (with ETA) whose postfix shows the current cell and the counts; a line per cell.

    The bar is drawn only on a terminal; otherwise (a log file, a pipe) the per-cell lines are the progress."""

    def __init__(self, summary: RunSummary, cells: list[Cell], name: str, enabled: bool):
        self.summary, self.enabled = summary, enabled
        self.cells = {cell.id: cell for cell in cells}
        self.bar = tqdm(total=len(cells), desc=f"matrix {name}", unit="cell",
                        disable=not (enabled and sys.stdout.isatty()), file=sys.stdout)

    def started(self, cell: Cell) -> None:
        self.bar.set_postfix_str(f"{self.summary.counts()} | {cell.describe()}")

    def finished(self, entry: Entry) -> None:
        self.bar.update()
        self.bar.set_postfix_str(self.summary.counts())
        if self.enabled:
            cell = self.cells[entry.cell_id]
            self.bar.write(f"[{entry.status:>6}] {entry.cell_id} {cell.describe()}: {_outcome(entry)} "
                           f"({entry.seconds:.1f} s)", file=sys.stdout)

    def close(self) -> None:
        self.bar.close()


def _model_parameters(cell: Cell) -> float:
    """The dense model's parameter count from its config alone: L·(4·d·d_attn + 3·d·d_ff) + V·d (·2 untied)."""
    config, _ = load_config(cell.experiment().model, cell.revision)
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    attention = d * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return layers * (attention + 3 * d * config.intermediate_size) + embeddings


def default_cell_seconds(parameters: float) -> float:
    """DEFAULT_CELL_SECONDS for a model of ``parameters`` parameters."""
    return next(seconds for bound, seconds in DEFAULT_CELL_SECONDS if parameters <= bound)


def estimate_seconds(todo: Sequence[Cell], stored: Sequence[StoredResult]) -> tuple[float, str]:
    """(seconds, how they were estimated) for running ``todo``: per cell, the mean seconds of the finished cells of
    the same model already in the store, else DEFAULT_CELL_SECONDS for the model's size."""
    seconds: dict[str, list[float]] = {}
    for result in stored:
        seconds.setdefault(result.cell.model_label, []).append(result.seconds)
    total, sources = 0.0, []
    for label, cells in _by_model(todo).items():
        if label in seconds:
            per_cell = fmean(seconds[label])
            sources.append(f"{label}: {per_cell:.1f} s/cell, the mean of its {len(seconds[label])} stored cells")
        else:
            per_cell = default_cell_seconds(_model_parameters(cells[0]))
            sources.append(f"{label}: {per_cell:g} s/cell, the default for its size (no cell stored yet)")
        total += per_cell * len(cells)
    return total, "; ".join(sources)


def _by_model(cells: Sequence[Cell]) -> dict[str, list[Cell]]:
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.model_label, []).append(cell)
    return groups


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def plan_text(matrix: Matrix, cells: Sequence[Cell], todo: Sequence[Cell], store: Store,
              plan: PhasePlan | None = None) -> str:
    """What a run will do: the matrix, its models, methods and ratios, the cells to run and finished, the phases
    when λ-grid cells wait for λ_best, where the results go and an estimate of the time (a zero-shot run at
    λ_best counts as a cell)."""
    plan = plan or plan_phases(cells)
    ratios = sorted({cell.ratio for cell in cells})
    phase2 = plan.phase2(store.entries())
    best = [b.cell for b in phase2.todo] + [group[0] for group in phase2.waiting]
    lines = [f"matrix {matrix.name}: models {', '.join(_by_model(cells))}",
             f"  methods: {', '.join(dict.fromkeys(cell.method_label for cell in cells))}",
             f"  ratios: {', '.join(percent(r) for r in ratios)}",
             f"  {len(cells)} cells: {len(todo)} to run, {len(cells) - len(todo)} already finished",
             *(f"  {line}" for line in plan.describe()),
             f"  results: {store.dir / RECORDS}"]
    if plan.groups:
        lines.insert(-1, f"  zero-shot at λ_best: {len(best)} of {len(plan.groups)} groups to run")
    if todo or best:
        seconds, how = estimate_seconds([*todo, *best], read_results(store.dir, missing_ok=True).results)
        lines.append(f"  estimated time: about {_duration(seconds)} (an estimate; {how})")
    return "\n".join(lines)


def run_matrix(matrix: Matrix, results_dir: str | Path, executor: str = "local", resume: bool = True,
               progress: bool = True, *, registry: Registry | None = None,
               ray_address: str | None = None, announce: Callable[[str], None] | None = None,
               observe: Callable[[Entry, Cell], None] | None = None) -> RunSummary:
    """Run every cell of ``matrix`` not yet finished in ``results_dir`` and store each entry as it ends.

    The whole matrix is validated before any cell runs. ``resume=False`` reruns finished cells too
    (the newest entry wins). ``registry`` defaults to the installed plugins. ``announce`` receives the
    plan (:func:`plan_text`) before the first cell runs. λ-grid cells that ask for zero-shot run it only at
    λ_best, after every cell of their group has its perplexity (two phases, rcpu_bench.matrix.phases).
    ``observe(entry, cell)`` is called with each entry this run stores, once it is stored, and its matrix cell (the
    experiment trackers: finished cells that are skipped are not stored again, so not observed again).
    """
    registry = registry or default_registry()
    check_output_dir(results_dir, "results directory")
    cells = expand(matrix, registry)
    preflight(cells, registry, here=executor == "local")
    cell_runner = make_executor(executor, ray_address=ray_address)
    plan = plan_phases(cells)
    store = Store(results_dir)
    fingerprints = Fingerprints()
    with store.writing() as append:
        finished = phase1_entries(store.entries()) if resume else {}
        changed = changed_cells([cell for cell in cells if cell.id in finished], finished, fingerprints)
        todo = [cell for cell in cells if cell.id not in finished or cell.id in changed]
        summary = RunSummary(store.dir, len(cells), skipped=len(cells) - len(todo), groups=len(plan.groups))
        if announce:
            announce(plan_text(matrix, cells, todo, store, plan))
        phase = _Phase(cell_runner, registry, summary, append, progress, fingerprints, observe)
        phase.run(f"matrix {matrix.name}", [(plan.phase1_cell(cell), cell) for cell in todo], plan.phase1_entry)
        if plan.groups:
            phase2 = plan.phase2(store.entries())
            summary.best_skipped, summary.best_waiting = phase2.done, len(phase2.waiting)
            phase.run(f"matrix {matrix.name} λ_best", [(phase2_cell(best), best) for best in phase2.todo],
                      lambda_best_entry)
    return summary


def changed_cells(cells: Sequence[Cell], finished: dict[str, Entry], fingerprints: Fingerprints) -> set[str]:
    """Ids of the finished ``cells`` whose stored entry was computed from other content than the model and
    calibration data now at their paths (rcpu_bench.matrix.fingerprints): reported, and run again."""
    changed, unchecked = set(), 0
    for cell in cells:
        entry = finished[cell.id]
        differs = changes(entry, fingerprints.of(cell))
        if differs:
            changed.add(cell.id)
            log.warning("cell %s (%s): its %s changed since it was stored; running it again",
                        cell.id, cell.describe(), " and ".join(differs))
        unchecked += "model" not in stored_fingerprint(entry)
    if unchecked:
        log.warning("%d finished cells were stored without a model fingerprint (before rcpu-bench recorded one): "
                    "reused by model path; run with --no-resume to recompute them", unchecked)
    return changed


@dataclass
class _Phase:
    """Runs one phase's cells and stores their entries as they end."""

    cell_runner: Executor
    registry: Registry
    summary: RunSummary
    append: Callable[[Entry], None]
    progress: bool
    fingerprints: Fingerprints
    observe: Callable[[Entry, Cell], None] | None = None

    def run(self, name: str, jobs: Sequence[tuple[Cell, Any]],
            to_entry: Callable[[Entry, Any], Entry]) -> None:
        """Run the cell of each (cell, target) job; the store gets ``to_entry(entry, target)``, where the target
        is the matrix cell (phase 1) or the λ_best choice (phase 2)."""
        if not jobs:
            return
        targets = {cell.id: target for cell, target in jobs}
        shown = Progress(self.summary, [getattr(t, "cell", t) for t in targets.values()], name, self.progress)
        with closing(shown), closing(self.cell_runner.run([cell for cell, _ in jobs], self.registry,
                                                          shown.started)) as entries:
            for run in entries:
                target = targets[run.cell_id]
                cell = getattr(target, "cell", target)
                entry = to_entry(run, target)
                if entry.ok:
                    entry.fingerprint = self._fingerprint(cell)
                self.append(entry)
                self.summary.add(entry)
                shown.finished(entry)
                if self.observe is not None:
                    self.observe(entry, cell)

    def _fingerprint(self, cell: Cell) -> dict[str, str] | None:
        """The cell's fingerprint; None, with a warning, when its files cannot be read now (the entry is kept)."""
        try:
            return self.fingerprints.of(cell)
        except (OSError, ValueError) as error:
            log.warning("cell %s: no fingerprint stored (%s); a rerun reuses it by path", cell.id, error)
            return None
