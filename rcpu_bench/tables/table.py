"""A table as data (columns, rows of values) and its bold / underline marks, independent of any format."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rcpu_bench.pruning.methods import RECIPES
from rcpu_bench.tables.results import Better, Metric

ORIGINAL = RECIPES["original"].label

Mark = Literal["bold", "underline"]
Value = float | str | None  # one cell of a table


@dataclass(frozen=True)
class Column:
    """One column: ours (marked when its metric has a direction), or the paper's (``reference``, never marked)."""

    header: str
    group: str = ""
    metric: Metric | None = None
    reference: bool = False

    @property
    def ranked(self) -> bool:
        return self.metric is not None and self.metric.better is not None and not self.reference


@dataclass(frozen=True)
class Row:
    label: str
    ratio: float
    cells: tuple[Value, ...]


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]


def rank_marks(values: Sequence[float | None], better: Better) -> list[Mark | None]:
    """Bold the best value, underline the second best. Ties share a mark and use up the places below them
    (competition ranking: 1, 1, 3 gives two bold and no underline, as the paper does); None is never marked,
    and nothing is marked when fewer than two distinct values are compared."""
    if better not in ("lower", "higher"):
        raise ValueError(f"unknown direction {better!r}; allowed: lower, higher")
    sign = 1 if better == "lower" else -1
    present = [sign * v for v in values if v is not None]
    if len(set(present)) < 2:
        return [None] * len(values)
    places: dict[int, Mark] = {1: "bold", 2: "underline"}
    return [None if v is None else places.get(1 + sum(other < sign * v for other in present)) for v in values]


def table_marks(table: Table) -> dict[tuple[int, int], Mark]:
    """The marks of a table by (row, column) index: every ranked column within each ratio group, values tied at
    their printed precision, the Original row left out as in the paper."""
    marks: dict[tuple[int, int], Mark] = {}
    indices = range(len(table.rows))
    for _, group in itertools.groupby(indices, key=lambda i: table.rows[i].ratio):
        ranked = [i for i in group if table.rows[i].label != ORIGINAL]
        for j, column in enumerate(table.columns):
            if not column.ranked:
                continue
            assert column.metric is not None and column.metric.better is not None
            values = [_tie_value(table.rows[i].cells[j], column.metric) for i in ranked]
            ranks = rank_marks(values, column.metric.better)
            marks.update({(i, j): mark for i, mark in zip(ranked, ranks, strict=True) if mark})
    return marks


def _tie_value(value: Value, metric: Metric) -> float | None:
    return round(value, metric.decimals) if isinstance(value, (int, float)) else None


def join(*parts: str) -> str:
    """Non-empty parts separated by spaces."""
    return " ".join(p for p in parts if p)
