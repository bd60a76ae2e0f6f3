"""``rcpu-bench run``: run a benchmark matrix (:mod:`rcpu_bench.matrix.runner`), then print its perplexity table
and draw its plots; ``--dry-run`` lists the cells."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate
from transformers.utils import logging as hf_logging

from rcpu_bench.commands import command
from rcpu_bench.matrix.executors import EXECUTORS
from rcpu_bench.matrix.phases import plan_phases
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import Cell, expand, load_matrix, shipped_matrices
from rcpu_bench.matrix.store import matrix_results_dir, read_results
from rcpu_bench.plugins import default_registry
from rcpu_bench.tables import plots
from rcpu_bench.tables.render import render
from rcpu_bench.tables.results import default_profile
from rcpu_bench.tables.tables import make_tables


def dry_run_table(cells: list[Cell]) -> str:
    """The cells of a matrix, one row each (id, model, method, ratio, n_calib, λ), their count, and the phases
    when λ-grid cells run zero-shot only at λ_best (rcpu_bench.matrix.phases)."""
    rows = [(c.id, c.model_label, c.method_name(), c.ratio, c.n_calib, "" if c.lam is None else f"{c.lam:g}")
            for c in cells]
    table = tabulate(rows, headers=["cell", "model", "method", "ratio", "n_calib", "λ"])
    return "\n".join([table, f"{len(cells)} cells", *plan_phases(cells).describe()])


def report_results(results_dir: Path) -> None:
    """Print the perplexity table of the store (as ``rcpu-bench tables --results DIR --table ppl``) and write the
    plots into ``<results_dir>/plots``."""
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


@command(interrupted="; the finished cells are stored, run the same command to continue")
def run(args: argparse.Namespace) -> int:
    """Exit 0 when every cell is finished, 1 when some failed."""
    matrix = load_matrix(args.matrix, model=args.model, ratios=args.ratios, sets=args.set)
    if args.dry_run:
        print(dry_run_table(expand(matrix, default_registry())))
        return 0
    results = Path(args.results) if args.results else matrix_results_dir(matrix.name)
    if not sys.stdout.isatty():  # a log: the per-cell lines are the progress, no \r bars (model loading's too)
        hf_logging.disable_progress_bar()
    summary = run_matrix(matrix, results, executor=args.executor, resume=args.resume, progress=not args.quiet,
                         ray_address=args.ray_address, announce=print)
    print(f"matrix {matrix.name}: {summary.total} cells, {summary.counts()}; entries in {summary.results_dir}")
    if summary.any_failed:
        print("failed cells are retried by the next run (their tracebacks are in the store)")
    if summary.ok + summary.skipped:
        report_results(summary.results_dir)
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
