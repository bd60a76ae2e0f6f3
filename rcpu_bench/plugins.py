"""Which plugins make the default registry: the built-ins, then every installed ``rcpu_bench`` entry point.

The built-ins are registered in code, so a source checkout works without ``pip install``: the harness's own methods
(``rcpu_bench.builtin``), then each peer method's plugin (``rcpu_bench.methods``: the searched allocation, the depth
baselines, SlimLLM, Olica, Minitron), through the same hooks as a third-party plugin. This is the floor above the
registry that names them, as pytest and llm load their own built-in plugins.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import lru_cache

from rcpu_bench import builtin
from rcpu_bench.methods.depth import plugin as depth
from rcpu_bench.methods.minitron import plugin as minitron
from rcpu_bench.methods.olica import plugin as olica
from rcpu_bench.methods.search import plugin as search
from rcpu_bench.methods.slimllm import plugin as slimllm
from rcpu_bench.registry import PluginManager, Registry, build_registry
from rcpu_bench.version import __version__

# The built-in plugins, in registration order: the harness's own, then the peers' (each kind lists its methods in
# this order: slimllm before olica among the compensators, as before they were plugins).
BUILTINS = (("builtin", builtin), ("search", search), ("depth", depth), ("slimllm", slimllm), ("olica", olica),
            ("minitron", minitron))
# Set to 1: the default registry holds the built-ins only, no installed plugin (as pytest's
# PYTEST_DISABLE_PLUGIN_AUTOLOAD; the tests set it, so that they do not depend on what happens to be installed).
DISABLE_AUTOLOAD = "RCPU_BENCH_DISABLE_PLUGIN_AUTOLOAD"


def plugin_manager(extra_plugins: Iterable[tuple[str, object]] = (), *, entry_points: bool = True,
                   builtins: bool = True) -> PluginManager:
    """A plugin manager with the built-ins, the entry-point plugins and any extra (name, plugin), in that order."""
    pm = PluginManager()
    if builtins:
        for name, plugin in BUILTINS:
            pm.register(plugin, name=name)
            package = "builtin" if plugin is builtin else f"rcpu_bench.methods.{name}"
            pm.providers[name] = f"{package} (rcpu-bench {__version__})"
    if entry_points:
        pm.load_entry_points()
    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
    return pm


def default_registry() -> Registry:
    """The registry of the built-ins and all installed plugins (built once per process), or of the built-ins only
    when the environment sets ``RCPU_BENCH_DISABLE_PLUGIN_AUTOLOAD=1``."""
    return _registry(entry_points=os.environ.get(DISABLE_AUTOLOAD) != "1")


@lru_cache(maxsize=2)
def _registry(entry_points: bool) -> Registry:
    return build_registry(plugin_manager(entry_points=entry_points))
