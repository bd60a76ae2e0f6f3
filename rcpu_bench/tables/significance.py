"""Paired comparisons of two runs on the same evaluation items, and the ranking tables built from them.

Two runs of one model evaluated on the same windows (perplexity) or documents (zero-shot accuracy) are compared by
a paired bootstrap: B resamples of the items, drawn with replacement and the same for both runs, give B values of
the difference of the statistic; their 2.5 % and 97.5 % percentiles bound the 95 % confidence interval. An
ordering whose interval holds 0 is a tie. For perplexity the statistic is exp(Σ_w NLL_w / Σ_w T_w) over the
resampled windows w (NLL_w: a window's summed negative log-likelihood, T_w: its scored tokens; both recorded per
window). For the mean zero-shot accuracy each task's documents are resampled on their own (a stratified bootstrap)
and the tasks' accuracies averaged, as the tables average them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rcpu_bench.evaluation.metric_maps import METRIC_MAPS
from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.records import Perplexity, Record
from rcpu_bench.tables.layout import Slot, any_row, cell_grid
from rcpu_bench.tables.results import Metric, task_scores
from rcpu_bench.tables.table import ORIGINAL, Column, Row, Table

RESAMPLES = 4000
LEVEL = 0.95
SEED = 0  # every comparison draws its resamples from a generator seeded with this: tables are reproducible


@dataclass(frozen=True)
class Difference:
    """A difference A − B of a statistic and its bootstrap confidence interval [low, high]."""

    estimate: float
    low: float
    high: float

    @property
    def tie(self) -> bool:
        """Whether the interval holds 0: the data do not order A and B."""
        return self.low <= 0 <= self.high

    def text(self, decimals: int) -> str:
        return f"{self.estimate:+.{decimals}f} [{self.low:+.{decimals}f}, {self.high:+.{decimals}f}]"


def resample_counts(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of ``n`` items is drawn in each of ``resamples`` bootstrap resamples: (resamples, n)."""
    return rng.multinomial(n, np.full(n, 1 / n), size=resamples)


def interval(estimate: float, draws: np.ndarray, level: float = LEVEL) -> Difference:
    """The percentile interval of the bootstrap ``draws`` around ``estimate``."""
    low, high = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return Difference(estimate, float(low), float(high))


def window_values(entry: Perplexity) -> tuple[np.ndarray, np.ndarray]:
    """A perplexity's per-window NLL sums and scored-token counts (ValueError when the run did not record them:
    records written before per-window values were kept)."""
    if entry.window_nll is None or entry.window_targets is None:
        raise ValueError(f"perplexity {entry.profile!r} has no per-window values (recorded before rcpu-bench kept "
                         "them); run the cell again")
    return np.asarray(entry.window_nll, dtype=np.float64), np.asarray(entry.window_targets, dtype=np.float64)


def ppl_difference(a: Perplexity, b: Perplexity, *, resamples: int = RESAMPLES, seed: int = SEED) -> Difference:
    """ppl(A) − ppl(B) on the same windows (two perplexities of one profile), with its paired bootstrap CI."""
    nll_a, targets = window_values(a)
    nll_b, targets_b = window_values(b)
    if a.profile != b.profile or not np.array_equal(targets, targets_b):
        raise ValueError(f"perplexities {a.profile!r} and {b.profile!r} are not on the same windows")
    counts = resample_counts(len(targets), resamples, np.random.default_rng(seed))  # (B, n)
    tokens = counts @ targets  # (B,)
    draws = np.exp(counts @ nll_a / tokens) - np.exp(counts @ nll_b / tokens)
    total = targets.sum()
    return interval(math.exp(nll_a.sum() / total) - math.exp(nll_b.sum() / total), draws)


def accuracy_difference(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *,
                        resamples: int = RESAMPLES, seed: int = SEED) -> Difference:
    """Mean over tasks of accuracy(A) − accuracy(B), in percentage points, from per-document scores {task: [0/1,
    ...]} of the same documents, with its stratified paired bootstrap CI."""
    if set(a) != set(b) or not a:
        raise ValueError(f"accuracies on different tasks: {sorted(a)} and {sorted(b)}")
    rng = np.random.default_rng(seed)
    draws, estimates = np.zeros(resamples), []
    for task in sorted(a):
        diff = 100 * (np.asarray(a[task], dtype=np.float64) - np.asarray(b[task], dtype=np.float64))
        if len(a[task]) != len(b[task]) or not len(diff):
            raise ValueError(f"task {task}: {len(a[task])} and {len(b[task])} documents; allowed: the same documents")
        draws += resample_counts(len(diff), resamples, rng) @ diff / len(diff)
        estimates.append(diff.mean())
    return interval(float(np.mean(estimates)), draws / len(a))


def task_items(record: Record, metric_map: str = "paper") -> dict[str, list[float]] | None:
    """Per paper task, the per-document scores of the metric ``metric_map`` shows; None when any is missing."""
    scores = task_scores(record)
    items = {}
    for task, metric in METRIC_MAPS[metric_map].items():
        summary = scores.get(task, {})
        if summary.get("metric") != metric or "items" not in summary:
            return None
        items[task] = summary["items"]
    return items


# ---------------------------------------------------------------------------------------------- ranking tables

RANK_COLUMNS = ("value", "Δ vs next better, 95% CI", "vs next", "Δ vs best, 95% CI", "vs best")


@dataclass(frozen=True)
class Ranked:
    """One run of a ranking: its row label, value and what ``compare(other)`` needs."""

    label: str
    value: float
    payload: Any


def _ranking_rows(ranked: list[Ranked], ratio: float, compare: Any, decimals: int, lower: bool) -> list[Row]:
    """Rows best first: each row's value, its paired difference to the row above and to the best, and ties."""
    ranked = sorted(ranked, key=lambda r: r.value if lower else -r.value)
    rows = []
    for i, run in enumerate(ranked):
        cells: list[Any] = [run.value]
        for other in (ranked[i - 1] if i else None, ranked[0] if i else None):
            if other is None:
                cells += ["", ""]
                continue
            difference = compare(run.payload, other.payload)
            cells += [difference.text(decimals), "tie" if difference.tie else "worse"]
        rows.append(Row(run.label, ratio, tuple(cells)))
    return rows


UNRANKED = "not ranked: "  # the text of a run's comparison cell when it cannot be compared
OLD_WINDOWS = "no per-window values (recorded before rcpu-bench kept them; run the cell again)"
OLD_ITEMS = "no per-document scores (recorded before rcpu-bench kept them; run the cell again)"


def ranking_tables(results: Sequence[StoredResult], profile: str, *, metric_map: str = "paper",
                   lambda_rule: str = DEFAULT_LAMBDA_RULE, accuracy: bool = True) -> list[Table]:
    """Per (model, N_calib): the runs of each ratio ranked by perplexity under ``profile``, and (``accuracy``) by
    mean zero-shot accuracy where they have per-document scores, each beside its paired bootstrap difference to the
    run ranked just above it and to the best (module docstring). The dense model is left out; ties are named. A run
    that has the measurement but cannot be compared (no per-window values or per-document scores: recorded before
    they were kept) is a row below the ranked ones, its value shown and the reason in its comparison cell."""
    grid = cell_grid(results, any_row, lambda_rule)
    by_slot: dict[Slot, dict[float, list[tuple[str, Record]]]] = {}
    for (slot, (label, ratio)), chosen in grid.items():
        if label != ORIGINAL and ratio > 0:
            by_slot.setdefault(slot, {}).setdefault(ratio, []).append((label, chosen.result.record))
    tables = []
    for (model, n_calib), ratios in sorted(by_slot.items()):
        ppl_rows, accuracy_rows = [], []
        for ratio, runs in sorted(ratios.items()):
            ppl = [(label, entry) for label, record in runs
                   if (entry := next((p for p in record.perplexity if p.profile == profile), None)) is not None]
            ppl_rows += _ranking_rows([Ranked(label, entry.ppl, entry) for label, entry in ppl
                                       if entry.window_nll is not None], ratio, ppl_difference, 2, lower=True)
            ppl_rows += [_unranked(label, ratio, entry.ppl, OLD_WINDOWS) for label, entry in ppl
                         if entry.window_nll is None]
            scored = [(label, record, task_items(record, metric_map)) for label, record in runs]
            accuracy_rows += _ranking_rows(
                [Ranked(label, _mean_accuracy(found), found) for label, _, found in scored if found is not None],
                ratio, accuracy_difference, 2, lower=False)
            accuracy_rows += [_unranked(label, ratio, None, reason) for label, record, found in scored
                              if found is None and (reason := _items_missing(record, metric_map))]
        where = f"{model}, N_calib={n_calib}"
        tables.append(Table(f"Ranking by perplexity ({profile}), {where}: paired bootstrap over windows "
                            f"({RESAMPLES} resamples); 'tie': the 95% CI of the difference holds 0",
                            _columns("ppl"), tuple(ppl_rows)))
        if accuracy:
            tables.append(Table(f"Ranking by mean zero-shot accuracy (%, metric map {metric_map}), {where}: "
                                f"stratified paired bootstrap over documents ({RESAMPLES} resamples); 'tie': the 95% "
                                "CI holds 0", _columns("mean acc."), tuple(accuracy_rows)))
    return [table for table in tables if table.rows]


def _mean_accuracy(items: Mapping[str, Sequence[float]]) -> float:
    return 100 * float(np.mean([np.mean(values) for values in items.values()]))


def _unranked(label: str, ratio: float, value: float | None, reason: str) -> Row:
    return Row(label, ratio, (value, UNRANKED + reason, "", "", ""))


def _items_missing(record: Record, metric_map: str) -> str | None:
    """Why a run with zero-shot scores has no per-document scores of ``metric_map``'s tasks (None: no zero-shot)."""
    scores = task_scores(record)
    if not scores:
        return None
    for task, metric in METRIC_MAPS[metric_map].items():
        summary = scores.get(task, {})
        if not summary:
            return f"no {task} accuracy"
        if summary.get("metric") != metric:
            return f"{task} scored by {summary.get('metric')}, not {metric} (metric map {metric_map})"
    return OLD_ITEMS


def unranked(tables: Sequence[Table]) -> list[str]:
    """Each unranked run of ranking ``tables`` (any others are skipped): its label, ratio, what it is not ranked by,
    and why."""
    return [f"{row.label} at {row.ratio:.0%} by {table.title.split(' (')[0].removeprefix('Ranking by ')}: "
            f"{row.cells[1][len(UNRANKED):]}"
            for table in tables for row in table.rows
            if len(row.cells) > 1 and isinstance(row.cells[1], str) and row.cells[1].startswith(UNRANKED)]


def _columns(value: str) -> tuple[Column, ...]:
    return (Column(value, metric=Metric(value, value, None)), *(Column(header) for header in RANK_COLUMNS[1:]))
