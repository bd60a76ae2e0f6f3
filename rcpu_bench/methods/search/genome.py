"""The searched allocation's grid and its evolution (:mod:`rcpu_bench.methods.search.driver`, steps 1, 2 and 5):
a slot's levels, the parameter budget a choice keeps, the sparsity shifts that make offspring, and the staged
selection of the fittest."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rcpu_bench.model.views import LayerView
from rcpu_bench.pruning.allocation import units_to_prune
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
