"""Figures from a results store, as PNG files (matplotlib, Agg backend).

Three kinds, one file per model each: perplexity vs pruning ratio per compensation method (grouped bars, one
panel per N_calib × scorer, as the paper's bar figure), perplexity vs the ridge λ (log axis, λ_best marked),
and perplexity vs N_calib per method and ratio. The ``*_data`` functions compute what is drawn from the store
entries alone (the same cell choice as the tables, :func:`rcpu_bench.tables.tables.resolve`), separately from drawing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rcpu_bench.matrix.store import add_results_options, results_dir_of
from rcpu_bench.tables.tables import (
    PAPER_PROFILE,
    cell_grid,
    check_profile,
    default_profile,
    method_row,
    note_failed,
    percent,
    ppl_of,
    prune_config,
    read_store,
    resolve,
)

COMPENSATOR_NAMES = {"none": "No comp.", "flap-bias": "Bias (FLAP)", "ridge": "LS (λ_best)",
                     "procrustes": "Rot.", "scaled-procrustes": "Rot.+Scale"}
PANEL_INCHES = (5.0, 3.6)
DPI = 100

Entry = dict[str, Any]
BarPanels = dict[tuple[int, str], dict[str, dict[float, float]]]  # (N_calib, scorer) → method → ratio → ppl
NcalibSeries = dict[tuple[str, float], dict[int, float]]  # (method label, ratio) → N_calib → ppl


@dataclass(frozen=True)
class LambdaCurve:
    """Perplexity at each λ of one ridge grid, and λ_best (lowest calibration perplexity; None when that run
    has no perplexity of the plotted profile)."""

    lams: tuple[float, ...]
    ppl: tuple[float, ...]
    best: float | None


LambdaPanels = dict[tuple[int, str, float], LambdaCurve]  # (N_calib, scorer, ratio) → curve


def _plotted(entry: Entry) -> bool:
    """Pruned runs of the RCPU pipeline (uniform structure, sequential statistics) on both modules."""
    prune = prune_config(entry)
    return (method_row(entry) is not None and entry["cell"]["ratio"] > 0
            and prune["structure"] == "uniform" and prune["statistics"] == "sequential")


def _ppl(entry: Entry, profile: str) -> float | None:
    return ppl_of(profile)(entry["record"])


def bar_data(entries: Sequence[Entry], profile: str = PAPER_PROFILE) -> dict[str, BarPanels]:
    """model → (N_calib, scorer) → compensation method → ratio → perplexity; the ridge at λ_best."""
    def key(entry: Entry) -> tuple | None:
        if not _plotted(entry):
            return None
        prune, cell = prune_config(entry), entry["cell"]
        return cell["model_label"], cell["n_calib"], prune["scorer"], prune["compensator"], cell["ratio"]

    data: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for (model, n_calib, scorer, compensator, ratio), chosen in sorted(resolve(entries, key).items()):
        value = _ppl(chosen.entry, profile)
        if value is not None:
            data[model][n_calib, scorer][COMPENSATOR_NAMES.get(compensator, compensator)][ratio] = value
    return _plain(data)


def lambda_data(entries: Sequence[Entry], profile: str = PAPER_PROFILE) -> dict[str, LambdaPanels]:
    """model → (N_calib, scorer, ratio) → the perplexity-vs-λ curve of the ridge runs."""
    def key(entry: Entry, with_lam: bool) -> tuple | None:
        if not _plotted(entry) or entry["cell"].get("lam") is None:
            return None
        cell = entry["cell"]
        place = (cell["model_label"], cell["n_calib"], prune_config(entry)["scorer"], cell["ratio"])
        return (*place, cell["lam"]) if with_lam else place

    points: dict = defaultdict(dict)
    for (*place, lam), chosen in sorted(resolve(entries, lambda e: key(e, True)).items()):
        value = _ppl(chosen.entry, profile)
        if value is not None:
            points[tuple(place)][lam] = value
    data: dict = defaultdict(dict)
    for (model, *panel), chosen in sorted(resolve(entries, lambda e: key(e, False)).items()):
        curve = points.get((model, *panel))
        if curve:
            best = chosen.lam if chosen.lam in curve else None
            data[model][tuple(panel)] = LambdaCurve(tuple(curve), tuple(curve.values()), best)
    return dict(data)


def ncalib_data(entries: Sequence[Entry], profile: str = PAPER_PROFILE) -> dict[str, NcalibSeries]:
    """model → (method label, ratio) → N_calib → perplexity: the perplexity table's cells (λ_best for ridge),
    for the methods and ratios run with at least two calibration-set sizes."""
    data: dict = defaultdict(lambda: defaultdict(dict))
    for ((model, n_calib), (label, ratio)), chosen in sorted(cell_grid(entries, method_row).items()):
        value = _ppl(chosen.entry, profile)
        if ratio > 0 and value is not None:
            data[model][label, ratio][n_calib] = value
    swept = {model: {key: values for key, values in series.items() if len(values) > 1}
             for model, series in data.items()}
    return _plain({model: series for model, series in swept.items() if series})


def _plain(nested: Any) -> Any:
    """Nested defaultdicts as plain dicts (equal data compare equal, missing keys raise)."""
    return {k: _plain(v) for k, v in nested.items()} if isinstance(nested, dict) else nested


# ------------------------------------------------------------------------------------------------- drawing

def _figure(n_panels: int) -> tuple[Figure, list[Axes]]:
    figure = Figure(figsize=(PANEL_INCHES[0] * n_panels, PANEL_INCHES[1]), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, list(figure.subplots(1, n_panels, squeeze=False)[0])


def draw_bars(model: str, panels: BarPanels, profile: str) -> Figure:
    """Grouped bars: ratios on the x axis, one bar per compensation method, one panel per (N_calib, scorer)."""
    figure, axes = _figure(len(panels))
    names = list(dict.fromkeys(name for methods in panels.values() for name in methods))  # one colour each
    for ax, ((n_calib, scorer), methods) in zip(axes, panels.items()):
        ratios = sorted({ratio for values in methods.values() for ratio in values})
        width = 0.8 / len(methods)
        for k, (name, values) in enumerate(methods.items()):
            xs = [ratios.index(r) - 0.4 + width * (k + 0.5) for r in values]
            ax.bar(xs, list(values.values()), width, label=name, color=f"C{names.index(name)}")
        ax.set_xticks(range(len(ratios)), [percent(r) for r in ratios])
        ax.set(title=f"{model}: {scorer} score, N_calib={n_calib}", xlabel="pruning ratio",
               ylabel=f"perplexity ({profile})")
        _legend_below(ax)
    return figure


def _legend_below(ax: Axes) -> None:
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2, frameon=False)


def draw_lambda(model: str, panels: LambdaPanels, profile: str) -> Figure:
    """Perplexity vs λ on a log axis, one line per (N_calib, scorer, ratio), λ_best starred."""
    figure, axes = _figure(1)
    ax = axes[0]
    for (n_calib, scorer, ratio), curve in panels.items():
        (line,) = ax.plot(curve.lams, curve.ppl, marker="o", label=f"{scorer}, N_calib={n_calib}, {percent(ratio)}")
        if curve.best is not None:
            ax.plot([curve.best], [curve.ppl[curve.lams.index(curve.best)]], marker="*", markersize=14,
                    color=line.get_color(), linestyle="none")
    ax.set_xscale("log")
    ax.set(title=f"{model}: ridge LS", xlabel="λ  (★ λ_best: lowest calibration perplexity)",
           ylabel=f"perplexity ({profile})")
    _legend_below(ax)
    return figure


def draw_ncalib(model: str, series: NcalibSeries, profile: str) -> Figure:
    """Perplexity vs N_calib (log₂ axis), one line per (method, ratio)."""
    figure, axes = _figure(1)
    ax = axes[0]
    for (label, ratio), values in series.items():
        ax.plot(list(values), list(values.values()), marker="o", label=f"{label}, {percent(ratio)}")
    sizes = sorted({n for values in series.values() for n in values})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set(title=f"{model}: perplexity vs calibration-set size", xlabel="N_calib", ylabel=f"perplexity ({profile})")
    _legend_below(ax)
    return figure


PLOTS: dict[str, tuple[Callable[[Sequence[Entry], str], dict], Callable[..., Figure]]] = {
    "ppl_vs_ratio": (bar_data, draw_bars),
    "ppl_vs_lambda": (lambda_data, draw_lambda),
    "ppl_vs_ncalib": (ncalib_data, draw_ncalib),
}


def _file_name(kind: str, model: str) -> str:
    return f"{kind}_{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}.png"


def write_plots(entries: Sequence[Entry], out_dir: str | Path, profile: str = PAPER_PROFILE) -> list[Path]:
    """Every plot the entries allow, one PNG per kind and model, written into ``out_dir``; their paths."""
    check_profile(entries, profile)
    out_dir = Path(out_dir)
    paths = []
    for kind, (data_of, draw) in PLOTS.items():
        for model, panels in data_of(entries, profile).items():
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / _file_name(kind, model)
            draw(model, panels, profile).savefig(path, format="png", bbox_inches="tight",
                                                metadata={"Software": None})
            paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------------ CLI

def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``plots`` to the CLI's subcommands."""
    p = commands.add_parser("plots", help="draw the paper's figures from a results store (PNG)")
    add_results_options(p)
    p.add_argument("--out-dir", metavar="DIR", help="where the PNG files go (default: <results>/plots)")
    p.add_argument("--profile", help=f"perplexity profile plotted (default: {PAPER_PROFILE}; without it the "
                   f"store's {PAPER_PROFILE}[START:STOP] subset, else its first profile)")
    p.set_defaults(func=cmd_plots)
    return p


def cmd_plots(args: argparse.Namespace) -> int:
    """Write the plots and print their paths; errors are reported with exit code 2."""
    try:
        results = results_dir_of(args)
        store = read_store(results)
        paths = write_plots(store.entries, args.out_dir or results / "plots", args.profile or default_profile(store.entries))
    except (ValueError, OSError) as error:
        print(f"rcpu-bench: error: {error}", file=sys.stderr)
        return 2
    note_failed(store)
    if not paths:
        print("rcpu-bench: nothing to plot", file=sys.stderr)
    for path in paths:
        print(path)
    return 0
