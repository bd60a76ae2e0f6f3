"""``rcpu-bench migrate``: bring result stores and saved pruned models written by earlier releases to today's format
(:mod:`rcpu_bench.matrix.migrate`, :mod:`rcpu_bench.model.migrate`), each rewritten atomically in place."""

from __future__ import annotations

import argparse
from pathlib import Path

from rcpu_bench.commands import command
from rcpu_bench.matrix.store import RECORDS
from rcpu_bench.model.manifest import MANIFEST


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help=f"a results directory (holding {RECORDS}) or a saved "
                   f"pruned model (holding {MANIFEST})")
    p.add_argument("--dry-run", action="store_true", help="say what would change; write nothing")


def kind_of(path: Path) -> str:
    """``store`` or ``saved model``; ValueError for a path that is neither."""
    if (path / RECORDS).is_file():
        return "store"
    if (path / MANIFEST).is_file():
        return "saved model"
    raise ValueError(f"{path} is neither a results directory (no {RECORDS}) nor a saved pruned model (no {MANIFEST})")


@command(interrupted=": each path is written whole or not at all")
def run(args: argparse.Namespace) -> int:
    """Check every path first, then migrate each and say what changed."""
    paths = [Path(path) for path in args.paths]
    kinds = [kind_of(path) for path in paths]
    verb = "would be" if args.dry_run else "were"
    for path, kind in zip(paths, kinds, strict=True):
        if kind == "store":
            from rcpu_bench.matrix.migrate import migrate_store

            done = migrate_store(path, dry_run=args.dry_run)
            print(f"{done.path}: {done.changed} of {done.entries} entries {verb} brought to today's format")
        else:
            from rcpu_bench.model.migrate import migrate_saved

            version = migrate_saved(path, dry_run=args.dry_run)
            print(f"{path}: already today's format" if version is None else
                  f"{path}: format version {version} {'would be' if args.dry_run else 'was'} brought to today's")
    return 0
