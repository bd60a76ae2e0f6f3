"""``rcpu-bench plugins``: the registered methods of every kind, and the plugins that failed."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from rcpu_bench.commands import command
from rcpu_bench.plugins import default_registry
from rcpu_bench.registry import KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


@command()
def run(args: argparse.Namespace) -> int:
    """Exit 1 when a plugin failed to load."""
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
