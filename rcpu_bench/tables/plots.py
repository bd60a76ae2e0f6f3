"""Figures from a results store, each as PNG (150 dpi), PDF and SVG (matplotlib, Agg backend).

Three kinds, one figure per model each, all with the dense model's perplexity as a dashed reference line:
perplexity vs pruning ratio as grouped bars, one bar per compensation method, in the paper's layout
(fig:bar-2x2: a row per N_calib, a column per scorer, WANDA-sp score then the proposed variance score);
perplexity vs the ridge λ (log axis, the chosen λ starred); perplexity vs N_calib per method and ratio
(fig:nvsppl). The ``*_data`` functions compute what is drawn from the stored runs alone (the same choice of run
as the tables, :func:`rcpu_bench.matrix.lambda_rules.resolve`), separately from drawing.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE, LAMBDA_RULES, resolve
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.pruning.methods import percent
from rcpu_bench.pruning.options import is_default_pipeline
from rcpu_bench.tables import generalisation, main_effects
from rcpu_bench.tables.figures import DPI, save_figure
from rcpu_bench.tables.layout import any_row, cell_grid, compensates_pruned, relatively_damped
from rcpu_bench.tables.results import PAPER_PROFILE, check_profile, ppl_of
from rcpu_bench.tables.table import ORIGINAL

COMPENSATOR_NAMES = {"none": "No comp.", "flap-bias": "Bias (FLAP)", "ridge": "LS (λ_best)",  # legend order
                     "procrustes": "Rot.", "scaled-procrustes": "Rot.+Scale"}
SCORER_NAMES = {"wanda-sp": "WANDA-sp score", "variance": "Proposed score"}  # the paper's panel titles
PANEL_INCHES = (5.0, 3.6)

BarPanels = dict[tuple[int, str], dict[str, dict[float, float]]]  # (N_calib, scorer) → method → ratio → ppl
NcalibSeries = dict[tuple[str, float], dict[int, float]]  # (method label, ratio) → N_calib → ppl


@dataclass(frozen=True)
class LambdaCurve:
    """Perplexity at each λ of one ridge grid, and the λ the rule chose (None when that run has no perplexity
    of the plotted profile)."""

    lams: tuple[float, ...]
    ppl: tuple[float, ...]
    best: float | None


LambdaPanels = dict[tuple[int, str, float], LambdaCurve]  # (N_calib, scorer, ratio) → curve


def _plotted(result: StoredResult) -> bool:
    """Pruned runs of the RCPU pipeline (uniform structure, sequential statistics) on both modules; ridge at an
    absolute λ (the figures' λ grid), not at a damping relative to G_KK (``lam_rel``)."""
    return (compensates_pruned(result) and result.ratio > 0 and is_default_pipeline(result.prune)
            and not relatively_damped(result))


def _ppl(result: StoredResult, profile: str) -> float | None:
    return ppl_of(profile)(result.record)


def dense_data(results: Sequence[StoredResult], profile: str = PAPER_PROFILE) -> dict[str, float]:
    """model → the dense (unpruned) model's perplexity: the reference line of every figure."""
    dense: dict[str, float] = {}
    for ((model, _), (label, ratio)), chosen in sorted(cell_grid(results, any_row).items()):
        value = _ppl(chosen.result, profile)
        if (label, ratio) == (ORIGINAL, 0) and value is not None:
            dense.setdefault(model, value)
    return dense


def bar_data(results: Sequence[StoredResult], profile: str = PAPER_PROFILE,
             lambda_rule: str = DEFAULT_LAMBDA_RULE) -> dict[str, BarPanels]:
    """model → (N_calib, scorer) → compensation method → ratio → perplexity; the ridge at the rule's λ."""
    def key(result: StoredResult) -> tuple | None:
        if not _plotted(result):
            return None
        return result.model_label, result.n_calib, result.prune["scorer"], result.prune["compensator"], result.ratio

    data: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    def drawn_order(item: tuple) -> tuple:  # compensators in the paper's legend order, then others by name
        (model, n_calib, scorer, compensator, ratio), _ = item
        names = list(COMPENSATOR_NAMES)
        rank = names.index(compensator) if compensator in names else len(names)
        return model, n_calib, scorer, rank, compensator, ratio

    for (model, n_calib, scorer, compensator, ratio), chosen in sorted(resolve(results, key, lambda_rule).items(),
                                                                       key=drawn_order):
        value = _ppl(chosen.result, profile)
        if value is not None:
            data[model][n_calib, scorer][COMPENSATOR_NAMES.get(compensator, compensator)][ratio] = value
    return _plain(data)


def lambda_data(results: Sequence[StoredResult], profile: str = PAPER_PROFILE,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> dict[str, LambdaPanels]:
    """model → (N_calib, scorer, ratio) → the perplexity-vs-λ curve of the ridge runs, with the rule's λ."""
    def key(result: StoredResult, with_lam: bool) -> tuple | None:
        if not _plotted(result) or result.lam is None:
            return None
        place = (result.model_label, result.n_calib, result.prune["scorer"], result.ratio)
        return (*place, result.lam) if with_lam else place

    points: dict = defaultdict(dict)
    for (*place, lam), chosen in sorted(resolve(results, lambda r: key(r, True)).items()):
        value = _ppl(chosen.result, profile)
        if value is not None:
            points[tuple(place)][lam] = value
    data: dict = defaultdict(dict)
    for (model, *panel), chosen in sorted(resolve(results, lambda r: key(r, False), lambda_rule).items()):
        curve = points.get((model, *panel))
        if curve:
            best = chosen.lam if chosen.lam in curve else None
            data[model][tuple(panel)] = LambdaCurve(tuple(curve), tuple(curve.values()), best)
    return dict(data)


def ncalib_data(results: Sequence[StoredResult], profile: str = PAPER_PROFILE,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> dict[str, NcalibSeries]:
    """model → (method label, ratio) → N_calib → perplexity: the perplexity tables' cells (the rule's λ for ridge),
    for the methods and ratios run with at least two calibration-set sizes."""
    data: dict = defaultdict(lambda: defaultdict(dict))
    for ((model, n_calib), (label, ratio)), chosen in sorted(cell_grid(results, any_row, lambda_rule).items()):
        value = _ppl(chosen.result, profile)
        if ratio > 0 and value is not None:
            data[model][label, ratio][n_calib] = value
    swept = {model: {key: values for key, values in series.items() if len(values) > 1}
             for model, series in data.items()}
    return _plain({model: series for model, series in swept.items() if series})


def _plain(nested: Any) -> Any:
    """Nested defaultdicts as plain dicts (equal data compare equal, missing keys raise)."""
    return {k: _plain(v) for k, v in nested.items()} if isinstance(nested, dict) else nested


# ------------------------------------------------------------------------------------------------- drawing

def _figure(rows: int, columns: int) -> tuple[Figure, list[list[Axes]]]:
    figure = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [list(row) for row in figure.subplots(rows, columns, squeeze=False)]


def _dense_line(ax: Axes, dense: float | None) -> None:
    if dense is not None:
        ax.axhline(dense, color="0.3", linestyle="--", linewidth=1, label=f"dense model ({dense:.2f})")


def _scorer_order(scorer: str) -> tuple[int, str]:
    return (list(SCORER_NAMES).index(scorer) if scorer in SCORER_NAMES else len(SCORER_NAMES)), scorer


def draw_bars(model: str, panels: BarPanels, profile: str, dense: float | None = None,
              lambda_rule: str = DEFAULT_LAMBDA_RULE) -> Figure:
    """Grouped bars, ratios on the x axis and one bar per compensation method, in a grid of panels: a row per
    N_calib, a column per scorer (the paper's fig:bar-2x2); a grid place without runs is left blank. The title
    names the λ rule when a ridge bar is drawn."""
    n_calibs = sorted({n for n, _ in panels})
    scorers = sorted({scorer for _, scorer in panels}, key=_scorer_order)
    figure, axes = _figure(len(n_calibs), len(scorers))
    names = list(dict.fromkeys(name for methods in panels.values() for name in methods))  # one colour each
    for (i, n_calib), (j, scorer) in ((a, b) for a in enumerate(n_calibs) for b in enumerate(scorers)):
        ax, methods = axes[i][j], panels.get((n_calib, scorer))
        if methods is None:
            ax.set_axis_off()
            continue
        ratios = sorted({ratio for values in methods.values() for ratio in values})
        width = 0.8 / len(methods)
        for k, (name, values) in enumerate(methods.items()):
            xs = [ratios.index(r) - 0.4 + width * (k + 0.5) for r in values]
            ax.bar(xs, list(values.values()), width, label=name, color=f"C{names.index(name)}")
        _dense_line(ax, dense)
        ax.set_xticks(range(len(ratios)), [percent(r) for r in ratios])
        ax.set(title=f"{SCORER_NAMES.get(scorer, f'{scorer} score')} + comp. ($N_\\mathrm{{calib}}$={n_calib})",
               xlabel="pruning ratio", ylabel=f"perplexity ({profile})")
        _legend_below(ax)
    ridge = any(COMPENSATOR_NAMES["ridge"] in methods for methods in panels.values())
    figure.suptitle(f"{model}: perplexity vs pruning ratio" + (_rule_note(lambda_rule) if ridge else ""))
    return figure


def _rule_note(lambda_rule: str) -> str:
    return f"\nλ_best: {LAMBDA_RULES[lambda_rule]}"


def _legend_below(ax: Axes) -> None:
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2, frameon=False)


def draw_lambda(model: str, panels: LambdaPanels, profile: str, dense: float | None = None,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> Figure:
    """Perplexity vs λ on a log axis, one line per (N_calib, scorer, ratio), the rule's λ starred."""
    figure, ((ax,),) = _figure(1, 1)
    for (n_calib, scorer, ratio), curve in panels.items():
        (line,) = ax.plot(curve.lams, curve.ppl, marker="o",
                          label=f"{scorer}, $N_\\mathrm{{calib}}$={n_calib}, {percent(ratio)}")
        if curve.best is not None:
            ax.plot([curve.best], [curve.ppl[curve.lams.index(curve.best)]], marker="*", markersize=14,
                    color=line.get_color(), linestyle="none")
    _dense_line(ax, dense)
    ax.set_xscale("log")
    ax.set(title=f"{model}: ridge LS", xlabel=f"λ  (★ λ_best: {LAMBDA_RULES[lambda_rule]})",
           ylabel=f"perplexity ({profile})")
    _legend_below(ax)
    return figure


def draw_ncalib(model: str, series: NcalibSeries, profile: str, dense: float | None = None,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> Figure:
    """Perplexity vs N_calib (log₂ axis), one line per (method, ratio); the title names the λ rule when a ridge
    line is drawn."""
    figure, ((ax,),) = _figure(1, 1)
    for (label, ratio), values in series.items():
        ax.plot(list(values), list(values.values()), marker="o", label=f"{label}, {percent(ratio)}")
    _dense_line(ax, dense)
    sizes = sorted({n for values in series.values() for n in values})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ridge = any(lam_label in label for label, _ in series for lam_label in ("lambda_best", "ridge"))
    ax.set(title=f"{model}: perplexity vs calibration-set size" + (_rule_note(lambda_rule) if ridge else ""),
           xlabel="$N_\\mathrm{calib}$ (calibration sequences)", ylabel=f"perplexity ({profile})")
    _legend_below(ax)
    return figure


PLOTS: dict[str, tuple[Callable[..., dict], Callable[..., Figure]]] = {
    "ppl_vs_ratio": (bar_data, draw_bars),
    "ppl_vs_lambda": (lambda_data, draw_lambda),
    "ppl_vs_ncalib": (ncalib_data, draw_ncalib),
}


def _file_stem(kind: str, model: str) -> str:
    return f"{kind}_{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}"


def write_plots(results: Sequence[StoredResult], out_dir: str | Path, profile: str = PAPER_PROFILE,
                lambda_rule: str = DEFAULT_LAMBDA_RULE) -> list[Path]:
    """Every figure the results allow, one per kind and model, each as PNG, PDF and SVG in ``out_dir``; their
    paths (PNG first)."""
    check_profile(results, profile)
    out_dir = Path(out_dir)
    dense = dense_data(results, profile)
    paths = []
    for kind, (data_of, draw) in PLOTS.items():
        for model, panels in data_of(results, profile, lambda_rule).items():
            figure = draw(model, panels, profile, dense.get(model), lambda_rule)
            paths += save_figure(figure, out_dir, _file_stem(kind, model))
    return paths + generalisation.write_plots(results, out_dir) + main_effects.write_plots(results, out_dir, profile,
                                                                                          lambda_rule)
