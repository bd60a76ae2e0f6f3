"""Which runs make which rows and columns of which table.

Rows are method × pruning ratio, grouped by ratio with the Original row first. A row's label is computed from
the run's final PruneConfig (:func:`rcpu_bench.pruning.methods.label_of`): runs of a named method (the paper's
rows) go to the main tables, other scorer × compensator combinations to separate "other" tables (the efficiency
table holds both), and RCPU (Rot.) runs compensating fewer modules to the ablation. Columns are grouped by slot,
(model, N_calib).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from rcpu_bench.evaluation.perplexity import get_profile
from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE, LAMBDA_RULES, Chosen, resolve
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.pruning.methods import MODULES, RECIPES, cell_label, label_of
from rcpu_bench.tables.results import (
    EFFICIENCY,
    EFFICIENCY_EXTRACTS,
    LAMBDA,
    LLAMA_CPP_SPEED,
    LLAMA_CPP_SPEED_EXTRACTS,
    MEASURED_ONLY,
    PAPER_PROFILE,
    PPL,
    Extract,
    Metric,
    ppl_of,
    zeroshot_metrics,
)
from rcpu_bench.tables.table import Column, Row, Table, Value, join

ROT = RECIPES["rcpu-rot"].label
BOTH_MODULES = frozenset(MODULES)
ABLATION_LABELS = {
    frozenset(): f"{ROT} compensating none",
    frozenset({"attention"}): f"{ROT} compensating o_proj only",
    frozenset({"mlp"}): f"{ROT} compensating down_proj only",
    BOTH_MODULES: f"{ROT} compensating both",
}
ROW_ORDER = [recipe.label for recipe in RECIPES.values()] + list(ABLATION_LABELS.values())
TABLE_KINDS = ("ppl", "ppl-other", "zeroshot", "zeroshot-other", "ablation", "efficiency", "ranking",
               "ranking-ppl", "generalisation", "main-effects")
RANKINGS = ("ranking", "ranking-ppl")  # by perplexity and mean zero-shot accuracy, or by perplexity alone

Slot = tuple[str, int]  # (model label, N_calib): one column group, or one table of a per-slot kind
RowKey = tuple[str, float]  # (row label, pruning ratio)
RowOf = Callable[[StoredResult], "str | None"]  # the row label of a run, None when it is not in the table
Getter = Callable[[RowKey], Value]


class Reference(Protocol):
    """Numbers to show beside ours (:class:`rcpu_bench.tables.paper.PaperNumbers`, the paper's own)."""

    def reports(self, kind: str, slot: Slot, metric: str) -> bool: ...

    def value(self, kind: str, slot: Slot, row: RowKey, metric: str) -> float | None: ...


def compensates_pruned(result: StoredResult) -> bool:
    """Whether a run prunes something and compensates every module it prunes."""
    prune = result.prune
    return bool(prune["prune"]) and set(prune["prune"]) <= set(prune["compensate"])


def relatively_damped(result: StoredResult) -> bool:
    """Whether a run's ridge λ is a damping relative to G_KK (``lam_rel``), not a value of the λ grid."""
    return result.prune["compensator_params"].get("lam_rel") is not None


def any_row(result: StoredResult) -> str | None:
    """The row of a run compensating what it prunes in a main or an "other" table."""
    return method_row(result) or other_row(result)


SCALE_VOID = "scale void: post-norm"
# A run pruning one module only is its method's row with this mark (runs of both modules have none); a run asked to
# prune both whose ratio removed no unit of one says so after the mark.
SCOPE = {frozenset({"mlp"}): "MLP channels only", frozenset({"attention"}): "heads only"}
NONE_REMOVED = {"attention": "the ratio removes no head", "mlp": "the ratio removes no channel"}


def unpruned_modules(result: StoredResult) -> frozenset[str]:
    """The modules the run was asked to prune that lost no unit in any layer (its record's layer reports)."""
    layers = result.record.layers or []
    return frozenset(m for m in result.prune["prune"]
                     if layers and all(layer[m]["units_pruned"] == 0 for layer in layers if m in layer))


def scale_void(result: StoredResult) -> bool:
    """Whether a module's post-norm divided out the compensator's scale (``scale_void`` in the record's module
    reports, ``rcpu_bench.pruning.layer_pass.post_norm_notes``): e.g. Gemma's scaled-procrustes is procrustes."""
    return any(report.get("scale_void") for layer in result.record.layers or []
               for report in layer.values() if isinstance(report, dict))


def _marked(label: str, result: StoredResult) -> str:
    """The row label with its marks in one bracket: the run prunes heads or channels of one module only (``SCOPE``;
    not the dense model, nor a method removing layers or slicing the hidden size, which ``prune`` does not steer),
    and it is not the distinct method its name says (``scale_void``). One bracket, because Markdown reads two
    adjacent ones as a reference link."""
    marks = []
    prune = result.prune
    unpruned = unpruned_modules(result)
    pruned = frozenset(prune["prune"]) - unpruned
    if prune["ratio"] > 0 and prune["model_method"] is None and pruned in SCOPE:
        marks.append(": ".join([SCOPE[pruned], *(NONE_REMOVED[m] for m in sorted(unpruned))]))
    if scale_void(result):
        marks.append(SCALE_VOID)
    return f"{label} [{'; '.join(marks)}]" if marks else label


def method_row(result: StoredResult) -> str | None:
    """The row of a main table: the named method (the paper's rows) of a run compensating what it prunes."""
    label = label_of(result.prune) if compensates_pruned(result) else None
    return None if label is None else _marked(label, result)


def other_row(result: StoredResult) -> str | None:
    """The row of an "other" table: a run compensating what it prunes with no named method's configuration, under
    its label from the final configuration (e.g. ``wanda-sp+ridge``)."""
    if not compensates_pruned(result) or label_of(result.prune) is not None:
        return None
    return _marked(cell_label(result.cell.to_json()), result)


def ablation_row(result: StoredResult) -> str | None:
    """The row of the ablation table: RCPU (Rot.) runs pruning both modules, by the modules compensated."""
    prune = result.prune
    if label_of(prune) != ROT or set(prune["prune"]) != BOTH_MODULES:
        return None
    return ABLATION_LABELS[frozenset(prune["compensate"])]


def selected(results: Sequence[StoredResult], rows: str | None = None,
             ratios: Sequence[float] | None = None) -> list[StoredResult]:
    """The runs whose row label fully matches the regular expression ``rows`` (their label in a main, "other" or
    ablation table, marks included) and whose ratio is one of ``ratios`` (None: any): the tables are then built from
    them alone, so a ranking compares the rows shown."""
    pattern = None if rows is None else re.compile(rows)
    return [result for result in results
            if (ratios is None or result.ratio in ratios)
            and (pattern is None or any(label is not None and pattern.fullmatch(label)
                                        for label in (any_row(result), ablation_row(result))))]


def row_order(row: RowKey) -> tuple[float, int, str]:
    """Rows by ratio, then the paper's method order (whatever the marks), then other labels alphabetically."""
    label, ratio = row
    method = label.split(" [")[0]
    return ratio, ROW_ORDER.index(method) if method in ROW_ORDER else len(ROW_ORDER), label


def slot_of(result: StoredResult) -> Slot:
    return result.model_label, result.n_calib


def cell_grid(results: Sequence[StoredResult], row: RowOf, lambda_rule: str = DEFAULT_LAMBDA_RULE
              ) -> dict[tuple[Slot, RowKey], Chosen]:
    """The chosen run per (slot, row). An unpruned model does not depend on its calibration set, so an unpruned
    row fills every N_calib column of its model, as the paper's Original row does."""
    def key(result: StoredResult) -> tuple[Slot, RowKey] | None:
        label = row(result)
        return None if label is None else (slot_of(result), (label, result.ratio))

    grid = resolve(results, key, lambda_rule)
    unpruned: dict[tuple[str, RowKey], Chosen] = {}
    for (slot, row_key), found in grid.items():
        if row_key[1] == 0:
            unpruned.setdefault((slot[0], row_key), found)
    shared = {(slot, row_key): found for slot, _ in grid for (model, row_key), found in unpruned.items()
              if model == slot[0]}
    return {**shared, **grid}


@dataclass(frozen=True)
class Spec:
    """How one kind of table is made from stored runs."""

    title: str
    row: RowOf
    metrics: tuple[tuple[Metric, Extract], ...]
    per_slot: bool  # one table per (model, N_calib), else one table with a column group per slot
    paper: str  # the table kind in the paper CSV (none for the "other" kinds)


OTHERS = " of other scorer × compensator combinations"
DATASET_NAMES = {"wikitext2-test": "WikiText-2", "wikitext2-test-bos": "WikiText-2 (BOS per window)",
                 "tinystories": "TinyStories"}


def spec(kind: str, profile: str = PAPER_PROFILE, metric_map: str = "paper") -> Spec:
    """The spec of one table kind."""
    row, of = (other_row, OTHERS) if kind.endswith("-other") else (method_row, "")
    if kind in ("ppl", "ppl-other"):
        dataset = get_profile(profile).dataset
        dataset = DATASET_NAMES.get(dataset, dataset)
        return Spec(f"{dataset} perplexity{of} ({profile}, lower is better)", row, ((PPL, ppl_of(profile)),),
                    per_slot=False, paper=kind)
    if kind == "ablation":
        return Spec(f"{ROT}: perplexity ({profile}) by compensated module", ablation_row,
                    ((PPL, ppl_of(profile)),), per_slot=False, paper="ablation")
    if kind in ("zeroshot", "zeroshot-other"):
        return Spec(f"Zero-shot accuracy{of} (%, metric map {metric_map}, higher is better)", row,
                    zeroshot_metrics(metric_map), per_slot=True, paper=kind)
    if kind == "efficiency":
        return Spec("Pruned model size, pruning cost and speed", any_row,
                    tuple(zip((*EFFICIENCY, *LLAMA_CPP_SPEED), (*EFFICIENCY_EXTRACTS, *LLAMA_CPP_SPEED_EXTRACTS),
                              strict=True)), per_slot=True, paper="efficiency")
    raise ValueError(f"unknown table {kind!r}; allowed: {', '.join(TABLE_KINDS)}, all")


def build_tables(results: Sequence[StoredResult], table_spec: Spec, paper: Reference | None,
                 lambda_rule: str = DEFAULT_LAMBDA_RULE) -> list[Table]:
    """The tables of one spec: per slot, or one table with a column group per slot."""
    grid = cell_grid(results, table_spec.row, lambda_rule)
    slots = _slot_order(results, {slot for slot, _ in grid})
    if table_spec.per_slot:
        tables = [_assemble(f"{table_spec.title}: {model}, N_calib={n}", table_spec, [(model, n)], grid, paper,
                            lambda_rule) for model, n in slots]
    else:
        tables = [_assemble(table_spec.title, table_spec, slots, grid, paper, lambda_rule)]
    return [t for t in tables if t.rows]


def _slot_order(results: Sequence[StoredResult], slots: set[Slot]) -> list[Slot]:
    """Smaller models first (by parameter count before pruning), then by N_calib."""
    size: dict[str, float] = {}
    for result in results:
        size[result.model_label] = max(size.get(result.model_label, 0), result.record.parameters.before)
    return sorted(slots, key=lambda slot: (size.get(slot[0], 0), slot))


def _assemble(title: str, table_spec: Spec, slots: Sequence[Slot], grid: Mapping[tuple[Slot, RowKey], Chosen],
              paper: Reference | None, lambda_rule: str) -> Table:
    """A table over some slots; rows with none of our values are left out; a λ column names the rule."""
    pairs = [pair for slot in slots for pair in _slot_columns(table_spec, slot, grid, paper)]
    ours = [j for j, (column, _) in enumerate(pairs) if column.metric not in (None, LAMBDA) and not column.reference]
    rows = []
    for key in sorted({row for slot, row in grid if slot in slots}, key=row_order):
        cells = tuple(get(key) for _, get in pairs)
        if any(cells[j] is not None for j in ours):
            rows.append(Row(key[0], key[1], cells))
    if any(column.metric is LAMBDA for column, _ in pairs):
        title = f"{title}. {LAMBDA.header}: {LAMBDA_RULES[lambda_rule]}"
    return Table(title, tuple(column for column, _ in pairs), tuple(rows))


def _slot_columns(table_spec: Spec, slot: Slot, grid: Mapping[tuple[Slot, RowKey], Chosen],
                  paper: Reference | None) -> list[tuple[Column, Getter]]:
    """One slot's columns and how to fill them: each metric (then the paper's, where the paper has numbers for
    this slot; a metric of ``MEASURED_ONLY`` only where a row of the slot has it), then λ_best if any row has a λ."""
    model, n_calib = slot
    prefix, group = ("", "") if table_spec.per_slot else (f"N_calib={n_calib}", model)
    found = {row: chosen for (s, row), chosen in grid.items() if s == slot}
    shown = [(metric, extract) for metric, extract in table_spec.metrics if metric.key not in MEASURED_ONLY
             or any(extract(chosen.result.record) is not None for chosen in found.values())]
    pairs: list[tuple[Column, Getter]] = []
    for metric, extract in shown:
        header = join(prefix, metric.header)
        pairs.append((Column(header, group, metric), _ours(found, extract)))
        if paper is not None and paper.reports(table_spec.paper, slot, metric.key):
            pairs.append((Column(join(header, "(paper)"), group, metric, reference=True),
                          _theirs(paper, table_spec.paper, slot, metric.key)))
    if any(chosen.lam is not None for chosen in found.values()):
        pairs.append((Column(join(prefix, LAMBDA.header), group, LAMBDA), _lam(found)))
    return pairs


def _ours(found: Mapping[RowKey, Chosen], extract: Extract) -> Getter:
    return lambda row: extract(found[row].result.record) if row in found else None


def _theirs(paper: Reference, kind: str, slot: Slot, metric: str) -> Getter:
    return lambda row: paper.value(kind, slot, row, metric)


NO_GRID = "{:.0e}, no grid"  # a λ not chosen: the only λ run of its place


def _lam(found: Mapping[RowKey, Chosen]) -> Getter:
    """λ_best where a grid was compared; the one λ, said to be no choice, where a place has a single λ run."""
    def get(row: RowKey) -> float | str | None:
        chosen = found.get(row)
        if chosen is None or chosen.lam is None:
            return None
        return chosen.lam if chosen.compared > 1 else NO_GRID.format(chosen.lam)
    return get
