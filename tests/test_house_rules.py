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


def imported_modules(tree: ast.Module) -> set[str]:
    """The modules a module imports from (``from X import y`` gives X, and X.y when y is a submodule)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


SOURCES = [PACKAGE, *sorted(PACKAGE.parent.glob("plugins/*/rcpu_*"))]  # the package and the plugin packages


def test_every_module_is_under_450_lines():
    lengths = {path.relative_to(PACKAGE.parent).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
               for source in SOURCES for path in source.rglob("*.py")}
    assert len(lengths) > 100 and any(name.startswith("plugins/") for name in lengths)
    assert {name: n for name, n in lengths.items() if n > 450} == {}


def test_the_harness_reaches_the_peers_methods_only_through_their_plugins():
    # Only the list of built-in plugins names the peers' packages; the harness's own algorithm (pruning/,
    # compensation/, selection/, ...) does not import them, as it imports no third-party plugin.
    peers = {path.name for path in (PACKAGE / "methods").iterdir() if (path / "__init__.py").exists()}
    assert peers == {"search", "depth", "olica", "slimllm", "minitron"}
    importers = {path: sorted(name for name in imported_modules(tree) if name.startswith("rcpu_bench.methods"))
                 for path, tree in modules().items() if not path.startswith("methods/")}
    assert {path: names for path, names in importers.items() if names} == {
        "plugins.py": sorted(f"rcpu_bench.methods.{peer}" + suffix for peer in peers for suffix in ("", ".plugin"))}


def test_each_peer_package_registers_its_methods_through_the_hooks_of_its_plugin_module():
    from rcpu_bench import hookspecs
    from rcpu_bench.plugins import BUILTINS

    hooks = {name for name in vars(hookspecs) if name.startswith("register_")}
    plugins = dict(BUILTINS)
    for peer in ("search", "depth", "olica", "slimllm", "minitron"):
        plugin = plugins[peer]
        assert plugin.__name__ == f"rcpu_bench.methods.{peer}.plugin"
        implemented = {name for name in vars(plugin) if name in hooks}
        assert implemented, peer
        assert all(hasattr(getattr(plugin, name), "rcpu_bench_impl") for name in implemented)
