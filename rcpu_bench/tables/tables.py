"""The paper's tables from a results store (``rcpu-bench tables``, :mod:`rcpu_bench.commands.tables`), rendered as
Markdown, LaTeX (booktabs) or CSV, optionally beside the paper's own numbers.

The tables are built from the store's finished runs alone (:func:`rcpu_bench.matrix.store.read_results`):
which runs make which rows and columns is :mod:`rcpu_bench.tables.layout`, the λ of a ridge grid
:mod:`rcpu_bench.matrix.lambda_rules`, the values :mod:`rcpu_bench.tables.results`, the paper's numbers
:mod:`rcpu_bench.tables.paper` and the formats :mod:`rcpu_bench.tables.render`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rcpu_bench.matrix.lambda_rules import DEFAULT_LAMBDA_RULE, LAMBDA_RULES
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.tables import generalisation, main_effects, significance
from rcpu_bench.tables.layout import RANKINGS, TABLE_KINDS, build_tables, spec
from rcpu_bench.tables.paper import PaperNumbers
from rcpu_bench.tables.results import PAPER_PROFILE, check_profile
from rcpu_bench.tables.table import Table

PROFILE_TABLES = ("ppl", "ppl-other", "ablation", *RANKINGS, "main-effects", "all")  # those showing one profile
NOT_IN_ALL = ("ranking-ppl", "main-effects")  # a part of another kind, and the factorial's own


def make_tables(results: Sequence[StoredResult], table: str = "all", *, profile: str = PAPER_PROFILE,
                metric_map: str = "paper", paper: PaperNumbers | None = None,
                lambda_rule: str = DEFAULT_LAMBDA_RULE, left_out: list[str] | None = None) -> list[Table]:
    """The tables of one kind (or ``all``) from stored runs; empty tables are left out. ``lambda_rule`` chooses
    λ_best of a ridge grid (rcpu_bench.matrix.lambda_rules); the titles of tables with a λ column name it.

    A ranking names the runs it cannot compare in rows of their own (``significance.ranking_tables``); asked for by
    name, a ranking that compares nothing is refused, and in ``all`` such a table is left out. Each run not ranked
    is appended to ``left_out`` (when given), one line each."""
    if lambda_rule not in LAMBDA_RULES:
        raise ValueError(f"unknown lambda rule {lambda_rule!r}; allowed: {', '.join(LAMBDA_RULES)}")
    kinds = tuple(k for k in TABLE_KINDS if k not in NOT_IN_ALL) if table == "all" else (table,)  # asked by name
    specs = [spec(kind, profile, metric_map) for kind in kinds
             if kind not in (*RANKINGS, "generalisation", "main-effects")]
    if set(PROFILE_TABLES) & set(kinds):
        check_profile(results, profile)
        if paper is not None and profile != PAPER_PROFILE:
            raise ValueError(f"the paper's perplexities are profile {PAPER_PROFILE}; got --profile {profile}")
    tables = [t for s in specs for t in build_tables(results, s, paper, lambda_rule)]
    if set(RANKINGS) & set(kinds):
        ranking = significance.ranking_tables(results, profile, metric_map=metric_map, lambda_rule=lambda_rule,
                                              accuracy="ranking-ppl" not in kinds)
        unranked = significance.unranked(ranking)
        if table in RANKINGS and ranking and len(unranked) == sum(len(t.rows) for t in ranking):
            reasons = sorted({line.rsplit(": ", 1)[1] for line in unranked})
            raise ValueError(f"nothing to rank: none of the {len(unranked)} runs with a {profile} perplexity or "
                             f"zero-shot scores can be compared: {'; '.join(reasons)}; allowed: --profile naming a "
                             "profile whose runs have per-window values, or runs recorded with them")
        if left_out is not None:
            left_out += unranked
        tables += [t for t in ranking if table in RANKINGS or len(significance.unranked([t])) < len(t.rows)]
    if "generalisation" in kinds:
        tables += generalisation.make_tables(results)
    if "main-effects" in kinds:
        tables += main_effects.make_tables(results, profile, lambda_rule)
    return tables
