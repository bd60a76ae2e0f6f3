"""The paper's own numbers, transcribed in ``reference/rcpu_paper_tables.csv`` of the shared directory: looked up
beside ours (``rcpu-bench tables --reference paper``) and rebuilt as tables to check their printed marks."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from rcpu_bench.paths import shared_dir
from rcpu_bench.tables.layout import ROT, RowKey, Slot, row_order
from rcpu_bench.tables.results import METRICS
from rcpu_bench.tables.table import ORIGINAL, Column, Mark, Row, Table, join, table_marks

PAPER_CSV = Path("reference") / "rcpu_paper_tables.csv"


@dataclass(frozen=True)
class PaperCell:
    """One cell of the paper's tables, as transcribed in the reference CSV."""

    table: str
    label: str
    model: str
    n_calib: int | None
    method: str
    ratio: float
    metric: str
    value: float
    mark: Mark | None


@dataclass
class PaperNumbers:
    """The paper's tables; ``value`` looks a cell up by our table's kind, slot, row and metric."""

    cells: tuple[PaperCell, ...]
    index: dict[tuple, float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.index = {}
        for cell in self.cells:
            key = (cell.table, cell.model, cell.n_calib, cell.method, round(cell.ratio, 6), cell.metric)
            if key in self.index:
                raise ValueError(f"the paper CSV has two cells for {key}")
            self.index[key] = cell.value

    def reports(self, kind: str, slot: Slot, metric: str) -> bool:
        """Whether the paper's tables of ``kind`` have a number of ``metric`` for this (model, N_calib) (else no
        "(paper)" column there); a paper cell without N_calib stands for every N_calib."""
        model, n_calib = slot
        return any(cell.table == kind and cell.metric == metric and cell.model == model
                   and cell.n_calib in (n_calib, None) for cell in self.cells)

    def value(self, kind: str, slot: Slot, row: RowKey, metric: str) -> float | None:
        """The paper's number, or None; a paper cell without N_calib stands for every N_calib."""
        (model, n_calib), (label, ratio) = slot, row
        for n in (n_calib, None):
            key = (kind, model, n, label, round(ratio, 6), metric)
            if key in self.index:
                return self.index[key]
        return None


def read_paper(path: str | Path | None = None) -> PaperNumbers:
    """The reference CSV (default: ``reference/rcpu_paper_tables.csv`` in the shared directory)."""
    path = Path(path) if path else shared_dir() / PAPER_CSV
    with open(path, newline="", encoding="utf-8") as handle:
        return PaperNumbers(tuple(_paper_cell(row) for row in csv.DictReader(handle)))


def _paper_cell(row: dict[str, str]) -> PaperCell:
    ratio = float(row["ratio"].rstrip("%")) / 100
    mark = row["mark"] or None
    if mark not in (None, "bold", "underline"):
        raise ValueError(f"paper CSV mark {mark!r} in {row}; allowed: bold, underline or empty")
    return PaperCell(row["table"], row["label"], row["model"], int(row["n_calib"]) if row["n_calib"] else None,
                     _paper_method(row["table"], row["method"], ratio), ratio, row["metric"], float(row["value"]),
                     mark)  # type: ignore[arg-type]  # checked just above


def _paper_method(table: str, method: str, ratio: float) -> str:
    """Our row label for a paper row. The efficiency table calls every row "RCPU": its 0% row is the dense
    model (our Original), the others RCPU (Rot.), whose SVD of M its text discusses."""
    if table != "efficiency":
        return method
    return ORIGINAL if ratio == 0 else ROT


def _paper_layout(paper: PaperNumbers, label: str) -> tuple[list[PaperCell], list[RowKey], list[tuple]]:
    """One paper table's cells, its rows in our order and its (model, N_calib, metric) columns in CSV order."""
    cells = [c for c in paper.cells if c.label == label]
    if not cells:
        labels = ", ".join(sorted({c.label for c in paper.cells}))
        raise ValueError(f"no table {label!r} in the paper CSV; labels: {labels}")
    rows = sorted({(c.method, c.ratio) for c in cells}, key=row_order)
    columns = list(dict.fromkeys((c.model, c.n_calib, c.metric) for c in cells))
    return cells, rows, columns


def paper_table(paper: PaperNumbers, label: str) -> Table:
    """The paper's own numbers of one table (by its LaTeX label) as a Table."""
    cells, rows, columns = _paper_layout(paper, label)
    values = {(c.method, c.ratio, c.model, c.n_calib, c.metric): c.value for c in cells}
    return Table(f"{label} (paper)",
                 tuple(Column(join(f"N_calib={n}" if n else "", METRICS[m].header), model, METRICS[m])
                       for model, n, m in columns),
                 tuple(Row(method, ratio, tuple(values.get((method, ratio, *column)) for column in columns))
                       for method, ratio in rows))


def mark_disagreements(paper: PaperNumbers, label: str) -> list[tuple[PaperCell, Mark | None]]:
    """The cells of one paper table whose printed mark differs from the mark its numbers get from
    :func:`rcpu_bench.tables.table.table_marks`, each with the computed mark."""
    cells, rows, columns = _paper_layout(paper, label)
    marks = table_marks(paper_table(paper, label))
    computed = [(c, marks.get((rows.index((c.method, c.ratio)), columns.index((c.model, c.n_calib, c.metric)))))
                for c in cells]
    return [(c, mark) for c, mark in computed if mark != c.mark]
