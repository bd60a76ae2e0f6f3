"""The ``rcpu-bench`` command line.

Every parser refuses abbreviated options (``--eval 4`` is an error, not ``--eval-batch-size 4``);
``--version`` prints the package version; progress and log lines follow ``rcpu_bench.console`` (``--quiet``,
timestamped lines when the output is not a terminal); Ctrl-C ends any command with one line and exit 130.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tabulate import tabulate

from rcpu_bench import __version__, console
from rcpu_bench.evaluation import eval_command, generation, speed
from rcpu_bench.matrix import runner
from rcpu_bench.matrix.experiment import (
    DEFAULT_CALIB,
    Experiment,
    default_model,
    run_experiment,
)
from rcpu_bench.matrix.records import append_record
from rcpu_bench.model.loading import add_model_options
from rcpu_bench.pruning import options
from rcpu_bench.registry import KINDS, default_registry
from rcpu_bench.tables import plots, tables


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = default_registry()
    for kind in KINDS:
        rows = [(m.name, m.provider, m.needs, ", ".join(f"{k}={v!r}" for k, v in m.params.items()), m.description)
                for m in registry.methods(kind)]
        print(f"{kind}s:")
        print(tabulate(rows, headers=["name", "provider", "needs", "parameters", "description"]))
        print()
    for provider, why in registry.broken.items():
        print(f"plugin {provider} failed to load: {why}")
    return 1 if registry.broken else 0


def _summary(record: dict[str, Any]) -> str:
    params = record["parameters"]
    lines = [f"parameters: {params['before']:,} -> {params['after']:,} ({params['removed_fraction']:.2%} removed)",
             f"pruning time: {sum(record['timing']['prune_seconds'].values()):.1f} s, "
             f"peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB"]
    lines += [f"ppl[{p['profile']}] = {p['ppl']:.4f}  ({p['n_windows']} windows, {p['n_tokens']:,} tokens, "
              f"seqlen {p['seqlen']})" for p in record["perplexity"]]
    return "\n".join(lines)


def cmd_prune(args: argparse.Namespace) -> int:
    config = options.from_args(args)
    experiment = Experiment(model=args.model or default_model(), prune=config, calib=args.calib,
                            ppl_profiles=tuple(args.ppl), revision=args.revision, dtype=args.dtype, device=args.device,
                            eval_batch_size=args.eval_batch_size, data_dir=args.data_dir, save_dir=args.save)
    try:
        experiment.validate(default_registry())
    except (ValueError, KeyError, OSError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"rcpu-bench: error: {message}", file=sys.stderr)
        return 2
    record = run_experiment(experiment, progress=not args.quiet)
    print(_summary(record))
    if args.out:
        append_record(args.out, record)
        print(f"record appended to {args.out}")
    if args.save:
        print(f"pruned model saved to {args.save}")
    return 0


def _add_prune_parser(commands) -> None:
    p = commands.add_parser("prune", help="prune one model with one scorer x compensator and evaluate it",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="local model directory or Hugging Face hub id "
                   "(default: the stories260K-mha fixture in the shared directory)")
    add_model_options(p)
    options.add_arguments(p)
    p.add_argument("--calib", default=DEFAULT_CALIB,
                   help="calibration data SOURCE[:NxSEQLEN][:seed=S]; sources wikitext2, tinystories, file:PATH")
    p.add_argument("--ppl", action="append", default=None, metavar="PROFILE",
                   help="perplexity profile(s): rcpu128, std2048, tinystories, tinystories[START:STOP] "
                        "(default: rcpu128)")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--data-dir", help="data directory (default: $RCPU_BENCH_DATA or ../shared/data)")
    p.add_argument("--save", metavar="DIR", help="save the pruned model (safetensors + shape manifest)")
    p.add_argument("--out", metavar="JSONL", help="append the result record to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prune)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses abbreviated options; its subcommand parsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rcpu-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    plugins_parser = commands.add_parser("plugins", help="list the registered methods of every kind")
    plugins_parser.set_defaults(func=cmd_plugins)
    _add_prune_parser(commands)
    for module in (runner, tables, plots, eval_command, generation, speed):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command: its exit code, 2 on bad input, 130 on Ctrl-C (one line, no traceback)."""
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "ppl", "unset") is None:
            args.ppl = ["rcpu128"]
        console.configure(quiet=getattr(args, "quiet", False))
        return int(args.func(args))
    except KeyboardInterrupt:
        # Records are appended whole (append_record) and only after a run ends, so nothing torn is left.
        console.interrupted()
        return 130


if __name__ == "__main__":
    sys.exit(main())
