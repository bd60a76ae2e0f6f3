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
   (one-shot: each layer sees the dense activations, ``AllocationTask.dense_layers``); every level of every slot
   is pruned from them by the run's own scorer or selector and compensator (``AllocationTask.prune``, on a copy of
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
cache is a hidden directory that a later search removes once its process is gone (``rcpu_bench.pruning.search_cache``).

The model is handed back dense. With ``statistics='one-shot'`` the pipeline's pruning at the chosen counts is the
best candidate itself; with ``'sequential'`` (the default) it prunes each layer from the pruned layers' outputs.
Týr's iterated prune-and-search with coarse-to-fine steps and its expectation error accumulation are not
reproduced: one grid is searched once.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from rcpu_bench import console
from rcpu_bench.model.adapter import decoder_layers, layer_view
from rcpu_bench.model.views import MODULES, LayerView
from rcpu_bench.pruning.allocation import units_to_prune
from rcpu_bench.pruning.search_cache import (
    MAX_SCORED_TOKENS,
    Fitness,
    Supernet,
    cache_directory,
    check_cache,
    check_cost,
    linears,
    published,
    scored_tokens,
)

if TYPE_CHECKING:
    from rcpu_bench.pruning.allocation_pass import AllocationTask
    from rcpu_bench.pruning.options import PruneConfig

Genome = tuple[int, ...]  # one level per slot, in slot order
ATTEMPTS = 20  # mutations drawn per offspring wanted: a small grid may have fewer distinct offspring


@dataclass(frozen=True)
class Slot:
    """One module of one layer: the units it loses at each level of its grid, and one unit's parameters."""

    layer: int
    module: str
    uniform: int  # units pruned by the uniform allocation (level 0)
    counts: dict[int, int]  # level → units pruned, for the levels that fit the module
    cost: int

    def removed(self, level: int) -> int:
        """Parameters the slot loses at ``level``."""
        return self.counts[level] * self.cost

    def neighbour(self, level: int, direction: int) -> int | None:
        """The next level of the grid up (+1, more pruned) or down (−1), or None at its edge."""
        levels = sorted(self.counts)
        index = levels.index(level) + direction
        return levels[index] if 0 <= index < len(levels) else None


def slots(views: Sequence[LayerView], modules: Sequence[str], config: PruneConfig, levels: Sequence[int],
          step: float) -> list[Slot]:
    """The grid (module docstring, 1) of every layer's pruned modules, layer by layer."""
    grid = []
    for index, view in enumerate(views):
        for module in modules:
            n = view.n_units(module, config.gqa_rule)
            uniform = units_to_prune(view.units(module, config.gqa_rule), n, config.ratio, config.rounding)
            size = max(1, round(step * n))
            counts = {k: uniform + k * size for k in levels if 0 <= uniform + k * size < n}
            grid.append(Slot(index, module, uniform, counts, int(view.unit_cost(module))))
    return grid


def removed(grid: Sequence[Slot], genome: Genome) -> int:
    """Parameters a choice removes: Σ count·cost over the slots."""
    return sum(slot.removed(level) for slot, level in zip(grid, genome, strict=True))


def witness(grid: Sequence[Slot], budget: int) -> Genome | None:
    """A choice that removes exactly ``budget`` parameters, or None when none does.

    Dynamic programming over the totals reachable slot by slot (totals above the budget are dropped: every count
    is ≥ 0), each total remembering the level that first reached it; level 0 is tried first, so the choice is the
    uniform one whenever the grid has it.
    """
    reached: list[dict[int, int]] = []  # per slot: total removed up to it → its level on the way
    totals = {0}
    for slot in grid:
        step: dict[int, int] = {}
        for level in sorted(slot.counts, key=abs):
            for total in totals:
                if (new := total + slot.removed(level)) <= budget:
                    step.setdefault(new, level)
        reached.append(step)
        totals = set(step)
    if budget not in totals:
        return None
    genome = []
    for slot, step in zip(reversed(grid), reversed(reached), strict=True):
        genome.append(step[budget])
        budget -= slot.removed(genome[-1])
    return tuple(reversed(genome))


def mutate(parent: Genome, grid: Sequence[Slot], rng: random.Random, shifts: int) -> Genome:
    """Týr's sparsity shifts: min(U{1..shifts}, U{1..shifts}) times, one slot one level up and another slot of the
    same module one level down, removing what the first adds (a shift without such a pair is skipped)."""
    child = list(parent)
    for _ in range(min(rng.randint(1, shifts), rng.randint(1, shifts))):
        module = rng.choice(sorted({slot.module for slot in grid}))
        same = [i for i, slot in enumerate(grid) if slot.module == module]
        ups = {i: level for i in same if (level := grid[i].neighbour(child[i], +1)) is not None}
        if not ups:
            continue
        up = rng.choice(sorted(ups))
        gain = grid[up].removed(ups[up]) - grid[up].removed(child[up])
        downs = {i: level for i in same if i != up and (level := grid[i].neighbour(child[i], -1)) is not None
                 and grid[i].removed(child[i]) - grid[i].removed(level) == gain}
        if downs:
            down = rng.choice(sorted(downs))
            child[up], child[down] = ups[up], downs[down]
    return tuple(child)


def offspring(parent: Genome, grid: Sequence[Slot], rng: random.Random, population: int, shifts: int) -> list[Genome]:
    """Up to ``population`` distinct mutations of the parent, other than the parent."""
    children: list[Genome] = []
    for _ in range(ATTEMPTS * population):
        child = mutate(parent, grid, rng, shifts)
        if child != parent and child not in children:
            children.append(child)
        if len(children) == population:
            break
    return children


def by_layer(grid: Sequence[Slot], values: list[int], n_layers: int) -> list[dict[str, int]]:
    """One value per slot, as one {module: value} per layer."""
    layers: list[dict[str, int]] = [{} for _ in range(n_layers)]
    for slot, value in zip(grid, values, strict=True):
        layers[slot.layer][slot.module] = value
    return layers


def stage_plan(population: int, stages: int, growth: int, tokens: int, seqlen: int) -> list[tuple[int, int]]:
    """(held-out windows, survivors) of each selection step: ⌈tokens·growthⁱ / seqlen⌉ windows, and
    population // growthⁱ⁺¹ survivors (at least one; one at the last step)."""
    return [(math.ceil(tokens * growth**i / seqlen),
             1 if i == stages - 1 else max(1, population // growth ** (i + 1))) for i in range(stages)]


def select_parent(parent: Genome, parent_fitness: float, children: list[Genome],
                  score: Callable[[Genome, list[int]], float], plan: list[tuple[int, int]],
                  rng: random.Random) -> tuple[Genome, float]:
    """One generation's selection steps (module docstring, 5): the fittest of the offspring and the parent, and its
    fitness on all held-out windows (the parent's is known; it wins ties)."""
    n_windows = plan[-1][0]
    fitness: list[float] = []
    for step, (windows, survivors) in enumerate(plan):
        if step == len(plan) - 1:
            chosen = list(range(n_windows))
            fitness = [parent_fitness] + [score(child, chosen) for child in children]
            children = [parent, *children]
        else:
            chosen = sorted(rng.sample(range(n_windows), min(windows, n_windows)))
            fitness = [score(child, chosen) for child in children]
        order = sorted(range(len(children)), key=fitness.__getitem__)[:survivors]
        children, fitness = [children[i] for i in order], [fitness[i] for i in order]
    return children[0], fitness[0]


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
        grid = slots(views, [m for m in MODULES if m in config.prune], config, self.levels, self.step)
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

    def __call__(self, task: AllocationTask) -> tuple[list[dict[str, int]], dict[str, Any]]:
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

    def _run(self, task: AllocationTask, supernet: Supernet, start: Genome, windows: Tensor,
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
