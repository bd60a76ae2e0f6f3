"""The main-effects table of a factorial store, against effects planted in synthetic perplexities."""

from __future__ import annotations

from itertools import product
from statistics import fmean

import pytest
from test_tables import entry, stored

from rcpu_bench.tables.main_effects import factorial_points, interaction, level_means, level_order, write_plots
from rcpu_bench.tables.tables import make_tables

SELECTION = {"wanda-sp": 3.0, "variance": 1.0, "obs": -1.0}
COMPENSATION = {"none": 4.0, "ridge": -1.0, "procrustes": 0.5}
ALLOCATION = {"uniform": 0.0, "log-increase": 0.6, "al-am": -0.3}


def run(scorer: str, compensator: str, allocation: str, ppl: float, *, lam: float | None = None,
        calibration_ppl: float = 20.0, n_calib: int = 8) -> dict:
    prune = {"scorer": scorer, "compensator": compensator}
    prune.update({"structure": "al-am"} if allocation == "al-am" else {"allocation": allocation})
    return entry("custom", 0.2, ppl, prune=prune, label=f"{scorer}+{compensator}+{allocation}", lam=lam,
                 calibration_ppl=calibration_ppl, n_calib=n_calib, model="Llama-7B")


def design(bump: float = 0.0) -> list[dict]:
    """Additive perplexities 10 + effects, plus ``bump`` on (obs, ridge) only: a selection × compensation
    interaction."""
    return [run(s, c, a, 10 + SELECTION[s] + COMPENSATION[c] + ALLOCATION[a] + (bump if (s, c) == ("obs", "ridge")
                                                                                   else 0.0))
            for s, c, a in product(SELECTION, COMPENSATION, ALLOCATION)]


def centred(effects: dict[str, float]) -> dict[str, float]:
    mean = fmean(effects.values())
    return {k: v - mean for k, v in effects.items()}


def test_main_effects_recover_planted_additive_effects_and_no_interaction():
    points = factorial_points(stored(design()), "rcpu128")[("Llama-7B", 0.2)]
    for index, planted in enumerate((SELECTION, COMPENSATION, ALLOCATION)):
        means, groups = level_means(points, index)
        grand = fmean(means.values())
        assert {k: v - grand for k, v in means.items()} == pytest.approx(centred(planted))
        assert groups == 9
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert interaction(points, a, b) == pytest.approx(0.0, abs=1e-12)


def test_an_interaction_on_one_pair_of_levels_shows_in_its_rms():
    bump = 2.7
    points = factorial_points(stored(design(bump)), "rcpu128")[("Llama-7B", 0.2)]
    # the RMS residual of the planted two-way table (the bump alone; the additive part leaves no residual)
    table = {(s, c): (bump if (s, c) == ("obs", "ridge") else 0.0) for s in SELECTION for c in COMPENSATION}
    grand = fmean(table.values())
    rows = {s: fmean(table[s, c] for c in COMPENSATION) for s in SELECTION}
    cols = {c: fmean(table[s, c] for s in SELECTION) for c in COMPENSATION}
    expected = fmean((table[s, c] - rows[s] - cols[c] + grand) ** 2 for s, c in table) ** 0.5
    assert interaction(points, 0, 1) == pytest.approx(expected)
    assert interaction(points, 0, 2) == pytest.approx(0.0, abs=1e-12)


def test_an_unfinished_store_compares_only_balanced_groups():
    entries = [e for e in design() if not (e["cell"]["prune"]["scorer"] == "obs"
                                           and e["cell"]["prune"]["compensator"] == "none")]
    points = factorial_points(stored(entries), "rcpu128")[("Llama-7B", 0.2)]
    means, groups = level_means(points, 0)  # selection: groups without (obs, none) are left out
    assert groups == 6
    grand = fmean(means.values())
    assert {k: v - grand for k, v in means.items()} == pytest.approx(centred(SELECTION))


def test_ridge_enters_at_lambda_best_and_the_table_kind_renders():
    entries = [e for e in design() if e["cell"]["prune"]["compensator"] != "ridge"]
    for s, a in product(SELECTION, ALLOCATION):
        base = 10 + SELECTION[s] + COMPENSATION["ridge"] + ALLOCATION[a]
        entries += [run(s, "ridge", a, base, lam=1.0, calibration_ppl=5.0),  # λ_best: lowest calibration ppl
                    run(s, "ridge", a, base + 50, lam=100.0, calibration_ppl=9.0)]
    tables = make_tables(stored(entries), "main-effects", profile="rcpu128")
    assert len(tables) == 2
    rows = {row.label: row.cells for row in tables[0].rows}
    mean_ppl = rows["compensation: ridge"][0]
    expected = 10 + fmean(SELECTION.values()) + COMPENSATION["ridge"] + fmean(ALLOCATION.values())
    assert mean_ppl == pytest.approx(expected)
    assert rows["selection: wanda-sp"][2] == pytest.approx(max(SELECTION.values()) - min(SELECTION.values()))


def test_ridge_at_a_relative_damping_is_a_level_of_its_own():
    damped = entry("custom", 0.2, 7.0, label="variance+ridge damped", n_calib=8, prune={
        "scorer": "variance", "compensator": "ridge", "compensator_params": {"lam": 0.0, "lam_rel": 0.01}})
    points = factorial_points(stored([*design(), damped]), "rcpu128")[("Llama-7B", 0.2)]
    assert points[("variance", "ridge (damped)", "uniform", 8)] == 7.0
    assert points[("variance", "ridge", "uniform", 8)] == 10 + SELECTION["variance"] + COMPENSATION["ridge"]


def test_the_figure_is_drawn_only_for_a_balanced_factorial_store(tmp_path):
    (path,) = write_plots(stored(design()), tmp_path, "rcpu128")
    assert path.name == "main_effects_Llama-7B_0.2.png" and path.read_bytes().startswith(b"\x89PNG")
    only_uniform = [e for e in design() if e["cell"]["prune"].get("allocation") == "uniform"]
    flap = [run("flap-wifv", "flap-bias", "al-am", 12.0)]  # an al-am run with no uniform counterpart
    assert write_plots(stored(only_uniform + flap), tmp_path / "none", "rcpu128") == []


def test_numeric_levels_are_in_numeric_order_and_names_alphabetical():
    """N_calib 8 comes before 128 (not "128" < "8" as text); names stay alphabetical, after the numbers."""
    points = {("a", n): float(n) for n in (128, 8, 32)} | {("b", n): float(n) + 1 for n in (128, 8, 32)}
    assert list(level_means(points, 1)[0]) == [8, 32, 128]
    assert sorted(["ridge", 128, "none", 8, 0.5], key=level_order) == [0.5, 8, 128, "none", "ridge"]
