"""Per-module compensation time at LLaMA-7B shapes, given precomputed statistics (pytest-benchmark).

Each compensator runs on o_proj (4096×4096) and down_proj (4096×11008) at pruning ratio 0.2, from a
Gram matrix built once per module from 16,384 synthetic tokens (not timed). A second group compares
the 13-value λ grid by ``ridge_grid`` (one Cholesky per λ, the problem's products shared) with 13 separate
``ridge`` calls. A third times folding one chunk of tokens into G in each ``gram_precision`` (mixed versus float64),
a fourth folding one chunk of inputs and outputs into what Procrustes reads: C = Σ y xᵀ, or S = Σ y yᵀ and
C_D = Σ y x_Dᵀ when the units are chosen before the pass.

Environment: RCPU_BENCH_SCALE multiplies the module widths (default 1; 0.05 to validate quickly),
RCPU_BENCH_ROUNDS sets the timed rounds per benchmark (default 1: a full-size call takes seconds).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from synthetic_modules import ModuleShape, make_weight, module_shapes, select_columns, synthetic_batches

from rcpu_bench.compensation.compensators import (
    LAMBDA_GRID,
    Compensation,
    Problem,
    flap_bias,
    none,
    procrustes,
    ridge,
    ridge_grid,
    scaled_procrustes,
)
from rcpu_bench.selection.select import Selection
from rcpu_bench.statistics.activations import CHUNK_TOKENS, GRAM_PRECISIONS, ActivationStats

SCALE = float(os.environ.get("RCPU_BENCH_SCALE", "1"))
ROUNDS = int(os.environ.get("RCPU_BENCH_ROUNDS", "1"))
CALIBRATION_TOKENS = 128 * 128  # the official calibration set: 128 windows of 128 tokens
COMPENSATORS: dict[str, Callable[..., Compensation]] = {
    "none": none, "flap_bias": flap_bias, "ridge": ridge, "procrustes": procrustes,
    "scaled_procrustes": scaled_procrustes}


@dataclass(frozen=True)
class Case:
    """One module's compensation inputs: weight, streamed statistics and the 20 % selection."""

    shape: ModuleShape
    weight: torch.Tensor
    stats: ActivationStats
    selection: Selection

    @property
    def args(self) -> tuple[torch.Tensor, ActivationStats, torch.Tensor, torch.Tensor]:
        """The (W, stats, kept, pruned) arguments every compensator takes."""
        return self.weight, self.stats, self.selection.kept, self.selection.pruned


@pytest.fixture(scope="session", params=["o_proj", "down_proj"])
def case(request: pytest.FixtureRequest) -> Case:
    """Build W, the selection and the Gram statistics of one module once per session."""
    shape = module_shapes(SCALE)[request.param]
    weight = make_weight(shape)
    stats = ActivationStats.empty(shape.d_in)
    for batch in synthetic_batches(shape.d_in, CALIBRATION_TOKENS):
        stats.update(batch)
    return Case(shape, weight, stats, select_columns(weight, shape))


def separate_ridge(weight: torch.Tensor, stats: ActivationStats, kept: torch.Tensor,
                   pruned: torch.Tensor) -> list[Compensation]:
    """The λ grid as independent Cholesky solves, one ``ridge`` call per λ."""
    return [ridge(weight, stats, kept, pruned, lam=lam) for lam in LAMBDA_GRID]


def timed(benchmark: BenchmarkFixture, solver: Callable[..., object], case: Case) -> Any:
    """Time one call of ``solver`` on the case (ROUNDS rounds of one iteration) and return its result."""
    return benchmark.pedantic(solver, args=case.args, rounds=ROUNDS, iterations=1)


@pytest.mark.parametrize("name", list(COMPENSATORS))
def test_compensator(benchmark: BenchmarkFixture, case: Case, name: str) -> None:
    """Time one compensator; its result must be finite and must not raise the calibration error."""
    benchmark.group = f"compensators {case.shape.name}"
    result = timed(benchmark, COMPENSATORS[name], case)
    assert result.weight.shape == (case.shape.d_out, len(case.selection.kept))
    assert torch.isfinite(result.weight).all()
    assert result.info["objective_after"] <= result.info["objective_before"] * (1 + 1e-6)


def test_lambda_grid_shared_products(benchmark: BenchmarkFixture, case: Case) -> None:
    """Time ``ridge_grid`` over the 13 λ; its two ends must equal separate ``ridge`` solves (not timed)."""
    benchmark.group = f"lambda grid {case.shape.name}"
    grid = timed(benchmark, ridge_grid, case)
    assert [solution.info["lambda"] for solution in grid] == list(LAMBDA_GRID)
    for solution in (grid[0], grid[-1]):
        want = ridge(*case.args, lam=solution.info["lambda"]).weight
        torch.testing.assert_close(solution.weight, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_lambda_grid_separate_cholesky(benchmark: BenchmarkFixture, case: Case) -> None:
    """Time the same 13 λ as independent ``ridge`` (Cholesky) solves."""
    benchmark.group = f"lambda grid {case.shape.name}"
    solutions = timed(benchmark, separate_ridge, case)
    assert all(torch.isfinite(solution.weight).all() for solution in solutions)


@pytest.mark.parametrize("module", ["o_proj", "down_proj"])
@pytest.mark.parametrize("precision", GRAM_PRECISIONS)
def test_gram_accumulation(benchmark: BenchmarkFixture, module: str, precision: str) -> None:
    """Time folding one chunk of synthetic tokens into the statistics; G must match float64 to 1e-5 (not timed)."""
    benchmark.group = f"gram {module}"
    shape = module_shapes(SCALE)[module]
    batch = next(synthetic_batches(shape.d_in, CHUNK_TOKENS, CHUNK_TOKENS))
    stats = benchmark.pedantic(ActivationStats.from_activations, args=(batch,),
                               kwargs={"gram_precision": precision}, rounds=ROUNDS, iterations=1)
    exact = batch.double().T @ batch.double()
    assert float((stats.gram - exact).norm() / exact.norm()) <= 1e-5


@pytest.mark.parametrize("module", ["o_proj", "down_proj"])
@pytest.mark.parametrize("kind", ["cross", "dropped_cross"])
def test_output_statistics_accumulation(benchmark: BenchmarkFixture, module: str, kind: str) -> None:
    """Time folding one chunk of tokens and their outputs into C, or into S and C_D (mixed precision); M = Y Zᵀ
    from either must match float64 to 1e-5 (not timed)."""
    benchmark.group = f"output statistics {module}"
    shape = module_shapes(SCALE)[module]
    weight, batch = make_weight(shape), next(synthetic_batches(shape.d_in, CHUNK_TOKENS, CHUNK_TOKENS))
    selection, outputs = select_columns(weight, shape), batch @ weight.T
    kwargs = {"with_gram": False, "outputs": outputs} | (
        {"with_cross": True} if kind == "cross" else {"dropped": selection.pruned})
    stats = benchmark.pedantic(ActivationStats.from_activations, args=(batch,), kwargs=kwargs, rounds=ROUNDS,
                               iterations=1)
    x, w = batch.double(), weight.double()
    exact = (x @ w.T).T @ (x[:, selection.kept] @ w[:, selection.kept].T)
    got = Problem(weight, stats, selection.kept).yzt(torch.float64)
    assert float((got - exact).norm() / exact.norm()) <= 1e-5
