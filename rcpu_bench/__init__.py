"""rcpu-bench: post-training structured pruning of LLaMA-family models with error compensation.

The plugin-facing API: a plugin imports what it needs from here and from :mod:`rcpu_bench.model` (the model
side), nothing deeper. The names are loaded on first use, so ``import rcpu_bench`` (and ``rcpu-bench --version``)
stays fast:

- the hooks: ``hookimpl`` (decorates a plugin's ``register_scorers``, ``register_selectors``,
  ``register_compensators``, ``register_model_methods``, ``register_allocations``), ``Register`` (the
  ``register`` callable each hook receives), and the contracts ``Scorer``, ``Selector``, ``Compensator``,
  ``ModelMethod``, ``Allocation``, ``SaveModel``, ``LoadModel``;
- the statistics a method reads: ``ActivationStats`` (N, Σx, Σ|x|, Σx², G = Σ x xᵀ), ``collect_input_stats``;
- what a compensator returns: ``Compensation`` (built with ``Problem(weight, stats, kept).result(...)``);
- selection: ``Selection``, ``select_by_score``;
- the registry: ``Registry``, ``Method``, ``Resolved``, ``default_registry``;
- a run and its record: ``Experiment``, ``PruneConfig`` (how it prunes), ``run_experiment``, ``Record``,
  ``library_versions`` (for a model method's saved manifest).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rcpu_bench.version import __version__

_HOMES = {
    "hookimpl": "hookspecs", "Register": "hookspecs", "Scorer": "hookspecs", "Compensator": "hookspecs",
    "ModelMethod": "hookspecs", "SaveModel": "hookspecs", "LoadModel": "hookspecs", "Selector": "hookspecs",
    "Allocation": "hookspecs",
    "ActivationStats": "statistics.activations", "collect_input_stats": "statistics.activations",
    "Compensation": "compensation.compensators", "Problem": "compensation.compensators",
    "Selection": "selection.select", "select_by_score": "selection.select",
    "Method": "registry", "Registry": "registry", "Resolved": "registry", "default_registry": "plugins",
    "Experiment": "experiment", "run_experiment": "experiment", "PruneConfig": "pruning.options",
    "Record": "records", "library_versions": "records",
}
__all__ = ["ActivationStats", "Allocation", "Compensation", "Compensator", "Experiment", "LoadModel", "Method",
           "ModelMethod", "Problem", "PruneConfig", "Record", "Register", "Registry", "Resolved", "SaveModel", "Scorer",
           "Selection", "Selector", "collect_input_stats", "default_registry", "hookimpl", "library_versions",
           "run_experiment", "select_by_score", "__version__"]

if TYPE_CHECKING:
    from rcpu_bench.compensation.compensators import Compensation, Problem
    from rcpu_bench.experiment import Experiment, run_experiment
    from rcpu_bench.hookspecs import (
        Allocation,
        Compensator,
        LoadModel,
        ModelMethod,
        Register,
        SaveModel,
        Scorer,
        Selector,
        hookimpl,
    )
    from rcpu_bench.plugins import default_registry
    from rcpu_bench.pruning.options import PruneConfig
    from rcpu_bench.records import Record, library_versions
    from rcpu_bench.registry import Method, Registry, Resolved
    from rcpu_bench.selection.select import Selection, select_by_score
    from rcpu_bench.statistics.activations import ActivationStats, collect_input_stats


def __getattr__(name: str) -> Any:
    """Load a name of the plugin-facing API from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'rcpu_bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rcpu_bench.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
