"""``rcpu-bench run``: run a benchmark matrix (:mod:`rcpu_bench.matrix.runner`), then print its perplexity table
and draw its plots; ``--dry-run`` lists the cells. With ``--report-to`` (or the matrix's ``report_to``) each cell
the run stores is logged to the experiment trackers, and at the end the matrix's tables and figures
(:mod:`rcpu_bench.tracking`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tabulate import tabulate
from transformers.utils import logging as hf_logging

from rcpu_bench.commands import command
from rcpu_bench.declaration import add_argument
from rcpu_bench.matrix.executors import EXECUTORS
from rcpu_bench.matrix.phases import PHASE_LAMBDA_BEST, plan_phases
from rcpu_bench.matrix.runner import RunSummary, run_matrix
from rcpu_bench.matrix.spec import BY_KEY, Cell, expand, load_matrix, shipped_matrices
from rcpu_bench.matrix.store import Entry, matrix_results_dir, read_results
from rcpu_bench.plugins import default_registry
from rcpu_bench.tables import plots
from rcpu_bench.tables.render import render
from rcpu_bench.tables.results import default_profile
from rcpu_bench.tables.tables import make_tables
from rcpu_bench.tracking.content import cell_run, matrix_run
from rcpu_bench.tracking.trackers import Trackers, open_trackers


def dry_run_table(cells: list[Cell]) -> str:
    """The cells of a matrix, one row each (id, model, method, ratio, n_calib, λ), their count, and the phases
    when λ-grid cells run zero-shot only at λ_best (rcpu_bench.matrix.phases)."""
    rows = [(c.id, c.model_label, c.method_name(), c.ratio, c.n_calib, "" if c.lam is None else f"{c.lam:g}")
            for c in cells]
    table = tabulate(rows, headers=["cell", "model", "method", "ratio", "n_calib", "λ"])
    return "\n".join([table, f"{len(cells)} cells", *plan_phases(cells).describe()])


def report_results(results_dir: Path, trackers: Trackers, name: str | None) -> None:
    """Print the perplexity table of the store (as ``rcpu-bench tables --results DIR --table ppl``) and write the
    plots into ``<results_dir>/plots``; ``name``: log every table and the plots to ``trackers`` as the matrix's
    end (None: not logged, nothing new ran)."""
    results = read_results(results_dir).results
    profile = default_profile(results)
    try:
        print(render(make_tables(results, "ppl", profile=profile)), end="")
        written = plots.write_plots(results, results_dir / "plots", profile)
    except ValueError as error:  # e.g. no cell evaluated that profile
        print(f"no table or plots: {error}")
        return
    print(f"plots ({len(written)} files: PNG, PDF, SVG) in {results_dir / 'plots'}; all tables: "
          f"rcpu-bench tables --results {results_dir}")
    if trackers and name is not None:
        tables = render(make_tables(results, "all", profile=profile))
        trackers.log(matrix_run(name, tables=tables, figures=written, figures_dir=results_dir / "plots"))


def log_cell(trackers: Trackers, matrix: str) -> Callable[[Entry, Cell], None]:
    """What the runner calls with each stored entry: the cell's run logged to ``trackers``, named by the cell's id
    and label."""
    def observe(entry: Entry, cell: Cell) -> None:
        phase = " (zero-shot at λ_best)" if entry.phase == PHASE_LAMBDA_BEST else ""
        trackers.log(cell_run(entry.to_json(), name=f"{entry.cell_id} {cell.describe()}{phase}", group=matrix))
    return observe


def ran(summary: RunSummary) -> bool:
    """Whether this run stored any entry (ok or failed)."""
    return bool(summary.ok + summary.failed + summary.best_ok + summary.best_failed)


@command(interrupted="; the finished cells are stored, run the same command to continue")
def run(args: argparse.Namespace) -> int:
    """Exit 0 when every cell is finished, 1 when some failed."""
    matrix = load_matrix(args.matrix, model=args.model, ratios=args.ratios, sets=args.set)
    if args.dry_run:
        print(dry_run_table(expand(matrix, default_registry())))
        return 0
    results = Path(args.results) if args.results else matrix_results_dir(matrix.name)
    trackers = open_trackers(matrix.report_to if args.report_to is None else args.report_to, local_dir=results,
                             local_flag="--results DIR")
    if not sys.stdout.isatty():  # a log: the per-cell lines are the progress, no \r bars (model loading's too)
        hf_logging.disable_progress_bar()
    summary = run_matrix(matrix, results, executor=args.executor, resume=args.resume, progress=not args.quiet,
                         ray_address=args.ray_address, announce=print,
                         observe=log_cell(trackers, matrix.name) if trackers else None)
    print(f"matrix {matrix.name}: {summary.total} cells, {summary.counts()}; entries in {summary.results_dir}")
    if summary.any_failed:
        print("failed cells are retried by the next run (their tracebacks are in the store)")
    if summary.ok + summary.skipped:
        report_results(summary.results_dir, trackers, matrix.name if ran(summary) else None)
    for line in trackers.where():
        print(line)
    return 1 if summary.any_failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", required=True,
                   help=f"a shipped matrix ({', '.join(shipped_matrices())}) or a matrix YAML file")
    p.add_argument("--results", metavar="DIR", help="results directory (default: results/<matrix name>)")
    p.add_argument("--executor", default="local", choices=EXECUTORS,
                   help="local: one cell after another here; ray: one Ray task per cell")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip cells already finished in the results directory")
    p.add_argument("--model", metavar="PATH_OR_ID", help="run on this model instead of the matrix's models")
    p.add_argument("--ratios", metavar="R1,R2", help="pruning ratios instead of the matrix's, e.g. 0.1,0.2")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a (dotted) matrix key with a YAML value, e.g. calib.n_calib=[8] (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="list the cells without running them")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="address of a running Ray cluster (default: start a local one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-cell lines")
    add_argument(p, BY_KEY["report_to"])
    p.set_defaults(report_to=None)  # the matrix's report_to
