"""``rcpu-bench plots``: the paper's figures from a results store (:mod:`rcpu_bench.tables.plots`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rcpu_bench.commands import command
from rcpu_bench.commands.tables import add_lambda_rule_option, add_profile_option, add_results_options, results_dir_of
from rcpu_bench.matrix.store import read_results
from rcpu_bench.paths import check_output_dir
from rcpu_bench.tables.plots import write_plots
from rcpu_bench.tables.results import default_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_results_options(p)
    p.add_argument("--out-dir", metavar="DIR", help="where the figures go (default: <results>/plots)")
    add_profile_option(p)
    add_lambda_rule_option(p)


@command()
def run(args: argparse.Namespace) -> int:
    """Write the figures and print their paths."""
    results_dir = results_dir_of(args)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir / "plots"
    check_output_dir(out_dir, "--out-dir")
    stored = read_results(results_dir)
    paths = write_plots(stored.results, out_dir, args.profile or default_profile(stored.results), args.lambda_rule)
    stored.note_failed()
    if not paths:
        print("rcpu-bench: nothing to plot", file=sys.stderr)
    for path in paths:
        print(path)
    return 0
