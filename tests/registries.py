"""Test helpers: the registry of the built-in methods only, and one with chosen plugins opted in."""

from __future__ import annotations

from functools import lru_cache

import pytest

from rcpu_bench.plugins import plugin_manager
from rcpu_bench.registry import Registry, build_registry


@lru_cache(maxsize=1)
def builtin_registry() -> Registry:
    """The built-in scorers, compensators and model methods, whatever is installed."""
    return build_registry(plugin_manager(entry_points=False))


def with_plugins(*modules: str) -> Registry:
    """The built-ins and the plugin modules named (e.g. ``rcpu_slicegpt.plugin``); skips the test when one of them
    is not installed."""
    plugins = [(name, pytest.importorskip(name)) for name in modules]
    return build_registry(plugin_manager(plugins, entry_points=False))
