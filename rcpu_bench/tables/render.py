"""Tables as Markdown, LaTeX (booktabs) or CSV. Bold / underline marks come from
:func:`rcpu_bench.tables.table.table_marks`; CSV has raw numbers and no marks; LaTeX typesets λ_best, N_calib and
λ values as math (``$\\lambda_\\mathrm{best}$``, ``$N_\\mathrm{calib}=128$``, ``$10^{-2}$``)."""

from __future__ import annotations

import csv
import io
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tabulate import tabulate

from rcpu_bench.pruning.methods import RECIPES, percent
from rcpu_bench.tables.table import Column, Table, Value, join, table_marks

FORMATS = ("md", "latex", "csv")
SHADED = frozenset({RECIPES["rcpu-rot"].label, RECIPES["rcpu-rot-scale"].label})  # the paper's gray RCPU rows

_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
_LATEX_MATH = {"lambda_best": r"$\lambda_\mathrm{best}$", "λ_best": r"$\lambda_\mathrm{best}$",
               "N_calib": r"$N_\mathrm{calib}$", "λ": r"$\lambda$"}
_MATH_WORDS = re.compile("|".join(map(re.escape, _LATEX_MATH)))


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex_text(text: str) -> str:
    """Text for LaTeX: specials escaped, the symbols λ_best, N_calib and λ as math."""
    parts, start = [], 0
    for found in _MATH_WORDS.finditer(text):
        parts += [latex_escape(text[start:found.start()]), _LATEX_MATH[found.group()]]
        start = found.end()
    return "".join([*parts, latex_escape(text[start:])])


def latex_power_of_ten(value: float) -> str:
    """λ as math with one significant digit: ``$10^{-2}$`` for 0.01, ``$5\\cdot10^{-3}$`` for 0.005."""
    mantissa, exponent = f"{value:.0e}".split("e")
    power = rf"10^{{{int(exponent)}}}"
    return f"${power}$" if mantissa == "1" else rf"${mantissa}\cdot{power}$"


@dataclass(frozen=True)
class _Style:
    """How one format writes cells: mark templates (None: no marks), raw numbers or formatted, text and λ."""

    marks: Mapping[str, str] | None
    raw: bool
    text: Callable[[str], str]
    lam: Callable[[float], str]


_MARKDOWN = _Style({"bold": "**{}**", "underline": "_{}_"}, raw=False, text=lambda text: text.replace("|", r"\|"),
                   lam=lambda value: f"{value:.0e}")
_LATEX = _Style({"bold": r"\textbf{{{}}}", "underline": r"\underline{{{}}}"}, raw=False, text=latex_text,
                lam=latex_power_of_ten)
_CSV = _Style(None, raw=True, text=str, lam=lambda value: f"{value:.0e}")


def _body(table: Table, style: _Style) -> list[list[str]]:
    """The table's rows as text: label, ratio, then every cell, marked as the style says."""
    marks = table_marks(table) if style.marks else {}
    body = []
    for i, row in enumerate(table.rows):
        ratio = f"{row.ratio:.12g}" if style.raw else style.text(percent(row.ratio))
        texts = [_cell_text(value, column, style) for value, column in zip(row.cells, table.columns, strict=True)]
        if style.marks:
            texts = [style.marks[marks[i, j]].format(text) if (i, j) in marks else text for j, text in enumerate(texts)]
        body.append([style.text(row.label), ratio, *texts])
    return body


def _cell_text(value: Value, column: Column, style: _Style) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return style.text(value)
    if column.metric is not None and column.metric.style == "lambda":
        return style.lam(value)
    if style.raw or column.metric is None:
        return f"{value:.12g}"
    return column.metric.format(value)


def _headers(table: Table) -> list[str]:
    return ["Method", "PR", *(join(c.group, c.header) for c in table.columns)]


def render_markdown(table: Table) -> str:
    headers = [_MARKDOWN.text(header) for header in _headers(table)]
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
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_text(table.title)}}}",
             rf"\begin{{tabular}}{{lc{'c' * len(table.columns)}}}", r"\toprule", *_latex_header(table), r"\midrule"]
    previous = None
    for row, cells in zip(table.rows, _body(table, _LATEX), strict=True):
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
    names = " & ".join(rf"\textbf{{{latex_text(h)}}}" if h else "" for h in headers)
    if not any(c.group for c in table.columns):
        return [names + r" \\"]
    cells, rules, start = ["", ""], [], 3
    for group, members in itertools.groupby(table.columns, key=lambda c: c.group):
        width = len(list(members))
        if group:
            cells.append(rf"\multicolumn{{{width}}}{{c}}{{\textbf{{{latex_text(group)}}}}}")
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
