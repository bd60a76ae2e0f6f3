"""Pruned-unit counts and lowest-score selection with deterministic tie-breaking."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcpu_bench.selection.select import Selection, kept_multiple, n_pruned, round_kept, select_by_score


def lowest_first_direct(scores: list[float], count: int) -> list[int]:
    """Reference choice: order units by (score, index) and prune the first ``count``."""
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[:count])


# --- counts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,heads,channels", [(0.1, 3, 1100), (0.2, 6, 2201), (0.3, 9, 3302), (0.5, 16, 5504)])
def test_llama_7b_floor_counts(ratio, heads, channels):
    """methods-spec table: LLaMA-7B (H=32, I=11008), floor rounding as in the official code."""
    assert n_pruned(32, ratio, "floor") == heads
    assert n_pruned(11008, ratio, "floor") == channels


@pytest.mark.parametrize("ratio,heads", [(0.1, 4), (0.2, 8), (0.3, 12)])
def test_llama2_13b_head_counts(ratio, heads):
    assert n_pruned(40, ratio, "floor") == n_pruned(40, ratio, "ceil") == heads


@pytest.mark.parametrize("ratio,heads,channels", [(0.1, 4, 1101), (0.2, 7, 2202), (0.3, 10, 3303)])
def test_llama_7b_ceil_counts(ratio, heads, channels):
    """The paper's text: ⌈ρ·n⌉ units pruned."""
    assert n_pruned(32, ratio, "ceil") == heads
    assert n_pruned(11008, ratio, "ceil") == channels


def test_default_rounding_is_floor():
    assert n_pruned(32, 0.1) == 3


def test_ratio_zero_prunes_nothing():
    assert n_pruned(32, 0.0, "floor") == n_pruned(32, 0.0, "ceil") == 0


@pytest.mark.parametrize("n,ratio,expected", [(100, 0.07, 7), (25, 0.28, 7)])
def test_ceil_count_is_exact_for_decimal_ratios(n, ratio, expected):
    """⌈ρ·n⌉ of an exact product must not round up float noise (0.07·100 = 7.000000000000001 in binary)."""
    assert n_pruned(n, ratio, "ceil") == expected


@pytest.mark.parametrize("n,ratio,expected", [(100, 0.29, 29), (90, 0.7, 63)])
def test_floor_count_is_exact_for_decimal_ratios(n, ratio, expected):
    """⌊ρ·n⌋ of an exact product must not round down float noise (0.29·100 = 28.999999999999996 in binary)."""
    assert n_pruned(n, ratio, "floor") == expected


def test_counts_match_exact_rational_arithmetic_on_a_grid():
    """Every n ≤ 200 and every two-decimal ratio: the count is ⌊ρ·n⌋ / ⌈ρ·n⌉ of the exact decimal ρ."""
    wrong = []
    for n in range(1, 201):
        for percent in range(100):
            for rounding, rnd in (("floor", math.floor), ("ceil", math.ceil)):
                exact = rnd(Fraction(percent, 100) * n)
                if exact < n and n_pruned(n, percent / 100, rounding) != exact:
                    wrong.append((n, percent / 100, rounding, exact))
    assert not wrong, f"{len(wrong)} wrong counts (n, ratio, rounding, expected), e.g. {wrong[:5]}"


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(ValueError, match=f"ratio {ratio!r}.*outside"):
        n_pruned(10, ratio)


@pytest.mark.parametrize("n,ratio,rounding", [(1, 0.5, "ceil"), (3, 0.9, "ceil"), (2, 0.99, "ceil")])
def test_ratio_that_removes_every_unit_is_rejected(n, ratio, rounding):
    with pytest.raises(ValueError, match=f"prune all {n} units"):
        n_pruned(n, ratio, rounding)


def test_unknown_rounding_is_rejected():
    with pytest.raises(ValueError, match="'round'.*allowed"):
        n_pruned(10, 0.3, "round")


# --- select_by_score --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75]),
       st.sampled_from(["floor", "ceil"]))
def test_selection_prunes_lowest_with_lower_index_first_on_ties(raw, ratio, rounding):
    """Few distinct values, so ties are frequent; compare with the (score, index) reference order.

    Ratios are dyadic, so ρ·n is exact and the count is unambiguous.
    """
    scores = [float(v) for v in raw]
    count = (math.floor if rounding == "floor" else math.ceil)(Fraction(ratio) * len(scores))
    if count >= len(scores):
        with pytest.raises(ValueError):
            select_by_score(torch.tensor(scores, dtype=torch.float64), ratio, rounding)
        return
    sel = select_by_score(torch.tensor(scores, dtype=torch.float64), ratio, rounding)
    assert len(sel.pruned) == count
    assert sel.pruned.tolist() == lowest_first_direct(scores, count)
    assert sorted(sel.kept.tolist() + sel.pruned.tolist()) == list(range(len(scores)))
    assert sel.kept.tolist() == sorted(sel.kept.tolist())


def test_all_equal_scores_prune_the_lowest_indices():
    sel = select_by_score(torch.ones(6), 0.5)
    assert sel.pruned.tolist() == [0, 1, 2] and sel.kept.tolist() == [3, 4, 5]


def test_ties_at_the_threshold_prune_exactly_n_units():
    """Three units tie at the threshold; only two are pruned (a `>= thresh` rule would keep all three)."""
    sel = select_by_score(torch.tensor([5.0, 1.0, 1.0, 1.0, 2.0, 0.5]), 0.5)
    assert sel.pruned.tolist() == [1, 2, 5]
    assert sel.kept.tolist() == [0, 3, 4]


def test_ratio_zero_keeps_everything():
    sel = select_by_score(torch.tensor([3.0, 1.0, 2.0]), 0.0)
    assert sel.kept.tolist() == [0, 1, 2] and sel.pruned.numel() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_are_rejected(bad):
    with pytest.raises(ValueError, match="NaN or infinite"):
        select_by_score(torch.tensor([1.0, bad, 2.0]), 0.3)


def test_bad_ratio_is_rejected_by_select_by_score():
    with pytest.raises(ValueError, match="outside"):
        select_by_score(torch.tensor([1.0, 2.0]), 1.0)


# --- columns ----------------------------------------------------------------------------------------

def test_columns_expand_units_to_contiguous_blocks():
    sel = Selection(kept=torch.tensor([0, 2]), pruned=torch.tensor([1, 3]))
    cols = sel.columns(3)
    assert cols.kept.tolist() == [0, 1, 2, 6, 7, 8]
    assert cols.pruned.tolist() == [3, 4, 5, 9, 10, 11]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10), st.integers(1, 6), st.data())
def test_columns_partition_all_columns(n_units, unit_size, data):
    scores = torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=n_units, max_size=n_units)),
                          dtype=torch.float64)
    sel = select_by_score(scores, data.draw(st.sampled_from([0.0, 0.3, 0.5])))
    cols = sel.columns(unit_size)
    assert sorted(cols.kept.tolist() + cols.pruned.tolist()) == list(range(n_units * unit_size))
    assert {c // unit_size for c in cols.pruned.tolist()} == set(sel.pruned.tolist())
    assert len(cols.pruned) == unit_size * len(sel.pruned)


def test_columns_of_empty_pruned_set_is_empty():
    cols = select_by_score(torch.tensor([1.0, 2.0, 3.0]), 0.0).columns(4)
    assert cols.pruned.numel() == 0 and cols.kept.tolist() == list(range(12))


# round_to: kept widths rounded to a multiple --------------------------------------------------------------------


@pytest.mark.parametrize("channels, unit_size, expected", [(64, 1, 64), (32, 8, 4), (128, 128, 1), (64, 96, 2)])
def test_kept_multiple_is_the_fewest_units_filling_whole_multiples(channels, unit_size, expected):
    assert kept_multiple(channels, unit_size) == expected
    assert expected * unit_size % channels == 0
    assert all(k * unit_size % channels for k in range(1, expected))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=2, max_size=24), st.integers(0, 23), st.integers(1, 8))
def test_round_kept_matches_a_brute_force_choice(raw, n_pruned_units, multiple):
    """Against brute force: the kept count is the multiple of m in [m, n] nearest |K| (ties upward), and the kept
    set is the best-scoring units of the original selection's order (score, then lower index pruned first)."""
    scores = torch.tensor(raw, dtype=torch.float64)
    n = len(raw)
    if multiple > n:
        with pytest.raises(ValueError, match=f"multiple of {multiple}"):
            round_kept(select_by_score(scores, 0.0), scores, multiple)
        return
    order = sorted(range(n), key=lambda i: (raw[i], i))  # pruning order, as select_by_score
    pruned = sorted(order[:min(n_pruned_units, n - 1)])
    start = Selection(torch.tensor(sorted(set(range(n)) - set(pruned)), dtype=torch.long),
                      torch.tensor(pruned, dtype=torch.long))
    result = round_kept(start, scores, multiple)
    candidates = range(multiple, n + 1, multiple)
    k = len(start.kept)
    target = min(candidates, key=lambda c: (abs(c - k), -c))
    assert len(result.kept) == target and len(result.kept) + len(result.pruned) == n
    assert sorted(result.kept.tolist()) == sorted(order[n - target:])
