"""Paired bootstrap comparisons (rcpu_bench.tables.significance) against scipy's paired bootstrap and direct
computations, and the ranking tables built from them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from test_tables import perplexity

from rcpu_bench.matrix.store import Entry, StoredResult
from rcpu_bench.records import Perplexity
from rcpu_bench.tables.significance import (
    OLD_WINDOWS,
    accuracy_difference,
    ppl_difference,
    ranking_tables,
    unranked,
)


def entry(nll, targets, profile="rcpu128[0:40]") -> Perplexity:
    return Perplexity.from_json({**perplexity(profile, math.exp(sum(nll) / sum(targets))),
                                 "window_nll": list(nll), "window_targets": list(targets)})


def scipy_ppl_interval(nll_a, nll_b, targets):
    def statistic(a, b, t, axis):
        return np.exp(a.sum(axis) / t.sum(axis)) - np.exp(b.sum(axis) / t.sum(axis))
    result = stats.bootstrap((nll_a, nll_b, targets), statistic, paired=True, vectorized=True, n_resamples=20000,
                             method="percentile", random_state=np.random.default_rng(1))
    return result.confidence_interval


def test_the_perplexity_difference_matches_scipys_paired_bootstrap():
    rng = np.random.default_rng(0)
    targets = np.full(200, 127.0)
    nll_b = rng.normal(4.0, 0.5, 200) * targets
    nll_a = nll_b + rng.normal(0.02, 0.05, 200) * targets  # A slightly worse, window by window
    ours = ppl_difference(entry(nll_a, targets), entry(nll_b, targets))
    expected = math.exp(nll_a.sum() / targets.sum()) - math.exp(nll_b.sum() / targets.sum())
    assert ours.estimate == pytest.approx(expected, rel=1e-12)
    low, high = scipy_ppl_interval(nll_a, nll_b, targets)
    width = high - low
    assert abs(ours.low - low) < 0.05 * width and abs(ours.high - high) < 0.05 * width
    assert not ours.tie and ours.low > 0


def test_stories_of_unequal_length_weigh_by_their_tokens():
    rng = np.random.default_rng(2)
    targets = rng.integers(20, 400, 80).astype(float)
    nll_b = rng.normal(2.0, 0.3, 80) * targets
    nll_a = nll_b + rng.normal(0.0, 0.05, 80) * targets
    ours = ppl_difference(entry(nll_a, targets, "tinystories"), entry(nll_b, targets, "tinystories"))
    low, high = scipy_ppl_interval(nll_a, nll_b, targets)
    assert abs(ours.low - low) < 0.06 * (high - low) and abs(ours.high - high) < 0.06 * (high - low)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1.0, 8.0), min_size=2, max_size=30), st.floats(-0.5, 0.5))
def test_a_constant_shift_orders_the_runs_by_its_sign(per_token, shift):
    targets = np.full(len(per_token), 64.0)
    nll_b = np.array(per_token) * targets
    same = ppl_difference(entry(nll_b, targets), entry(nll_b, targets))
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0) and same.tie
    shifted = ppl_difference(entry(nll_b + shift * targets, targets), entry(nll_b, targets))
    if abs(shift) > 1e-6:  # every window moves by the same factor: every resample has the sign of the shift
        assert np.sign(shifted.low) == np.sign(shifted.high) == np.sign(shift)


def test_different_windows_are_refused():
    with pytest.raises(ValueError, match="not on the same windows"):
        ppl_difference(entry([1.0, 2.0], [1, 1]), entry([1.0, 2.0, 3.0], [1, 1, 1]))
    with pytest.raises(ValueError, match="no per-window values"):
        ppl_difference(Perplexity.from_json(perplexity("rcpu128", 3.0)), entry([1.0], [1]))


def test_one_task_accuracy_matches_scipy_and_tasks_are_averaged():
    rng = np.random.default_rng(3)
    a, b = rng.random(300) < 0.62, rng.random(300) < 0.55
    ours = accuracy_difference({"piqa": a.tolist()}, {"piqa": b.tolist()})
    result = stats.bootstrap((a.astype(float), b.astype(float)), lambda x, y, axis: 100 * (x.mean(axis) - y.mean(axis)),
                             paired=True, vectorized=True, n_resamples=20000, method="percentile",
                             random_state=np.random.default_rng(4))
    low, high = result.confidence_interval
    assert ours.estimate == pytest.approx(100 * (a.mean() - b.mean()))
    assert abs(ours.low - low) < 0.05 * (high - low) and abs(ours.high - high) < 0.05 * (high - low)
    c, d = rng.random(50) < 0.5, rng.random(50) < 0.5
    both = accuracy_difference({"piqa": a.tolist(), "boolq": c.tolist()}, {"piqa": b.tolist(), "boolq": d.tolist()})
    assert both.estimate == pytest.approx(50 * ((a.mean() - b.mean()) + (c.mean() - d.mean())))
    assert both.high - both.low > ours.high - ours.low  # the small task's noise widens the mean's interval


def stored_run(method: str, ratio: float, nll: list[float], items: list[float] | None = None, *,
               windows: bool = True, profile: str = "p") -> StoredResult:
    """A stored run with per-window NLL sums (64 targets each; ``windows=False``: only their perplexity, as records
    written before per-window values were kept) and, optionally, per-document scores of every task."""
    return StoredResult.from_entry(Entry.from_json(store_line(method, ratio, nll, items, windows=windows,
                                                              profile=profile)))


def store_line(method: str, ratio: float, nll: list[float], items: list[float] | None = None, *,
               windows: bool = True, profile: str = "p") -> dict:
    """:func:`stored_run`'s store entry, as records.jsonl holds it."""
    from rcpu_bench.evaluation.metric_maps import METRIC_MAPS
    from rcpu_bench.pruning.methods import RECIPES
    from rcpu_bench.pruning.options import PruneConfig

    prune = {**PruneConfig().to_dict(), **RECIPES[method].prune, "ratio": ratio}
    cell = {"matrix": "m", "model": "/m", "model_label": "M", "revision": None, "method": method,
            "method_label": RECIPES[method].label, "n_calib": 8, "seqlen": 64, "calib": "tinystories:8x64",
            "prune": prune, "ppl_profiles": ["p"], "eval": ["ppl"], "dtype": "float32", "device": "cpu",
            "eval_batch_size": 8, "zeroshot_limit": None, "skip": []}
    targets = [64] * len(nll)
    record = {"experiment": {"prune": prune}, "parameters": {"before": 10, "after": 8, "removed_fraction": 0.2},
              "perplexity": [{**perplexity(profile, math.exp(sum(nll) / sum(targets))),
                              **({"window_nll": nll, "window_targets": targets} if windows else {})}],
              "calibration_ppl": 2.0, "timing": {"total_seconds": 1.0, "prune_seconds": {}, "layers": []},
              "peak_memory_bytes": 1, "schema_version": 1}
    if items is not None:
        record["zeroshot"] = {"tasks": {task: {"metric": metric, metric: sum(items) / len(items), "items": items}
                                        for task, metric in METRIC_MAPS["paper"].items()}}
    return {"cell_id": f"{method}-{ratio}", "status": "ok", "cell": cell, "record": json.loads(json.dumps(record)),
            "seconds": 1.0}


def test_the_ranking_orders_runs_and_names_ties_against_the_run_above_and_the_best():
    rng = np.random.default_rng(5)
    base = rng.normal(3.0, 0.4, 300) * 64
    runs = [stored_run("rcpu-rot", 0.2, list(base + 0.50 * 64)),  # clearly worse than ridge
            stored_run("ls-best", 0.2, list(base)),  # the best
            stored_run("rcpu-rot-scale", 0.2, list(base + 0.50 * 64 + rng.normal(0, 0.01, 300) * 64)),  # ≈ rot
            stored_run("original", 0.0, list(base - 64))]
    (table,) = ranking_tables(runs, "p")
    rows = [(row.label, row.cells[2], row.cells[4]) for row in table.rows]
    assert rows[0][0] == "Prop.Score+LS (lambda_best)"  # the dense model (ratio 0) is not ranked
    assert {label for label, _, _ in rows[1:]} == {"RCPU (Rot.)", "RCPU (Rot.+Scale)"}
    assert rows[0][1:] == ("", "") and rows[1][1:] == ("worse", "worse")
    assert rows[2][1] == "tie" and rows[2][2] == "worse"  # the two rotations are not told apart
    assert table.rows[1].cells[0] == pytest.approx(math.exp((base + 32).sum() / (64 * 300)), rel=1e-2)


def test_the_zero_shot_ranking_needs_per_document_scores():
    runs = [stored_run("rcpu-rot", 0.2, [128.0] * 4, items=[1.0, 0.0] * 50),
            stored_run("ls-best", 0.2, [128.0] * 4, items=[1.0, 1.0, 1.0, 0.0] * 25),
            stored_run("wanda-sp", 0.2, [128.0] * 4)]  # no zero-shot: ranked by perplexity only
    tables = ranking_tables(runs, "p")
    accuracy = next(table for table in tables if "zero-shot" in table.title)
    assert [(row.label, row.cells[0]) for row in accuracy.rows] == [("Prop.Score+LS (lambda_best)", 75.0),
                                                                     ("RCPU (Rot.)", 50.0)]
    assert accuracy.rows[1].cells[2] == "worse"


# -------------------------------------------------------------- runs a ranking cannot compare are named, not dropped

def test_a_run_without_per_window_values_is_a_named_row_not_a_silent_drop():
    """A record written before per-window values were kept (here the best run) stays in its ratio's rows, its
    perplexity shown and the reason in its comparison cell; the others are ranked among themselves."""
    rng = np.random.default_rng(6)
    base = rng.normal(3.0, 0.4, 100) * 64
    runs = [stored_run("rcpu-rot", 0.2, list(base + 32)), stored_run("ls-best", 0.2, list(base + 64)),
            stored_run("flap", 0.2, list(base - 64), windows=False)]
    (table,) = ranking_tables(runs, "p")
    assert [row.label for row in table.rows] == ["RCPU (Rot.)", "Prop.Score+LS (lambda_best)", "FLAP"]
    old = table.rows[2]
    assert old.cells[0] == pytest.approx(math.exp((base - 64).sum() / (64 * 100)))
    assert old.cells[1:] == ("not ranked: " + OLD_WINDOWS, "", "", "")
    assert unranked([table]) == [f"FLAP at 20% by perplexity: {OLD_WINDOWS}"]


def old_and_new_lines() -> list[dict]:
    """Records as 0.1.0 wrote them (profile rcpu128, no per-window values) beside today's (a window range of it,
    with them): what a store resumed across the upgrade holds."""
    base = list(np.random.default_rng(7).normal(3.0, 0.4, 50) * 64)
    old = [store_line(method, 0.3, base, windows=False, profile="rcpu128") for method in ("rcpu-rot", "flap")]
    new = [store_line(method, 0.2, [v + shift for v in base], profile="rcpu128[0:50]")
           for method, shift in (("rcpu-rot", 0.0), ("ls-best", 32.0))]
    return old + new


def old_and_new_store() -> list[StoredResult]:
    return [StoredResult.from_entry(Entry.from_json(line)) for line in old_and_new_lines()]


def test_the_default_profile_of_a_mixed_store_is_that_of_the_runs_with_per_window_values():
    from rcpu_bench.tables.results import default_profile

    runs = old_and_new_store()
    assert default_profile(runs) == "rcpu128[0:50]"
    assert default_profile(runs[:2]) == "rcpu128"  # old records only: as before


def test_a_ranking_asked_for_that_can_compare_nothing_is_refused_naming_why():
    from rcpu_bench.tables.tables import make_tables

    runs = old_and_new_store()
    left_out: list[str] = []
    ranked = make_tables(runs, "ranking", profile="rcpu128[0:50]", left_out=left_out)
    assert [row.label for row in ranked[0].rows] == ["RCPU (Rot.)", "Prop.Score+LS (lambda_best)"] and not left_out
    with pytest.raises(ValueError, match=r"nothing to rank: none of the 2 runs with a rcpu128 perplexity .* no "
                                         r"per-window values \(recorded before rcpu-bench kept them"):
        make_tables(runs[:2], "ranking", profile="rcpu128")
    everything = make_tables(runs[:2], "all", profile="rcpu128", left_out=left_out)  # the other tables stay
    assert everything and not any(t.title.startswith("Ranking") for t in everything) and len(left_out) == 2


def test_tables_says_on_stderr_which_runs_it_leaves_out(tmp_path, capsys):
    from rcpu_bench.cli import main

    (tmp_path / "records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in old_and_new_lines()))
    assert main(["tables", "--results", str(tmp_path), "--table", "ranking"]) == 0
    captured = capsys.readouterr()
    assert "| RCPU (Rot.)" in captured.out and "Ranking by perplexity (rcpu128[0:50])" in captured.out
    assert captured.err == ("rcpu-bench: 2 runs with no perplexity under rcpu128[0:50] are left out of its perplexity "
                            "tables (they have rcpu128; --profile shows one)\n")
    assert main(["tables", "--results", str(tmp_path), "--table", "ranking", "--profile", "rcpu128"]) == 2
    assert "nothing to rank" in capsys.readouterr().err
