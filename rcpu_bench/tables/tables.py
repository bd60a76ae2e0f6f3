"""The paper's tables from a results store: perplexity, zero-shot accuracy, the compensation ablation and
the pruning cost, as Markdown, LaTeX (booktabs) or CSV, optionally beside the paper's own numbers.

The store is ``<results>/records.jsonl``, one entry per finished matrix cell (``status``, ``cell``, ``record``).
Tables are built from those entries alone. Every table has rows method × pruning ratio (grouped by ratio, the
Original row first) and is rendered by one renderer; bold / underline marks come from one function
(:func:`rank_marks`), applied per column within each ratio group.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Literal

from tabulate import tabulate

from rcpu_bench.pruning.methods import ALIASES, MODULES, label_of
from rcpu_bench.evaluation.metric_maps import METRIC_MAPS
from rcpu_bench.paths import shared_dir
from rcpu_bench.evaluation.perplexity import get_profile
from rcpu_bench.matrix.records import STORE_FILE, read_records
from rcpu_bench.matrix.store import add_results_options, results_dir_of

PAPER_CSV = Path("reference") / "rcpu_paper_tables.csv"
PAPER_PROFILE = "rcpu128"  # the paper's WikiText-2 perplexities use the seqlen-128 protocol
ORIGINAL = ALIASES["original"].label
ROT = ALIASES["rcpu-rot"].label
SHADED = frozenset({ROT, ALIASES["rcpu-rot-scale"].label})  # the paper's gray RCPU rows
BOTH_MODULES = frozenset(MODULES)
ABLATION_LABELS = {
    frozenset(): f"{ROT} compensating none",
    frozenset({"attention"}): f"{ROT} compensating o_proj only",
    frozenset({"mlp"}): f"{ROT} compensating down_proj only",
    BOTH_MODULES: f"{ROT} compensating both",
}
ROW_ORDER = [alias.label for alias in ALIASES.values()] + list(ABLATION_LABELS.values())
TABLE_KINDS = ("ppl", "zeroshot", "ablation", "efficiency")
FORMATS = ("md", "latex", "csv")
NOTE_HEADER = "lambda_best"

Better = Literal["lower", "higher"]
Mark = Literal["bold", "underline"]
Slot = tuple[str, int]  # (model label, N_calib): one column group, or one table of a per-slot kind
RowKey = tuple[str, float]  # (method label, pruning ratio)
Cell = float | str | None
Extract = Callable[[dict[str, Any]], float | None]  # a number from a run record, None when it has none


# ----------------------------------------------------------------------------------------------- the store

@dataclass(frozen=True)
class StoreEntries:
    """The finished (``status == "ok"``) entries of a results store, oldest first; failed ones are only counted."""

    entries: tuple[dict[str, Any], ...]
    failed: int


def read_store(results_dir: str | Path) -> StoreEntries:
    """Read ``<results_dir>/records.jsonl`` (rcpu_bench.matrix.store's format). A torn last line (a killed writer) is
    skipped, and a cell with several entries (a failure, then a retry) counts by its newest one."""
    path = Path(results_dir) / STORE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no results store {path} (expected {STORE_FILE} in the --results directory)")
    try:
        lines = read_records(path)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not a JSONL results store: {error}") from error
    newest: dict[str, tuple[int, dict[str, Any]]] = {}
    for number, line in enumerate(lines, start=1):
        newest.pop(line.get("cell_id"), None)  # re-inserted last: entries stay in the order they finished
        newest[line.get("cell_id")] = number, line
    ok = [(number, line) for number, line in newest.values() if line.get("status") == "ok"]
    for number, line in ok:
        _check_entry(line, f"{path}:{number}")
    return StoreEntries(tuple(line for _, line in ok), len(newest) - len(ok))


_REQUIRED = {"cell": ("model_label", "method_label", "ratio", "n_calib"),
             "record": ("experiment", "perplexity", "parameters", "timing", "peak_memory_bytes")}


def _check_entry(entry: dict[str, Any], where: str) -> None:
    """Refuse a finished entry without the fields the tables read, naming the line and the fields."""
    for part, keys in _REQUIRED.items():
        missing = [key for key in keys if key not in (entry.get(part) or {})]
        if missing:
            raise ValueError(f"{where}: entry {entry.get('cell_id')} has no {part} field {', '.join(missing)}")


def note_failed(store: StoreEntries) -> None:
    """Tell stderr how many failed entries were skipped."""
    if store.failed:
        print(f"rcpu-bench: {store.failed} failed entries skipped", file=sys.stderr)


@dataclass(frozen=True)
class Resolved:
    """The store entry chosen for one table cell or plot point, with its ridge λ (None for other methods)."""

    entry: dict[str, Any]
    lam: float | None


# Not what a cell computes (as for rcpu_bench.matrix.spec cell ids), nor what it was asked to evaluate.
_NOT_EXPERIMENT = ("matrix", "model_label", "method", "method_label", "device", "ppl_profiles", "eval")
_LAMBDA = ("lam", "prune.compensator_params.lam")


def resolve(entries: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable | None]
            ) -> dict[Any, Resolved]:
    """Group entries by ``key`` (None leaves an entry out) and choose one entry per group (:func:`choose`)."""
    groups: dict[Hashable, list[dict[str, Any]]] = defaultdict(list)
    for entry in entries:
        group = key(entry)
        if group is not None:
            groups[group].append(entry)
    return {group: choose(group, members) for group, members in groups.items()}


def choose(where: Hashable, entries: Sequence[dict[str, Any]]) -> Resolved:
    """One entry for one place of a table: repeats of the same experiment (a re-run, on any device, or the same
    cell in another matrix) keep the last; runs that differ only in the ridge λ give λ_best, the λ with the lowest
    perplexity on the calibration windows (the paper's rule, appendix sec:bestlam); anything else is an error."""
    latest = {_experiment(entry): entry for entry in entries}
    runs = list(latest.values())
    kinds = {_experiment(run, ignore=_LAMBDA): run for run in runs}
    if len(kinds) > 1:
        first, second = list(kinds.values())[:2]
        raise ValueError(f"two different experiments for the same place {where}: cells {first['cell_id']} and "
                         f"{second['cell_id']} differ in {', '.join(_differences(first, second))}")
    best = runs[0] if len(runs) == 1 else min(runs, key=lambda run: (_calibration_ppl(run), run["cell"]["lam"] or 0.0))
    return Resolved(best, best["cell"].get("lam"))


def _flat(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dictionaries as one level with dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _experiment(entry: dict[str, Any], ignore: tuple[str, ...] = ()) -> str:
    """What an entry's cell ran, as a comparable string (its matrix and evaluation requests left out)."""
    cell = {k: v for k, v in _flat(entry["cell"]).items() if k not in _NOT_EXPERIMENT + ignore}
    return json.dumps(cell, sort_keys=True, default=str)


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The experiment fields on which two entries' cells differ, with both values."""
    flat_a, flat_b = _flat(a["cell"]), _flat(b["cell"])
    keys = sorted((flat_a.keys() | flat_b.keys()) - set(_NOT_EXPERIMENT))
    return [f"{k} ({flat_a.get(k)!r} vs {flat_b.get(k)!r})" for k in keys if flat_a.get(k) != flat_b.get(k)]


def _calibration_ppl(entry: dict[str, Any]) -> float:
    value = entry["record"].get("calibration_ppl")
    if value is None:
        raise ValueError(f"cell {entry['cell_id']} has no calibration_ppl in its record; λ_best needs it")
    return value


def prune_config(entry: dict[str, Any]) -> dict[str, Any]:
    """The PruneConfig fields the entry's run recorded."""
    return entry["record"]["experiment"]["prune"]


def method_row(entry: dict[str, Any]) -> str | None:
    """The row of a main table: the method label, for runs that prune and compensate both modules."""
    prune = prune_config(entry)
    full = set(prune["prune"]) == BOTH_MODULES == set(prune["compensate"])
    return entry["cell"]["method_label"] if full else None


def ablation_row(entry: dict[str, Any]) -> str | None:
    """The row of the ablation table: RCPU (Rot.) runs pruning both modules, by the modules compensated."""
    prune = prune_config(entry)
    if label_of(prune) != ROT or set(prune["prune"]) != BOTH_MODULES:
        return None
    return ABLATION_LABELS[frozenset(prune["compensate"])]


def slot_of(entry: dict[str, Any]) -> Slot:
    return entry["cell"]["model_label"], entry["cell"]["n_calib"]


def cell_grid(entries: Iterable[dict[str, Any]], row: Callable[[dict[str, Any]], str | None]
              ) -> dict[tuple[Slot, RowKey], Resolved]:
    """The chosen entry per (slot, row). An unpruned model does not depend on its calibration set, so an
    unpruned row fills every N_calib column of its model, as the paper's Original row does."""
    def key(entry: dict[str, Any]) -> tuple[Slot, RowKey] | None:
        label = row(entry)
        return None if label is None else (slot_of(entry), (label, entry["cell"]["ratio"]))

    grid = resolve(entries, key)
    unpruned: dict[tuple[str, RowKey], Resolved] = {}
    for (slot, row_key), found in grid.items():
        if row_key[1] == 0:
            unpruned.setdefault((slot[0], row_key), found)
    shared = {(slot, row_key): found for slot, _ in grid for (model, row_key), found in unpruned.items()
              if model == slot[0]}
    return {**shared, **grid}


# --------------------------------------------------------------------------------------- metrics and values

@dataclass(frozen=True)
class Metric:
    """What a column shows: its name in the paper CSV, header, direction and number format. ``decimals`` is
    also the precision at which values tie, so cells that print the same share a mark."""

    key: str
    header: str
    better: Better | None
    decimals: int = 2
    style: Literal["fixed", "grouped", "si"] = "fixed"

    def format(self, value: float) -> str:
        if self.style == "si":
            return _si(value)
        return f"{value:,.{self.decimals}f}" if self.style == "grouped" else f"{value:.{self.decimals}f}"


def _si(value: float) -> str:
    """A count with a K / M / B suffix and two decimals, as the paper writes parameter counts (6.73B)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


PPL = Metric("wikitext2_ppl", "", "lower")
TASK_HEADERS = {"boolq": "BoolQ", "piqa": "PIQA", "hellaswag": "Hella", "winogrande": "Wino", "arc_easy": "ARC-e",
                "arc_challenge": "ARC-c", "openbookqa": "OBQA"}
MEAN = Metric("mean", "Mean", "higher")
PRUNE_PHASES = ("statistics", "score", "solve", "forward")  # rcpu_bench.pruning.pipeline's per-layer timings
EFFICIENCY = (Metric("params", "Params", "lower", decimals=0, style="si"),
              Metric("memory_mib", "Peak memory (MiB)", "lower", decimals=0, style="grouped"),
              Metric("seconds_per_layer", "Seconds per layer", "lower"),
              *(Metric(f"{phase}_seconds_per_layer", f"{phase} s/layer", "lower", decimals=3) for phase in PRUNE_PHASES),
              Metric("device", "Device", None),
              Metric("prefill_tokens_per_s", "Prefill tok/s", "higher", decimals=0, style="grouped"),
              Metric("decode_tokens_per_s", "Decode tok/s", "higher", decimals=0, style="grouped"))
METRICS = {m.key: m for m in (PPL, *(Metric(k, h, "higher") for k, h in TASK_HEADERS.items()), MEAN, *EFFICIENCY)}

def ppl_of(profile: str) -> Extract:
    """The perplexity of one profile from a record."""
    def extract(record: dict[str, Any]) -> float | None:
        return next((p["ppl"] for p in record["perplexity"] if p["profile"] == profile), None)
    return extract


def accuracy_of(task: str, metric: str) -> Extract:
    """A zero-shot accuracy in percent from a record."""
    def extract(record: dict[str, Any]) -> float | None:
        value = task_scores(record).get(task, {}).get(metric)
        return None if value is None else 100 * value
    return extract


def task_scores(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A record's zero-shot scores, ``{task: {acc, acc_norm, ...}}`` (fractions), also when nested under ``tasks``
    as ``rcpu_bench.evaluation.zeroshot.evaluate_zeroshot`` returns them; empty when the run had no zero-shot evaluation."""
    result = record.get("zeroshot") or {}
    return result.get("tasks", result)


def mean_of(extracts: Sequence[Extract]) -> Extract:
    """The mean of several values of a record, None unless all are there."""
    def extract(record: dict[str, Any]) -> float | None:
        values = [get(record) for get in extracts]
        return None if any(v is None for v in values) else fmean(values)
    return extract


def _params(record: dict[str, Any]) -> float:
    return record["parameters"]["after"]


def _memory_mib(record: dict[str, Any]) -> float:
    return record["peak_memory_bytes"] / 2**20


def _seconds_per_layer(record: dict[str, Any]) -> float | None:
    timing = record["timing"]
    return sum(timing["prune_seconds"].values()) / len(timing["layers"]) if timing["layers"] else None


def _phase_per_layer(phase: str) -> Extract:
    """Seconds of one pruning phase per layer: Σ_layers t_phase / number of layers; None when no layer has it."""
    def extract(record: dict[str, Any]) -> float | None:
        layers = record["timing"]["layers"]
        times = [layer[phase] for layer in layers if phase in layer]
        return sum(times) / len(layers) if times else None
    return extract


def _device_name(record: dict[str, Any]) -> str:
    """The GPU or CPU model the run was measured on (records before rcpu_bench.matrix.records.environment: the device)."""
    return record.get("environment", {}).get("device_name") or record["experiment"].get("device")


def _inference(key: str) -> Extract:
    """A generation throughput of the pruned model (``record["inference"]``), None when it was not measured."""
    return lambda record: (record.get("inference") or {}).get(key)


def zeroshot_metrics(metric_map: str) -> tuple[tuple[Metric, Extract], ...]:
    """The seven task columns under a named metric map, then their mean."""
    if metric_map not in METRIC_MAPS:
        raise ValueError(f"unknown metric map {metric_map!r}; allowed: {', '.join(METRIC_MAPS)}")
    tasks = [(METRICS[task], accuracy_of(task, metric)) for task, metric in METRIC_MAPS[metric_map].items()]
    return (*tasks, (MEAN, mean_of([extract for _, extract in tasks])))


def default_profile(entries: Sequence[dict[str, Any]]) -> str:
    """The profile shown unless one is asked for: the paper's (rcpu128) when an entry has it, else the store's one
    window range of it (``rcpu128[START:STOP]``, the smoke matrix's recorded subset), else the first profile recorded."""
    found = list(dict.fromkeys(p["profile"] for entry in entries for p in entry["record"]["perplexity"]))
    if not found or PAPER_PROFILE in found:
        return PAPER_PROFILE
    subsets = [name for name in found if name.startswith(f"{PAPER_PROFILE}[")]
    return subsets[0] if len(subsets) == 1 else found[0]


def check_profile(entries: Sequence[dict[str, Any]], profile: str) -> None:
    """Refuse a perplexity profile that no entry has while others have perplexities."""
    found = sorted({p["profile"] for entry in entries for p in entry["record"]["perplexity"]})
    if found and profile not in found:
        raise ValueError(f"no entry has perplexity profile {profile!r}; profiles in the store: {', '.join(found)}")


# ---------------------------------------------------------------------------------------- the table model

@dataclass(frozen=True)
class Column:
    """One column: ours (marked when its metric has a direction), the paper's (``reference``, never marked),
    or a text note (no metric: the λ_best column)."""

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
    cells: tuple[Cell, ...]


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
            values = [_tie_value(table.rows[i].cells[j], column.metric) for i in ranked]
            marks.update({(i, j): mark for i, mark in zip(ranked, rank_marks(values, column.metric.better)) if mark})
    return marks


def _tie_value(value: Cell, metric: Metric) -> float | None:
    return round(value, metric.decimals) if isinstance(value, (int, float)) else None


def percent(ratio: float) -> str:
    return f"{round(ratio * 100, 6):g}%"


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _row_order(row: RowKey) -> tuple[float, int, str]:
    """Rows by ratio, then the paper's method order, then other labels alphabetically."""
    label, ratio = row
    return ratio, ROW_ORDER.index(label) if label in ROW_ORDER else len(ROW_ORDER), label


# ----------------------------------------------------------------------------------- tables from the store

@dataclass(frozen=True)
class Spec:
    """How one kind of table is made from store entries."""

    title: str
    row: Callable[[dict[str, Any]], str | None]  # the row label of an entry, None when it is not in the table
    metrics: tuple[tuple[Metric, Extract], ...]
    per_slot: bool  # one table per (model, N_calib), else one table with a column group per slot
    paper: str  # the table kind in the paper CSV


def spec(kind: str, profile: str = PAPER_PROFILE, metric_map: str = "paper") -> Spec:
    """The spec of one table kind."""
    if kind == "ppl":
        dataset = get_profile(profile).dataset.replace("wikitext2-test", "WikiText-2").replace("tinystories", "TinyStories")
        return Spec(f"{dataset} perplexity ({profile}, lower is better)", method_row, ((PPL, ppl_of(profile)),),
                    per_slot=False, paper="ppl")
    if kind == "ablation":
        return Spec(f"{ROT}: perplexity ({profile}) by compensated module", ablation_row,
                    ((PPL, ppl_of(profile)),), per_slot=False, paper="ablation")
    if kind == "zeroshot":
        return Spec(f"Zero-shot accuracy (%, metric map {metric_map}, higher is better)", method_row,
                    zeroshot_metrics(metric_map), per_slot=True, paper="zeroshot")
    if kind == "efficiency":
        extracts = (_params, _memory_mib, _seconds_per_layer, *map(_phase_per_layer, PRUNE_PHASES), _device_name,
                    _inference("prefill_tokens_per_s"), _inference("decode_tokens_per_s"))
        return Spec("Pruning cost and speed", method_row, tuple(zip(EFFICIENCY, extracts)), per_slot=True, paper="efficiency")
    raise ValueError(f"unknown table {kind!r}; allowed: {', '.join(TABLE_KINDS)}, all")


def make_tables(entries: Sequence[dict[str, Any]], table: str = "all", *, profile: str = PAPER_PROFILE,
                metric_map: str = "paper", paper: PaperNumbers | None = None) -> list[Table]:
    """The tables of one kind (or ``all``) from finished store entries; empty tables are left out."""
    kinds = TABLE_KINDS if table == "all" else (table,)
    specs = [spec(kind, profile, metric_map) for kind in kinds]
    if {"ppl", "ablation"} & set(kinds):
        check_profile(entries, profile)
        if paper is not None and profile != PAPER_PROFILE:
            raise ValueError(f"the paper's perplexities are profile {PAPER_PROFILE}; got --profile {profile}")
    return [t for s in specs for t in build_tables(entries, s, paper)]


def build_tables(entries: Sequence[dict[str, Any]], table_spec: Spec, paper: PaperNumbers | None) -> list[Table]:
    """The tables of one spec: per slot, or one table with a column group per slot."""
    grid = cell_grid(entries, table_spec.row)
    slots = _slot_order(entries, {slot for slot, _ in grid})
    if table_spec.per_slot:
        tables = [_assemble(f"{table_spec.title}: {model}, N_calib={n}", table_spec, [(model, n)], grid, paper)
                  for model, n in slots]
    else:
        tables = [_assemble(table_spec.title, table_spec, slots, grid, paper)]
    return [t for t in tables if t.rows]


def _slot_order(entries: Sequence[dict[str, Any]], slots: set[Slot]) -> list[Slot]:
    """Smaller models first (by parameter count before pruning), then by N_calib."""
    size: dict[str, float] = {}
    for entry in entries:
        model = entry["cell"]["model_label"]
        size[model] = max(size.get(model, 0), entry["record"]["parameters"]["before"])
    return sorted(slots, key=lambda slot: (size.get(slot[0], 0), slot))


Getter = Callable[[RowKey], Cell]


def _assemble(title: str, table_spec: Spec, slots: Sequence[Slot], grid: Mapping[tuple[Slot, RowKey], Resolved],
              paper: PaperNumbers | None) -> Table:
    """A table over some slots; rows with none of our values are left out."""
    pairs = [pair for slot in slots for pair in _slot_columns(table_spec, slot, grid, paper)]
    ours = [j for j, (column, _) in enumerate(pairs) if column.metric is not None and not column.reference]
    rows = []
    for key in sorted({row for slot, row in grid if slot in slots}, key=_row_order):
        cells = tuple(get(key) for _, get in pairs)
        if any(cells[j] is not None for j in ours):
            rows.append(Row(key[0], key[1], cells))
    return Table(title, tuple(column for column, _ in pairs), tuple(rows))


def _slot_columns(table_spec: Spec, slot: Slot, grid: Mapping[tuple[Slot, RowKey], Resolved],
                  paper: PaperNumbers | None) -> list[tuple[Column, Getter]]:
    """One slot's columns and how to fill them: each metric (then the paper's, if asked), then λ_best if any."""
    model, n_calib = slot
    prefix, group = ("", "") if table_spec.per_slot else (str(n_calib), model)
    found = {row: chosen for (s, row), chosen in grid.items() if s == slot}
    pairs: list[tuple[Column, Getter]] = []
    for metric, extract in table_spec.metrics:
        header = _join(prefix, metric.header)
        pairs.append((Column(header, group, metric), _ours(found, extract)))
        if paper is not None and paper.reports(table_spec.paper, metric.key):
            pairs.append((Column(_join(header, "(paper)"), group, metric, reference=True),
                          _theirs(paper, table_spec.paper, slot, metric.key)))
    if any(chosen.lam is not None for chosen in found.values()):
        pairs.append((Column(_join(prefix, NOTE_HEADER), group), _lam_note(found)))
    return pairs


def _ours(found: Mapping[RowKey, Resolved], extract: Extract) -> Getter:
    return lambda row: extract(found[row].entry["record"]) if row in found else None


def _theirs(paper: PaperNumbers, kind: str, slot: Slot, metric: str) -> Getter:
    return lambda row: paper.value(kind, slot, row, metric)


def _lam_note(found: Mapping[RowKey, Resolved]) -> Getter:
    def note(row: RowKey) -> str | None:
        lam = found[row].lam if row in found else None
        return None if lam is None else f"{lam:.0e}"
    return note


# ------------------------------------------------------------------------------------- the paper's numbers

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

    def reports(self, kind: str, metric: str) -> bool:
        """Whether the paper's tables of ``kind`` have any number of ``metric`` (else no "(paper)" column)."""
        return any(cell.table == kind and cell.metric == metric for cell in self.cells)

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
                     _paper_method(row["table"], row["method"], ratio), ratio, row["metric"], float(row["value"]), mark)


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
    rows = sorted({(c.method, c.ratio) for c in cells}, key=_row_order)
    columns = list(dict.fromkeys((c.model, c.n_calib, c.metric) for c in cells))
    return cells, rows, columns


def paper_table(paper: PaperNumbers, label: str) -> Table:
    """The paper's own numbers of one table (by its LaTeX label) as a Table."""
    cells, rows, columns = _paper_layout(paper, label)
    values = {(c.method, c.ratio, c.model, c.n_calib, c.metric): c.value for c in cells}
    return Table(f"{label} (paper)",
                 tuple(Column(_join(str(n or ""), METRICS[m].header), model, METRICS[m]) for model, n, m in columns),
                 tuple(Row(method, ratio, tuple(values.get((method, ratio, *column)) for column in columns))
                       for method, ratio in rows))


def mark_disagreements(paper: PaperNumbers, label: str) -> list[tuple[PaperCell, Mark | None]]:
    """The cells of one paper table whose printed mark differs from the mark its numbers get from
    :func:`table_marks`, each with the computed mark."""
    cells, rows, columns = _paper_layout(paper, label)
    marks = table_marks(paper_table(paper, label))
    computed = [(c, marks.get((rows.index((c.method, c.ratio)), columns.index((c.model, c.n_calib, c.metric)))))
                for c in cells]
    return [(c, mark) for c, mark in computed if mark != c.mark]


# ------------------------------------------------------------------------------------------------ rendering

_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


@dataclass(frozen=True)
class _Style:
    """How one format writes cells: mark templates (None: no marks), raw numbers or the paper's, escaping."""

    marks: Mapping[str, str] | None
    raw: bool
    escape: Callable[[str], str]


_MARKDOWN = _Style({"bold": "**{}**", "underline": "_{}_"}, raw=False, escape=lambda text: text.replace("|", r"\|"))
_LATEX = _Style({"bold": r"\textbf{{{}}}", "underline": r"\underline{{{}}}"}, raw=False, escape=latex_escape)
_CSV = _Style(None, raw=True, escape=str)


def _body(table: Table, style: _Style) -> list[list[str]]:
    """The table's rows as text: label, ratio, then every cell, marked as the style says."""
    marks = table_marks(table) if style.marks else {}
    body = []
    for i, row in enumerate(table.rows):
        ratio = f"{row.ratio:.12g}" if style.raw else style.escape(percent(row.ratio))
        texts = [_cell_text(value, column, style) for value, column in zip(row.cells, table.columns)]
        texts = [style.marks[marks[i, j]].format(text) if (i, j) in marks else text for j, text in enumerate(texts)]
        body.append([style.escape(row.label), ratio, *texts])
    return body


def _cell_text(value: Cell, column: Column, style: _Style) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return style.escape(value)
    return f"{value:.12g}" if style.raw else column.metric.format(value)


def _headers(table: Table) -> list[str]:
    return ["Method", "PR", *(_join(c.group, c.header) for c in table.columns)]


def render_markdown(table: Table) -> str:
    headers = [_MARKDOWN.escape(header) for header in _headers(table)]
    body = tabulate(_body(table, _MARKDOWN), headers=headers, tablefmt="github", disable_numparse=True)
    return f"### {table.title}\n\n{body}\n"


def render_csv(table: Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["table", *_headers(table)])
    writer.writerows([table.title, *row] for row in _body(table, _CSV))
    return out.getvalue()


def render_latex(table: Table) -> str:
    """A booktabs table float: model groups over their columns, a midrule between ratio groups, RCPU rows gray."""
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_escape(table.title)}}}",
             rf"\begin{{tabular}}{{lc{'c' * len(table.columns)}}}", r"\toprule", *_latex_header(table), r"\midrule"]
    previous = None
    for row, cells in zip(table.rows, _body(table, _LATEX)):
        if previous is not None and row.ratio != previous:
            lines.append(r"\midrule")
        previous = row.ratio
        if row.label in SHADED:
            lines.append(r"\rowcolor{gray!15}")
        lines.append(" & ".join(cells) + r" \\")
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}", r"\end{table}"]) + "\n"


def _latex_header(table: Table) -> list[str]:
    """The header rows: a group row with cmidrules when columns have groups, then the column names."""
    headers = ["Method", "PR", *(c.header for c in table.columns)]
    names = " & ".join(rf"\textbf{{{latex_escape(h)}}}" if h else "" for h in headers)
    if not any(c.group for c in table.columns):
        return [names + r" \\"]
    cells, rules, start = ["", ""], [], 3
    for group, members in itertools.groupby(table.columns, key=lambda c: c.group):
        width = len(list(members))
        if group:
            cells.append(rf"\multicolumn{{{width}}}{{c}}{{\textbf{{{latex_escape(group)}}}}}")
            rules.append(rf"\cmidrule(lr){{{start}-{start + width - 1}}}")
        else:
            cells += [""] * width
        start += width
    return [" & ".join(cells) + r" \\", " ".join(rules), names + r" \\"]


RENDERERS: dict[str, Callable[[Table], str]] = {"md": render_markdown, "latex": render_latex, "csv": render_csv}


def render(tables: Sequence[Table], fmt: str = "md") -> str:
    """Tables in one format, separated by blank lines."""
    if fmt not in RENDERERS:
        raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(RENDERERS)}")
    return "\n".join(RENDERERS[fmt](table) for table in tables)


# ------------------------------------------------------------------------------------------------------ CLI

def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``tables`` to the CLI's subcommands."""
    p = commands.add_parser("tables", help="render the paper's tables from a results store",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_results_options(p)
    p.add_argument("--format", default="md", choices=FORMATS, help="Markdown, LaTeX (booktabs) or CSV")
    p.add_argument("--reference", choices=["paper"], help="put the paper's numbers beside ours")
    p.add_argument("--profile", help=f"perplexity profile of the ppl and ablation tables (default: {PAPER_PROFILE}; "
                   f"without it the store's {PAPER_PROFILE}[START:STOP] subset, else its first profile)")
    p.add_argument("--table", default="all", choices=[*TABLE_KINDS, "all"], help="which table(s)")
    p.add_argument("--metric-map", default="paper", choices=list(METRIC_MAPS),
                   help="zero-shot metric per task (acc or acc_norm)")
    p.add_argument("--out", metavar="FILE", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_tables)
    return p


def cmd_tables(args: argparse.Namespace) -> int:
    """Render the tables; errors are reported with exit code 2, skipped failed entries on stderr."""
    try:
        store = read_store(results_dir_of(args))
        paper = read_paper() if args.reference == "paper" else None
        tables = make_tables(store.entries, args.table, profile=args.profile or default_profile(store.entries),
                             metric_map=args.metric_map, paper=paper)
        text = render(tables, args.format)
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
    except (ValueError, OSError) as error:
        print(f"rcpu-bench: error: {error}", file=sys.stderr)
        return 2
    note_failed(store)
    if not tables:
        print(f"rcpu-bench: no finished entries for table {args.table}", file=sys.stderr)
    return 0
