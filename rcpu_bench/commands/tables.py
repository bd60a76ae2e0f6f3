"""``rcpu-bench tables``: the paper's tables from a results store (:mod:`rcpu_bench.tables.tables`), and the
options of every command that reads a store (``tables``, ``plots``)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from rcpu_bench.atomic_file import write_file_atomically
from rcpu_bench.commands import command
from rcpu_bench.evaluation.metric_maps import METRIC_MAPS
from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE, LAMBDA_RULES
from rcpu_bench.matrix.spec import load_matrix
from rcpu_bench.matrix.store import RECORDS, RESULTS_ROOT, matrix_results_dir, read_results
from rcpu_bench.paths import check_not_input, check_output_file
from rcpu_bench.tables.layout import TABLE_KINDS, selected
from rcpu_bench.tables.paper import read_paper
from rcpu_bench.tables.render import FORMATS, render
from rcpu_bench.tables.results import PAPER_PROFILE, default_profile, without_profile
from rcpu_bench.tables.tables import PROFILE_TABLES, make_tables


def add_results_options(parser: Any) -> None:
    """``--results DIR`` or ``--matrix NAME`` (its default results directory), for the commands that read a store."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results", metavar="DIR", help=f"results directory holding {RECORDS}")
    where.add_argument("--matrix", metavar="NAME_OR_YAML",
                       help=f"read the results directory that `rcpu-bench run --matrix` writes: {RESULTS_ROOT}/<name>")


def results_dir_of(args: Any) -> Path:
    """The results directory named by ``--results`` or ``--matrix``; neither is a ValueError saying what to give."""
    if args.results:
        return Path(args.results)
    if args.matrix:
        return matrix_results_dir(load_matrix(args.matrix).name)
    raise ValueError(f"say which results to read: --results DIR, or --matrix NAME for {RESULTS_ROOT}/<matrix name> "
                     "(where `rcpu-bench run --matrix NAME` writes)")


def add_profile_option(parser: Any) -> None:
    parser.add_argument("--profile", help=f"perplexity profile shown (default: {PAPER_PROFILE}; without it the "
                        f"store's {PAPER_PROFILE}[START:STOP] subset, else its first profile)")


def add_lambda_rule_option(parser: Any) -> None:
    rules = "; ".join(f"{name}: {meaning}" for name, meaning in LAMBDA_RULES.items())
    parser.add_argument("--lambda-rule", default=DEFAULT_LAMBDA_RULE, choices=list(LAMBDA_RULES),
                        help=f"how λ_best is chosen from a ridge λ grid ({rules})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_results_options(p)
    p.add_argument("--format", default="md", choices=FORMATS, help="Markdown, LaTeX (booktabs) or CSV")
    p.add_argument("--reference", choices=["paper"], help="put the paper's numbers beside ours where it has them")
    add_profile_option(p)
    p.add_argument("--table", default="all", choices=[*TABLE_KINDS, "all"],
                   help="which table(s); the *-other kinds hold the scorer × compensator combinations that are none "
                        "of the paper's methods")
    p.add_argument("--metric-map", default="paper", choices=list(METRIC_MAPS),
                   help="zero-shot metric per task (acc or acc_norm)")
    add_lambda_rule_option(p)
    p.add_argument("--rows", metavar="REGEX", help="only the rows whose label fully matches this regular expression "
                   "(e.g. 'RCPU.*|FLAP'); a ranking then compares these rows alone")
    p.add_argument("--ratios", metavar="R1,R2", type=ratio_list, help="only the rows of these pruning ratios")
    p.add_argument("--out", metavar="FILE", help="write to this file instead of stdout")


def ratio_list(text: str) -> tuple[float, ...]:
    """``0.1,0.2``: pruning ratios."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: ratios separated by commas, e.g. "
                                         "0.1,0.2") from None


def row_pattern(text: str | None) -> str | None:
    """``--rows``: a regular expression (ValueError naming it when it does not compile)."""
    if text is not None:
        try:
            re.compile(text)
        except re.error as error:
            raise ValueError(f"--rows {text!r} is not a regular expression ({error}); allowed: e.g. "
                             "'RCPU.*|FLAP'") from None
    return text


def check_out(out: str, results_dir: Path) -> None:
    """``--out``: writable (tried by creating and removing a file) and not the results store the tables are read
    from."""
    check_not_input(out, [results_dir / RECORDS], "--out file")
    check_output_file(out, "--out file")


def note_left_out(results: Any, unranked: list[str], profile: str, table: str) -> None:
    """Tell stderr which runs the tables leave out and why: runs without the perplexity profile shown (where a
    perplexity table was asked for), and the ``unranked`` runs a ranking could not compare."""
    count, profiles = without_profile(results, profile)
    if count and table in PROFILE_TABLES:
        print(f"rcpu-bench: {count} run{'s' * (count > 1)} with no perplexity under {profile} are left out of its "
              f"perplexity tables (they have {', '.join(profiles)}; --profile shows one)", file=sys.stderr)
    if unranked:
        print(f"rcpu-bench: {len(unranked)} run{'s' * (len(unranked) > 1)} not ranked: " + "; ".join(unranked),
              file=sys.stderr)


@command()
def run(args: argparse.Namespace) -> int:
    """Render the tables; skipped failed entries are counted on stderr."""
    results_dir = results_dir_of(args)
    if args.out:
        check_out(args.out, results_dir)
    rows = row_pattern(args.rows)
    stored = read_results(results_dir)
    paper = read_paper() if args.reference == "paper" else None
    profile = args.profile or default_profile(stored.results)
    unranked: list[str] = []
    results = selected(stored.results, rows, args.ratios)
    tables = make_tables(results, args.table, profile=profile, metric_map=args.metric_map, paper=paper,
                         lambda_rule=args.lambda_rule, left_out=unranked)
    text = render(tables, args.format)
    if args.out:
        write_file_atomically(args.out, lambda path: path.write_text(text, encoding="utf-8"))
    else:
        sys.stdout.write(text)
    stored.note_failed()
    note_left_out(stored.results, unranked, profile, args.table)
    if not tables:
        print(f"rcpu-bench: no finished entries for table {args.table}", file=sys.stderr)
    return 0
