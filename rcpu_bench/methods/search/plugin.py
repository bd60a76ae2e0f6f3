"""Týr-the-Pruner's searched allocation as a plugin: registered through the ``register_allocations`` hook, as a
third-party allocation would be."""

from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.methods.search.driver import search


@hookimpl
def register_allocations(register: Register) -> None:
    register("search", search, description="Evolutionary search of per-layer and per-module levels under the "
             "uniform allocation's parameter budget, candidates on disk, fitness KL(dense ‖ pruned) on held-out "
             "tokens (Týr-the-Pruner, Li et al. NeurIPS 2025)")
