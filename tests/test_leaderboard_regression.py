"""Today's code reproduces the committed leaderboard: one smoke cell per compensator, perplexity to 1e-6.

The committed records (results/leaderboard/records.jsonl) were computed by earlier versions of the
statistics, solvers and evaluation; a faster solver or evaluation path must not move them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rcpu_bench.matrix.executors import ModelCache, run_cell
from rcpu_bench.matrix.spec import expand, load_matrix
from rcpu_bench.matrix.store import Store
from rcpu_bench.plugins import default_registry

LEADERBOARD = Path(__file__).resolve().parent.parent / "results" / "leaderboard"
CHECKED = {("variance", "none"), ("variance", "flap-bias"), ("variance", "ridge"), ("variance", "procrustes"),
           ("variance", "scaled-procrustes"), ("flap-wifv", "flap-bias")}


def leaderboard_cells_at(ratio: str) -> list:
    matrix = load_matrix(str(LEADERBOARD / "matrix.yaml"), ratios=ratio)  # the smoke matrix, full protocols
    cells = expand(matrix, default_registry())
    return [c for c in cells if (c.prune["scorer"], c.prune["compensator"]) in CHECKED and c.lam in (None, 1.0)]


@pytest.mark.slow
def test_smoke_cells_reproduce_the_committed_leaderboard():
    stored = Store(LEADERBOARD).latest()
    cells = leaderboard_cells_at("0.2")
    assert {(c.prune["scorer"], c.prune["compensator"]) for c in cells} == CHECKED  # and the dense cell
    models = ModelCache()
    for cell in cells:
        expected = stored[cell.id].record
        entry = run_cell(cell, default_registry(), models)
        assert entry.status == "ok", entry.error
        got = {p.profile: p.ppl for p in entry.record.perplexity}
        for p in expected.perplexity:
            assert math.isclose(got[p.profile], p.ppl, rel_tol=1e-6), (cell.describe(), p.profile)
        assert math.isclose(entry.record.calibration_ppl, expected.calibration_ppl, rel_tol=1e-6)
