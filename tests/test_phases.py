"""Two phases for λ-grid cells with zero-shot: perplexity for the grid, zero-shot only at λ_best, resumable."""

from __future__ import annotations

import hashlib
import sys
import types
from dataclasses import replace

import pytest
import torch
from registries import builtin_registry
from tiny_matrices import tiny_matrix
from tiny_models import needs_stories

from rcpu_bench.cli import main
from rcpu_bench.experiment import run_experiment
from rcpu_bench.matrix import executors
from rcpu_bench.matrix.phases import lambda_group, plan_phases
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import expand, load_matrix
from rcpu_bench.matrix.store import Store

REGISTRY = builtin_registry()
LAMBDAS = [1.0e-3, 1.0, 1.0e3]
RIDGE = {"name": "my-ridge", "scorer": "wanda-sp", "compensator": "ridge"}  # a λ-grid method (λ left free)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the bytes of every tensor of the state dict, in name order: equal iff bit-identical."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture
def zeroshot(monkeypatch):
    """A stand-in for rcpu_bench.evaluation.zeroshot that records the digest of every model it evaluates;
    ``fail`` (an exception, raised once) makes the next call fail."""
    module = types.ModuleType("rcpu_bench.evaluation.zeroshot")
    module.calls, module.fail = [], None

    def evaluate_zeroshot(model, tokenizer, limit):
        if module.fail is not None:
            error, module.fail = module.fail, None
            raise error
        module.calls.append(weights_digest(model))
        return {"mean": 0.5, "weights": module.calls[-1]}

    module.plan_zeroshot = lambda: types.SimpleNamespace(data_files={"boolq.jsonl": "sha256:0"})
    module.evaluate_zeroshot = evaluate_zeroshot
    monkeypatch.setitem(sys.modules, "rcpu_bench.evaluation.zeroshot", module)
    return module


@pytest.fixture
def prunings(monkeypatch):
    """The experiments the executors run (each is one pruning), in order."""
    runs = []

    def counted(experiment, **kwargs):
        runs.append(experiment)
        return run_experiment(experiment, **kwargs)

    monkeypatch.setattr(executors, "run_experiment", counted)
    return runs


def grid_matrix(*methods, **changes):
    return tiny_matrix([RIDGE, *methods], **{"lambdas": LAMBDAS, "eval": ["ppl", "zeroshot"], **changes})


# --- the plan -------------------------------------------------------------------------------------


def test_the_paper_matrix_runs_zero_shot_once_per_lambda_group_and_the_dry_run_says_so(capsys):
    matrix = load_matrix("paper")
    cells = expand(matrix, REGISTRY)
    # Independently: ls-best is the only λ-grid method; one group per model × N_calib × ratio.
    groups = len(matrix.models) * len(matrix.calib.n_calib) * len(matrix.ratios)
    grid = groups * len(matrix.lambdas)
    others = len(cells) - grid
    assert (len(cells), grid, groups) == (309, 234, 18)
    counts = plan_phases(cells).counts()
    assert counts == {"cells": 309, "groups": groups, "deferred": grid, "phase1_zeroshot": others,
                      "phase2_zeroshot": groups, "zeroshot": others + groups, "zeroshot_every_cell": 309,
                      "reprunes": groups}
    assert main(["run", "--matrix", "paper", "--dry-run"]) == 0
    tail = capsys.readouterr().out.rstrip().splitlines()[-4:]
    assert tail == [
        "309 cells",
        "phase 1: 309 cells prune and measure perplexity; 75 of them (not on a λ grid) also run zero-shot, "
        "the 234 λ-grid cells do not",
        "phase 2: zero-shot at λ_best (rule paper: lowest calibration perplexity) for each of 18 λ groups of 13 λ, "
        "re-pruning the chosen cell: 18 runs",
        "zero-shot evaluations: 93 instead of 309 (216 saved), for 18 extra prunings"]


def test_matrices_without_zero_shot_lambda_groups_have_one_phase():
    for name in ("smoke", "full", "ablation"):
        assert plan_phases(expand(load_matrix(name), REGISTRY)).groups == ()
    # A single λ is no choice; a λ grid without zero-shot needs no second phase.
    assert plan_phases(expand(grid_matrix(lambdas=[1.0]), REGISTRY)).groups == ()
    assert plan_phases(expand(grid_matrix(eval=["ppl"]), REGISTRY)).groups == ()


def test_a_lambda_group_is_every_cell_that_differs_only_in_lambda():
    cells = expand(grid_matrix("rcpu-rot", ratios=[0.1, 0.2], calib={"source": "tinystories", "n_calib": [4, 8],
                                                                      "seqlen": 64}), REGISTRY)
    groups = plan_phases(cells).groups
    assert len(groups) == 4 and all(len(group) == len(LAMBDAS) for group in groups)
    for group in groups:
        assert sorted(cell.lam for cell in group) == LAMBDAS
        assert len({(c.ratio, c.n_calib, c.method_label) for c in group}) == 1
    assert {lambda_group(c) for c in cells if c.lam is None}.isdisjoint({lambda_group(g[0]) for g in groups})


# --- running --------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_stories
def test_phase_two_runs_zero_shot_only_at_the_argmin_of_the_calibration_perplexity(tmp_path, zeroshot, prunings):
    matrix = grid_matrix("rcpu-rot")
    cells = expand(matrix, REGISTRY)
    summary = run_matrix(matrix, tmp_path, progress=False)
    assert (summary.ok, summary.failed, summary.best_ok, summary.best_failed) == (4, 0, 1, 0)
    entries = Store(tmp_path).entries()
    assert [e.cell_id for e in entries[:4]] == [c.id for c in cells]  # the matrix's ids, unchanged
    grid = [e for e in entries[:4] if "lam" in e.cell.prune["compensator_params"]]
    assert [e.phase for e in entries[:4]] == ["ppl", "ppl", "ppl", None]
    assert all(e.record.zeroshot is None for e in grid)
    assert entries[3].record.zeroshot is not None and entries[3].cell.method == "rcpu-rot"
    # The chosen λ is the argmin of the phase-1 calibration perplexities, computed here.
    argmin = min(grid, key=lambda e: e.record.calibration_ppl)
    assert len({e.record.calibration_ppl for e in grid}) == 3  # a real choice
    best = entries[4]
    assert best.cell_id == argmin.cell_id and best.status == "ok"
    assert (best.phase, best.lambda_rule) == ("lambda_best", "paper")
    assert best.chosen_from == [e.cell_id for e in grid]
    assert best.record == replace(argmin.record, zeroshot=best.record.zeroshot)
    # Zero-shot ran twice (rcpu-rot, λ_best), and five prunings: four cells and the re-pruned λ_best.
    assert len(zeroshot.calls) == 2 and len(prunings) == 5
    # The re-run measures the calibration perplexity (its check) but not the evaluation's, which phase 1 has.
    chosen = next(c for c in cells if c.id == argmin.cell_id).experiment()
    assert chosen.ppl_profiles and prunings[-1] == replace(chosen, ppl_profiles=())
    # Re-pruning is bit-identical: the weights zero-shot saw are those of an independent run of the chosen cell.
    independent = run_experiment(prunings[-1], progress=False, evaluate=lambda model, _: {"w": weights_digest(model)})
    assert best.record.zeroshot["weights"] == independent.extra["w"]
    assert best.reproduced == {"identical": True, "calibration_ppl": [argmin.record.calibration_ppl] * 2}
    # A rerun has nothing left to do.
    again = run_matrix(matrix, tmp_path, progress=False)
    assert (again.skipped, again.ok, again.best_skipped, again.best_ok) == (4, 0, 1, 0)
    assert len(Store(tmp_path).entries()) == 5


@pytest.mark.slow
@needs_stories
def test_a_crash_between_the_phases_loses_nothing_and_the_rerun_continues_with_phase_two(tmp_path, zeroshot,
                                                                                           prunings):
    matrix = grid_matrix()
    zeroshot.fail = KeyboardInterrupt()  # the first zero-shot evaluation is phase 2's: the run stops there
    with pytest.raises(KeyboardInterrupt):
        run_matrix(matrix, tmp_path, progress=False)
    phase1 = Store(tmp_path).entries()
    assert [e.phase for e in phase1] == ["ppl"] * 3 and len(prunings) == 4
    prunings.clear()
    plans = []
    summary = run_matrix(matrix, tmp_path, progress=False, announce=plans.append)
    assert (summary.skipped, summary.ok, summary.best_ok) == (3, 0, 1) and len(prunings) == 1
    assert "  3 cells: 0 to run, 3 already finished\n" in plans[0]
    assert "  zero-shot at λ_best: 1 of 1 groups to run\n" in plans[0]
    assert "phase 2: zero-shot at λ_best (rule paper: lowest calibration perplexity) for each of 1 λ groups" in plans[0]
    entries = Store(tmp_path).entries()
    assert entries[:3] == phase1 and entries[3].phase == "lambda_best"


@pytest.mark.slow
@needs_stories
def test_a_failed_zero_shot_at_lambda_best_is_recorded_and_retried_without_redoing_phase_one(tmp_path, zeroshot,
                                                                                             prunings):
    matrix = grid_matrix()
    zeroshot.fail = RuntimeError("out of memory")
    summary = run_matrix(matrix, tmp_path, progress=False)
    assert (summary.ok, summary.best_failed, summary.any_failed) == (3, 1, True)
    failed = Store(tmp_path).entries()[-1]
    assert (failed.status, failed.phase, failed.error["message"]) == ("failed", "lambda_best",
                                                                               "out of memory")
    prunings.clear()
    retry = run_matrix(matrix, tmp_path, progress=False)
    assert (retry.skipped, retry.ok, retry.best_ok) == (3, 0, 1) and len(prunings) == 1
    latest = Store(tmp_path).latest()[failed.cell_id]
    assert latest.status == "ok" and latest.record.zeroshot is not None


@pytest.mark.slow
@needs_stories
def test_a_phase_one_failure_makes_its_group_wait(tmp_path, zeroshot, prunings, monkeypatch):
    matrix = grid_matrix()
    broken = expand(matrix, REGISTRY)[1].experiment()

    def flaky(experiment, **kwargs):
        if experiment == broken:
            raise RuntimeError("worker lost")
        return run_experiment(experiment, **kwargs)

    monkeypatch.setattr(executors, "run_experiment", flaky)
    summary = run_matrix(matrix, tmp_path, progress=False)
    assert (summary.ok, summary.failed, summary.best_waiting, summary.best_ok) == (2, 1, 1, 0) and not zeroshot.calls
