"""The ``rcpu-bench`` console script (:mod:`rcpu_bench.commands` builds the parser and runs the subcommands)."""

from __future__ import annotations

import sys

from rcpu_bench.commands import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
