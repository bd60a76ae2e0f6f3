"""The ``rcpu-bench`` command line."""

from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

from rcpu_bench.registry import default_registry


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = default_registry()
    for kind in ("scorer", "compensator"):
        rows = [(m.name, m.provider, m.needs, ", ".join(f"{k}={v!r}" for k, v in m.params.items()), m.description)
                for m in registry.methods(kind)]
        print(f"{kind}s:")
        print(tabulate(rows, headers=["name", "provider", "needs", "parameters", "description"]))
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rcpu-bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plugins", help="list registered scorers and compensators").set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
