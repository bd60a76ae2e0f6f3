"""Searched allocation (Týr-the-Pruner): the units each layer's modules lose, chosen by a search on the model itself.

Týr-the-Pruner (Li et al., NeurIPS 2025, arXiv 2503.09657) prunes every layer at several sparsity levels into a
supernet kept on disk, then searches by evolution one level per layer under the global budget, its fitness the KL
divergence between the dense and the candidate model's next-token distributions. Here it is a
``hookspecs.ModelAllocation``: it returns the units each layer's module loses, and the pipeline then prunes.

1. Grid. Module m of layer l (a *slot*) has the levels k ∈ ``levels`` (integers): level k prunes c + k·s of its n
   units, c = ``units_to_prune`` at ρ (the uniform count) and s = max(1, round(step·n)); a level outside [0, n) is
   left out of that slot's grid.
2. Budget. A choice of one level per slot removes Σ count·cost parameters (cost: the producer and consumer weights
   of one unit, ``LayerView.unit_cost``). The search keeps it equal to B, what the uniform allocation removes
   (level 0 everywhere); a grid that cannot remove exactly B is refused before any work (:func:`witness`).
3. Candidates, on disk. One pass of the dense model over the calibration windows gives every layer's statistics
   (one-shot: each layer sees the dense activations, ``AllocationContext.dense_layers``); every level of every slot
   is pruned from them by the run's own scorer or selector and compensator (``AllocationContext.prune``, on a copy of
   the layer). Only what pruning changes goes to the cache directory: the pruned units, the compensated consumer
   weight W̃_K and the consumer's bias; the slot's dense producers and consumer go there too, to restore them.
4. Fitness. A choice is assembled in place by masking (``LayerView.apply(physical=False)``: the pruned producer
   rows and consumer columns zero, W̃_K in the kept columns, the function of the pruned model) and scored on
   held-out windows, disjoint from the calibration windows, by

       KL(p_dense ‖ p) = (1/T) Σ_t Σ_v p_dense(v | x_<t) · (log p_dense(v | x_<t) − log p(v | x_<t))

   over the T positions scored; the dense log-probabilities are computed once and kept in the cache.
5. Search (Týr's code, after EvoPress). The parent starts as the uniform choice (for a grid without level 0, the
   choice :func:`witness` finds). Each generation draws
   ``population`` distinct offspring of it, each with min(U{1..shifts}, U{1..shifts}) sparsity shifts: one slot
   one level up, another slot of the same module one level down, removing as many parameters as the first adds
   (the budget stays B). They are selected in ``stages`` steps: step i scores the remaining offspring on
   ⌈tokens·growthⁱ / seqlen⌉ held-out windows (a seeded random subset; the last step all of them) and keeps
   population // growthⁱ⁺¹ of them (at least one; the last step one), the parent joining the last step (elitism),
   so the parent's fitness never rises. The token budget thus grows over the selection steps of every generation,
   as in Týr's code (2K, 16K, 128K tokens). The record keeps the parent's fitness on all the held-out windows,
   at the start and after each generation.

Cost. Before any work, on the model's shapes (:meth:`Search.check`, before the model loads and again on it), the
tokens the search scores are bounded by ``max_scored_tokens`` and its cache's size by the free space there; the
cache is a hidden directory that a later search removes once its process is gone
(:mod:`rcpu_bench.methods.search.supernet`).

The model is handed back dense. With ``statistics='one-shot'`` the pipeline's pruning at the chosen counts is the
best candidate itself; with ``'sequential'`` (the default) it prunes each layer from the pruned layers' outputs.
Týr's iterated prune-and-search with coarse-to-fine steps and its expectation error accumulation are not
reproduced: one grid is searched once.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from rcpu_bench import console
from rcpu_bench.methods.search.fitness import MAX_SCORED_TOKENS, Fitness, check_cost, scored_tokens
from rcpu_bench.methods.search.genome import (
    Genome,
    Slot,
    by_layer,
    offspring,
    removed,
    select_parent,
    slots,
    stage_plan,
    witness,
)
from rcpu_bench.methods.search.supernet import Supernet, cache_directory, check_cache, linears, published
from rcpu_bench.model.adapter import decoder_layers, layer_view

if TYPE_CHECKING:
    from rcpu_bench.hookspecs import AllocationContext
    from rcpu_bench.pruning.options import PruneConfig


@dataclass(frozen=True)
class Search:
    """The searched allocation with its parameters (:func:`search`), run on a model by the pipeline."""

    levels: tuple[int, ...]
    step: float
    population: int
    generations: int
    shifts: int
    tokens: int
    stages: int
    growth: int
    seed: int
    cache: str | None
    keep: bool
    max_scored_tokens: int | None = MAX_SCORED_TOKENS

    def check(self, model: Any, config: PruneConfig, seqlen: int) -> int:
        """Refuse, before any work, what the model's shapes (``model`` may be weightless) decide: unsupported
        options, a grid that cannot meet the budget, a cost above ``max_scored_tokens``, a cache directory that
        cannot be written or lacks the space; returns the held-out windows the search draws."""
        _check_run(config)
        views = [layer_view(layer) for layer in decoder_layers(model)]
        grid = slots(views, config.pruned_modules, config, self.levels, self.step)
        self._start(grid, config)
        plan = self._plan(seqlen)
        check_cost(plan, seqlen, self.population, self.generations, self.max_scored_tokens,
                   f"generations={self.generations}, population={self.population}, tokens={self.tokens}, "
                   f"stages={self.stages}, growth={self.growth}")
        check_cache(self._cache_root(), [(linears(views[slot.layer], slot.module),
                                          views[slot.layer].units(slot.module).unit_size, list(slot.counts.values()))
                                         for slot in grid], plan[-1][0], seqlen,
                    model.get_output_embeddings().weight.shape[0])
        return plan[-1][0]

    def __call__(self, task: AllocationContext) -> tuple[list[dict[str, int]], dict[str, Any]]:
        """Units per layer and module of the fittest choice, and the search's record (module docstring)."""
        config = task.config
        seqlen = task.calib_ids.shape[1]
        n_windows = self.check(task.model, config, seqlen)
        views = [layer_view(layer) for layer in decoder_layers(task.model)]
        grid = slots(views, task.modules, config, self.levels, self.step)
        budget, start = self._start(grid, config)
        plan = self._plan(seqlen)
        console.info(f"search: about {scored_tokens(plan, self.population, self.generations, seqlen):,} tokens to "
                     f"score; candidates in {self._cache_root()}")
        windows = task.holdout(n_windows)
        directory = cache_directory(self._cache_root(), self.cache)
        supernet = Supernet(directory, views, grid, config.gqa_rule)
        try:
            best, curve, seconds = self._run(task, supernet, start, windows, plan)
            written = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
        finally:
            supernet.restore()
            if not self.keep:
                shutil.rmtree(directory, ignore_errors=True)
        if self.keep:
            directory = published(directory)
        counts = by_layer(grid, [slot.counts[level] for slot, level in zip(grid, best, strict=True)], len(views))
        return counts, {
            "method": "search", "levels": list(self.levels), "step": self.step, "seed": self.seed,
            "population": self.population, "generations": self.generations, "shifts": self.shifts,
            "stages": [{"windows": n, "tokens": n * windows.shape[1], "survivors": k} for n, k in plan],
            "budget_parameters": budget, "removed_parameters": removed(grid, best), "fitness": curve,
            "chosen_levels": by_layer(grid, list(best), len(views)),
            "heldout_windows": len(windows), "cache": str(directory) if self.keep else None,
            "cache_bytes": written, "seconds": seconds}

    def _start(self, grid: list[Slot], config: PruneConfig) -> tuple[int, Genome]:
        """The budget (the uniform allocation's, level 0) and the first parent, a choice that meets it."""
        budget = sum(slot.uniform * slot.cost for slot in grid)
        start = witness(grid, budget)
        if start is None:
            raise ValueError(f"allocation 'search' levels={list(self.levels)} with step={self.step}: no choice of one "
                             f"level per layer and module removes the {budget:,} parameters of the uniform allocation "
                             f"at ratio {config.ratio}; allowed: levels that can balance out, e.g. ones including 0")
        return budget, start

    def _plan(self, seqlen: int) -> list[tuple[int, int]]:
        return stage_plan(self.population, self.stages, self.growth, self.tokens, seqlen)

    def _cache_root(self) -> Path:
        return Path(self.cache) if self.cache is not None else Path(tempfile.gettempdir())

    def _run(self, task: AllocationContext, supernet: Supernet, start: Genome, windows: Tensor,
             plan: list[tuple[int, int]]) -> tuple[Genome, list[float], dict[str, float]]:
        """Build the candidates, then evolve from ``start``: the fittest choice, the parent's fitness after each
        generation and the seconds of both phases."""
        started = time.perf_counter()
        supernet.build(task)
        fitness = Fitness(task.model, windows, supernet.directory / "targets", task.config.batch_size)
        built = time.perf_counter()

        def score(genome: Genome, chosen: list[int]) -> float:
            supernet.assemble(genome)
            return fitness(chosen)

        rng = random.Random(self.seed)
        parent = start
        curve = [score(parent, list(range(len(windows))))]
        for _ in console.progress(range(self.generations), desc="search: generations", unit="generation",
                                  enabled=task.progress):
            children = offspring(parent, supernet.grid, rng, self.population, self.shifts)
            parent, best = select_parent(parent, curve[-1], children, score, plan, rng)
            curve.append(best)
        return parent, curve, {"candidates": built - started, "search": time.perf_counter() - built}


def _check_run(config: PruneConfig) -> None:
    """Refuse the options the search does not support, before any work."""
    if config.round_to or config.offload or config.gqa_rule != "group":
        raise ValueError(f"allocation 'search' with round_to={config.round_to}, offload={config.offload}, gqa_rule="
                         f"{config.gqa_rule!r}: the search scores whole models on the device at exact counts of whole "
                         "units; allowed: round_to=0, offload=False, gqa_rule='group'")


def search(n_layers: int, ratio: float, /, *, levels: Sequence[int] = (-2, -1, 0, 1, 2), step: float = 0.05,
           population: int = 16, generations: int = 10, shifts: int = 4, tokens: int = 256, stages: int = 3,
           growth: int = 4, seed: int = 0, cache: str | None = None, keep: bool = False,
           max_scored_tokens: int | None = MAX_SCORED_TOKENS) -> Search:
    """Týr-the-Pruner's searched allocation (module docstring), its parameters checked.

    ``levels`` and ``step``: the grid, level k pruning the uniform count plus k·round(step·n) of a module's n units;
    ``population`` offspring per generation over ``generations``, each with up to ``shifts`` sparsity shifts;
    ``stages`` selection steps per generation on ``tokens``·growthⁱ held-out tokens; ``seed`` of the mutations and
    of the windows drawn; ``cache`` the directory under which the candidates are written (default: the system's
    temporary directory), removed when done unless ``keep``; ``max_scored_tokens`` the bound on the tokens scored
    (:func:`scored_tokens`; None: no bound), checked with the cache's free space before any work (:meth:`Search.check`).
    """
    if (not isinstance(levels, (list, tuple)) or not levels or len(set(levels)) != len(levels)
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in levels)):
        raise ValueError(f"search levels={levels!r}: not a grid; allowed: a list of distinct integers, e.g. [-1, 0, 1]")
    if not 0 < step < 1:
        raise ValueError(f"search step={step!r}: a level moves step·n units; allowed: a number in (0, 1)")
    for name, value, least in (("population", population, 1), ("generations", generations, 0), ("shifts", shifts, 1),
                               ("tokens", tokens, 1), ("stages", stages, 1), ("growth", growth, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"search {name}={value!r}: not a count; allowed: an integer >= {least}")
    if not (cache is None or isinstance(cache, str) and cache) or not isinstance(keep, bool):
        raise ValueError(f"search cache={cache!r}, keep={keep!r}; allowed: cache a directory path or None, keep true "
                         "or false")
    if max_scored_tokens is not None and (not isinstance(max_scored_tokens, int) or isinstance(max_scored_tokens, bool)
                                          or max_scored_tokens < 1):
        raise ValueError(f"search max_scored_tokens={max_scored_tokens!r}: not a bound; allowed: an integer >= 1, or "
                         "None for no bound")
    return Search(tuple(levels), step, population, generations, shifts, tokens, stages, growth, seed, cache, keep,
                  max_scored_tokens)
