"""Main effects and two-way interactions of a factorial matrix: selection × compensation × allocation.

Each pruned run that prunes and compensates both modules is a point y = perplexity of one profile, at the levels
of the factors selection (the ``scorer`` option: a scorer or a selector), compensation (ridge at λ_best, chosen by
the λ rule as in the other tables), allocation (uniform, log-increase, al-am) and N_calib; one table per model and
pruning ratio. A factor's level mean is taken over *balanced* comparisons only: the groups of runs that share every
other factor's level and have every level of this factor, so a partly finished store compares like with like.

- main effect of level a of factor A: mean_a − mean, mean_a the level mean, mean the mean of the level means;
  the factor's *range* (max − min level mean) is how far it moves the perplexity;
- interaction of A and B over their complete 2 × 2 … blocks: the root mean square of the residuals
  m_ab − m_a· − m_·b + m_·· of the two-way table of means (0 when the effects add up).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import combinations
from pathlib import Path
from statistics import fmean
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE, resolve
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.pruning.allocation import AL_AM
from rcpu_bench.tables.layout import compensates_pruned, relatively_damped
from rcpu_bench.tables.results import Metric, ppl_of
from rcpu_bench.tables.table import Column, Row, Table


def compensation(result: StoredResult) -> str:
    """The compensation level: the compensator, ridge at a damping relative to G_KK (``lam_rel``) a level of its
    own beside ridge at the λ grid's λ_best."""
    compensator = result.prune["compensator"]
    return f"{compensator} (damped)" if relatively_damped(result) else compensator


FACTORS: dict[str, Callable[[StoredResult], Any]] = {
    "selection": lambda r: r.prune["scorer"],
    "compensation": compensation,
    "allocation": lambda r: AL_AM if r.prune["structure"] == AL_AM else r.prune["allocation"],
    "N_calib": lambda r: r.n_calib,
}
MEAN_PPL = Metric("ppl", "mean ppl", None)
EFFECT = Metric("effect", "effect (vs mean)", None)
SPREAD = Metric("range", "range", None)
COUNT = Metric("groups", "balanced groups", None, decimals=0)
INTERACTION = Metric("interaction", "RMS interaction", None, decimals=3)

Levels = tuple[Any, ...]  # one run's levels, in FACTORS order


def factorial_points(results: Sequence[StoredResult], profile: str,
                     lambda_rule: str = DEFAULT_LAMBDA_RULE) -> dict[tuple[str, float], dict[Levels, float]]:
    """(model, ratio) → the factor levels of each run → its perplexity; a ridge grid gives its λ_best run."""
    def key(result: StoredResult) -> tuple | None:
        if result.ratio == 0 or not compensates_pruned(result) or result.prune["model_method"] is not None:
            return None
        return result.model_label, result.ratio, tuple(get(result) for get in FACTORS.values())

    points: dict[tuple[str, float], dict[Levels, float]] = defaultdict(dict)
    for (model, ratio, levels), chosen in resolve(results, key, lambda_rule).items():
        value = ppl_of(profile)(chosen.result.record)
        if value is not None:
            points[model, ratio][levels] = value
    return points


def level_order(level: Any) -> tuple[int, float, str]:
    """Sort key of factor levels: numbers by value (N_calib 8 before 128), names alphabetically."""
    number = isinstance(level, (int, float)) and not isinstance(level, bool)
    return (0, float(level), "") if number else (1, 0.0, str(level))


def level_means(points: dict[Levels, float], factor: int) -> tuple[dict[Any, float], int]:
    """Each level's mean over the balanced groups (the other factors fixed, every level present); their count."""
    levels = sorted({p[factor] for p in points}, key=level_order)
    groups: dict[Levels, dict[Any, float]] = defaultdict(dict)
    for p, value in points.items():
        groups[p[:factor] + p[factor + 1:]][p[factor]] = value
    complete = [g for g in groups.values() if len(g) == len(levels)]
    if len(levels) < 2 or not complete:
        return {}, 0
    return {level: fmean(g[level] for g in complete) for level in levels}, len(complete)


def two_way_means(points: dict[Levels, float], a: int, b: int) -> dict[tuple[Any, Any], float] | None:
    """Mean of each (level of a, level of b) over the groups (the other factors fixed) that have every pair; None
    when no group is complete or a factor has one level."""
    pairs = sorted({(p[a], p[b]) for p in points}, key=lambda pair: tuple(map(level_order, pair)))
    levels_a, levels_b = {x for x, _ in pairs}, {y for _, y in pairs}
    if len(levels_a) < 2 or len(levels_b) < 2 or len(pairs) < len(levels_a) * len(levels_b):
        return None
    groups: dict[Levels, dict[tuple, float]] = defaultdict(dict)
    for p, value in points.items():
        rest = tuple(level for i, level in enumerate(p) if i not in (a, b))
        groups[rest][p[a], p[b]] = value
    complete = [g for g in groups.values() if len(g) == len(pairs)]
    return {pair: fmean(g[pair] for g in complete) for pair in pairs} if complete else None


def interaction(points: dict[Levels, float], a: int, b: int) -> float | None:
    """RMS of m_ab − m_a· − m_·b + m_·· over the two-way table of means (:func:`two_way_means`)."""
    m = two_way_means(points, a, b)
    if m is None:
        return None
    levels_a, levels_b = {x for x, _ in m}, {y for _, y in m}
    pairs = list(m)
    grand = fmean(m.values())
    row = {x: fmean(v for (i, _), v in m.items() if i == x) for x in levels_a}
    col = {y: fmean(v for (_, j), v in m.items() if j == y) for y in levels_b}
    residuals = [m[x, y] - row[x] - col[y] + grand for x, y in pairs]
    return fmean(r * r for r in residuals) ** 0.5


def make_tables(results: Sequence[StoredResult], profile: str, lambda_rule: str = DEFAULT_LAMBDA_RULE
                ) -> list[Table]:
    """Per (model, ratio): the main-effects table (one row per factor level) and the two-way interactions."""
    tables = []
    names = list(FACTORS)
    for (model, ratio), points in sorted(factorial_points(results, profile, lambda_rule).items()):
        rows = []
        for i, name in enumerate(names):
            means, count = level_means(points, i)
            if not means:
                continue
            grand, spread = fmean(means.values()), max(means.values()) - min(means.values())
            rows += [Row(f"{name}: {level}", ratio, (mean, mean - grand, spread, count))
                     for level, mean in means.items()]
        title = (f"Main effects on perplexity ({profile}), {model}, {ratio:.0%} (balanced comparisons; λ_best: "
                 f"{lambda_rule})")
        tables.append(Table(title, tuple(Column(m.header, "", m) for m in (MEAN_PPL, EFFECT, SPREAD, COUNT)),
                            tuple(rows)))
        pairs = [(f"{names[a]} × {names[b]}", interaction(points, a, b)) for a, b in combinations(range(len(names)), 2)]
        tables.append(Table(f"Two-way interactions ({profile}), {model}, {ratio:.0%}: RMS of the residual of the "
                            "two-way means (0: the effects add up)", (Column(INTERACTION.header, "", INTERACTION),),
                            tuple(Row(label, ratio, (value,)) for label, value in pairs if value is not None)))
    return [t for t in tables if t.rows]


def draw(model: str, ratio: float, points: dict[Levels, float], profile: str) -> Figure | None:
    """One panel per factor with more than one level (its level means), then selection × compensation: the
    two-way means, one line per selection."""
    names = list(FACTORS)
    panels = [(i, means) for i, _ in enumerate(names) if (means := level_means(points, i)[0])]
    pair = two_way_means(points, 0, 1)
    if not panels:
        return None
    figure = Figure(figsize=(3.6 * (len(panels) + (pair is not None)), 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(1, len(panels) + (pair is not None), squeeze=False)[0])
    for ax, (i, means) in zip(axes, panels, strict=False):
        ax.plot([str(level) for level in means], list(means.values()), marker="o", linestyle="none", color=f"C{i}")
        ax.set(title=names[i], ylabel=f"mean ppl ({profile})" if ax is axes[0] else None)
        ax.margins(x=0.2)
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    if pair is not None:
        ax = axes[-1]
        compensations = sorted({c for _, c in pair}, key=str)
        for k, selection in enumerate(sorted({s for s, _ in pair}, key=str)):
            ax.plot(compensations, [pair[selection, c] for c in compensations], marker="o", color=f"C{k}",
                    label=selection)
        ax.set(title="selection × compensation")
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
        ax.legend(fontsize="x-small", frameon=False)
    figure.suptitle(f"{model}, {ratio:.0%}: level means over balanced comparisons")
    return figure


def write_plots(results: Sequence[StoredResult], out_dir: str | Path, profile: str,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> list[Path]:
    """The main-effects figure of each (model, ratio) of a factorial store as PNG in ``out_dir``; their paths."""
    out_dir, paths = Path(out_dir), []
    for (model, ratio), points in sorted(factorial_points(results, profile, lambda_rule).items()):
        if not all(level_means(points, i)[0] for i in range(3)):  # no balanced selection × compensation × allocation
            continue
        figure = draw(model, ratio, points, profile)
        if figure is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"main_effects_{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}_{ratio:g}.png"
        figure.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
        paths.append(path)
    return paths
