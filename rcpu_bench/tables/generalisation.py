"""Tables and figures of the generalisation diagnostics: calibration vs held-out reconstruction error
and the update's degrees of freedom, from the ``Record.generalisation`` of runs made with ``holdout`` > 0.

Errors are relative, ‖Y − W̃X‖²/‖Y‖² per module (``rcpu_bench.compensation.diagnostics``); "mean" is over
every (layer, module). Ridge rows appear once per λ and twice more at a chosen λ: λ_best by the paper's rule
(lowest calibration perplexity) and by the lowest held-out error mean (:mod:`rcpu_bench.matrix.lambda_rules`).
Three tables per model and pruning ratio (the errors vs N_calib, the degrees of freedom vs N_calib, and
per layer for each N_calib) and two figures (errors per layer for each N_calib; errors vs N_calib).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rcpu_bench.matrix.lambda_rules import choose
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.pruning.methods import percent
from rcpu_bench.tables.figures import save_figure
from rcpu_bench.tables.layout import method_row
from rcpu_bench.tables.results import Metric
from rcpu_bench.tables.table import Column, Row, Table

Place = tuple[str, float]  # (model label, pruning ratio): one table or figure
Runs = dict[str, dict[int, StoredResult]]  # row label → N_calib → the run shown

ERROR = Metric("error", "", "lower", decimals=4)
PLAIN_ERROR = Metric("error", "", None, decimals=4)  # per-layer rows are not ranked against each other
DOF = Metric("dof", "", None, style="grouped", decimals=0)
RULE_CALIBRATION = "λ_best: calibration ppl"
RULE_HOLDOUT = "λ_best: held-out error"


def _lam_text(lam: float) -> str:
    power = lam > 0 and abs(math.log10(lam) - round(math.log10(lam))) < 1e-9
    return f"λ={lam:.0e}" if power else f"λ={lam:g}"


def generalisation_runs(results: Sequence[StoredResult]) -> dict[Place, Runs]:
    """(model, ratio) → row label → N_calib → run, for the entries that recorded held-out diagnostics.

    A method run over a λ grid gives one row per λ plus the two λ_best rows (module docstring).
    """
    groups: dict[tuple, list[StoredResult]] = defaultdict(list)
    for result in results:
        label = method_row(result)
        if label is not None and result.record.generalisation is not None and result.ratio > 0:
            groups[result.model_label, result.ratio, label, result.n_calib].append(result)
    runs: dict[Place, Runs] = defaultdict(lambda: defaultdict(dict))
    for (model, ratio, label, n_calib), members in sorted(groups.items()):
        rows = runs[model, ratio]
        if len(members) == 1 and members[0].lam is None:
            rows[label][n_calib] = members[0]
            continue
        base = label.removesuffix(" (lambda_best)")  # the ls-best alias's label names one of the two rules
        for result in sorted(members, key=lambda r: r.lam or 0.0):
            rows[f"{base} ({_lam_text(result.lam or 0.0)})"][n_calib] = result
        where = (model, ratio, label, n_calib)
        rows[f"{base} ({RULE_CALIBRATION})"][n_calib] = choose(where, members, "paper").result
        rows[f"{base} ({RULE_HOLDOUT})"][n_calib] = choose(where, members, "holdout").result
    return {place: {label: dict(sizes) for label, sizes in rows.items()} for place, rows in runs.items()}


def _sizes(runs: Runs) -> list[int]:
    return sorted({n for sizes in runs.values() for n in sizes})


def generalisation_of(result: StoredResult) -> dict[str, Any]:
    """The generalisation diagnostics of a run chosen for these tables (which have them)."""
    assert result.record.generalisation is not None  # only runs with held-out diagnostics enter the tables
    return result.record.generalisation


def _summary(result: StoredResult | None, key: str) -> float | None:
    return None if result is None else generalisation_of(result)[key]


def error_table(model: str, ratio: float, runs: Runs) -> Table:
    """Calibration and held-out error means, one column pair per N_calib."""
    sizes = _sizes(runs)
    columns = tuple(Column(header, f"N_calib={n}", ERROR) for n in sizes for header in ("calibration", "held-out"))
    rows = tuple(Row(label, ratio, tuple(_summary(by_n.get(n), key) for n in sizes
                                         for key in ("calibration_error_mean", "holdout_error_mean")))
                 for label, by_n in runs.items())
    return Table(f"{model}: relative reconstruction error ‖Y − W̃X‖²/‖Y‖² (mean over layers and modules), "
                 "calibration vs held-out windows", columns, rows)


def dof_table(model: str, ratio: float, runs: Runs) -> Table:
    """Degrees of freedom of the update summed over the model, per N_calib (ridge's depends on G_KK)."""
    sizes = _sizes(runs)
    columns = tuple(Column(f"N_calib={n}", "", DOF) for n in sizes)
    rows = tuple(Row(label, ratio, tuple(_summary(by_n.get(n), "degrees_of_freedom_total") for n in sizes))
                 for label, by_n in runs.items())
    return Table(f"{model}: degrees of freedom of the compensation, summed over layers and modules "
                 "(ridge: d_out·Σσ²/(σ²+λ), σ² eigenvalues of G_KK summed over tokens; rotation: d_out(d_out−1)/2)",
                 columns, rows)


def layer_table(model: str, ratio: float, n_calib: int, runs: Runs) -> Table:
    """Per layer and module: calibration error, held-out error and degrees of freedom of each method."""
    columns = tuple(Column(header, "", metric) for header, metric in
                    (("calibration", PLAIN_ERROR), ("held-out", PLAIN_ERROR), ("degrees of freedom", DOF)))
    rows = tuple(Row(f"{label} · layer {m['layer']} {m['module']}", ratio,
                     (m["calibration_error"], m["holdout_error"], m["degrees_of_freedom"]))
                 for label, by_n in runs.items() if n_calib in by_n
                 for m in generalisation_of(by_n[n_calib])["layers"])
    return Table(f"{model}, N_calib={n_calib}: reconstruction error per layer and module", columns, rows)


def make_tables(results: Sequence[StoredResult]) -> list[Table]:
    """Every generalisation table the entries allow (none without held-out diagnostics)."""
    tables = []
    for (model, ratio), runs in generalisation_runs(results).items():
        tables += [error_table(model, ratio, runs), dof_table(model, ratio, runs)]
        tables += [layer_table(model, ratio, n, runs) for n in _sizes(runs)]
    return tables


# ------------------------------------------------------------------------------------------------- figures

def _chosen_rows(runs: Runs) -> Runs:
    """The rows drawn: every method without a λ grid and the two λ_best rows (not every λ)."""
    return {label: by_n for label, by_n in runs.items() if "(λ=" not in label}


def _figure(n_panels: int) -> tuple[Figure, list]:
    figure = Figure(figsize=(5.0 * n_panels, 3.8), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, list(figure.subplots(1, n_panels, squeeze=False)[0])


def draw_layers(model: str, ratio: float, n_calib: int, runs: Runs) -> Figure:
    """Error per layer, one panel per module: held-out solid, calibration dashed, one colour per method."""
    figure, axes = _figure(2)
    for ax, module in zip(axes, ("attention", "mlp"), strict=True):
        for k, (label, by_n) in enumerate(_chosen_rows(runs).items()):
            if n_calib not in by_n:
                continue
            rows = [m for m in generalisation_of(by_n[n_calib])["layers"] if m["module"] == module]
            layers = [m["layer"] for m in rows]
            ax.plot(layers, [m["holdout_error"] for m in rows], marker="o", color=f"C{k}", label=f"{label} held-out")
            ax.plot(layers, [m["calibration_error"] for m in rows], marker="x", linestyle="--", color=f"C{k}",
                    label=f"{label} calibration")
        ax.set(title=f"{model}, {percent(ratio)}, N_calib={n_calib}: {module}", xlabel="layer",
               ylabel="‖Y − W̃X‖² / ‖Y‖²")
    axes[0].legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(1.0, -0.18), ncols=2, frameon=False)
    return figure


def draw_sizes(model: str, ratio: float, runs: Runs) -> Figure:
    """Mean error vs N_calib (log₂ axis): held-out solid, calibration dashed, one colour per method."""
    figure, axes = _figure(1)
    ax = axes[0]
    for k, (label, by_n) in enumerate(_chosen_rows(runs).items()):
        sizes = sorted(by_n)
        for key, style, name in (("holdout_error_mean", "-", "held-out"),
                                 ("calibration_error_mean", "--", "calibration")):
            ax.plot(sizes, [_summary(by_n[n], key) for n in sizes], linestyle=style, marker="o", color=f"C{k}",
                    label=f"{label} {name}")
    sizes = _sizes(runs)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_yscale("log")
    ax.set(title=f"{model}, {percent(ratio)}: reconstruction error vs calibration-set size", xlabel="N_calib (windows)",
           ylabel="mean ‖Y − W̃X‖² / ‖Y‖²")
    ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
    return figure


def _file_stem(*parts: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(str(p) for p in parts))


def write_plots(results: Sequence[StoredResult], out_dir: str | Path) -> list[Path]:
    """The generalisation figures in ``out_dir``, each as PNG, PDF and SVG (:func:`save_figure`): per (model, ratio)
    one vs N_calib, one per layer for each N_calib. Returns their paths (none without held-out diagnostics)."""
    out_dir, paths = Path(out_dir), []
    for (model, ratio), runs in generalisation_runs(results).items():
        figures = [(_file_stem("holdout_error_vs_ncalib", model, f"{ratio:g}"), draw_sizes(model, ratio, runs))]
        figures += [(_file_stem("holdout_error_per_layer", model, f"{ratio:g}", f"N{n}"),
                     draw_layers(model, ratio, n, runs)) for n in _sizes(runs)]
        for stem, figure in figures:
            paths += save_figure(figure, out_dir, stem)
    return paths
