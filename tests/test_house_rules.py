"""The house rules that the code's shape must keep, checked on the package's source."""

from __future__ import annotations

import ast
from pathlib import Path

import rcpu_bench

PACKAGE = Path(rcpu_bench.__file__).parent


def modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed, by its path relative to the package."""
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(tree: ast.Module) -> set[str]:
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_only_the_layer_walk_runs_decoder_layers_over_captured_inputs():
    runs = {"run_layer", "capture_layer_inputs"}
    homes = {"model/capture.py", "model/__init__.py", "pruning/walk.py"}  # the definitions, the plugin face, the walk
    assert [path for path, tree in modules().items() if imported_names(tree) & runs and path not in homes] == []
