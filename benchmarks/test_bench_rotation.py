"""Rotation solve time at LLaMA-7B shapes: today's SVD against ``rcpu_bench.compensation.rotation.polar``
(pytest-benchmark).

M is 4096 × 4096 (scaled by RCPU_BENCH_SCALE): ``o_proj`` is rank-deficient like a pruned o_proj,
M = A W_Kᵀ with W_K of 3328 = 26 of 32 heads' columns, and ``full`` has full rank. Variants: the SVD
U Vᵀ as compensators.py computed it before (float64 and float32, default driver), ``polar`` with
the default solver (``auto``) for a float64 and a float32 M, and ``polar`` with each of its checked solvers
(``eigh``: eigh of MᵀM, polish and checks; ``svd``: the float64 LAPACK SVD) for a float64 M, whose ratio at
several widths sets ``rotation.CPU_SVD_BELOW`` (``benchmarks/README.md``).
Each result is checked (orthogonality and tr(QᵀM) against the float64 SVD's tr Σ), never its time.

Environment: RCPU_BENCH_SCALE multiplies the width (default 1; 0.05 to validate quickly),
RCPU_BENCH_ROUNDS sets the timed rounds (default 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import Tensor

from rcpu_bench.compensation.rotation import orthogonality_error, polar, tolerance

SCALE = float(os.environ.get("RCPU_BENCH_SCALE", "1"))
ROUNDS = int(os.environ.get("RCPU_BENCH_ROUNDS", "1"))
WIDTH, KEPT = 4096, 3328  # LLaMA-7B hidden size; o_proj columns kept at ratio 0.2 (26 of 32 heads)


def make_m(kind: str, n: int, seed: int = 0) -> Tensor:
    """A float64 M: ``o_proj`` = (W_K S + W_D C) W_Kᵀ of rank k = 13n/16, or ``full`` = W S Wᵀ + R of full rank."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, n, generator=g, dtype=torch.float64) / n**0.5
    scales = torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.5
    if kind == "full":
        return (w * scales) @ w.T + 0.1 * torch.randn(n, n, generator=g, dtype=torch.float64) / n**0.5
    k = round(n * KEPT / WIDTH)
    coupling = torch.randn(n - k, k, generator=g, dtype=torch.float64) / n**0.5
    return (w[:, :k] * scales[:k] + w[:, k:] @ coupling) @ w[:, :k].T


def svd_today(m: Tensor) -> tuple[Tensor, float]:
    """compensators.rotation before the solver: Q = U Vᵀ from torch.linalg.svd (default driver), tr Σ."""
    u, sigma, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh, float(sigma.sum())


def polar_by(solver: str) -> Callable[[Tensor], tuple[Tensor, float]]:
    """``polar(M, solver)`` as (Q, tr(QᵀM))."""
    def solve(m: Tensor) -> tuple[Tensor, float]:
        rotation = polar(m, solver)
        return rotation.q, rotation.trace
    return solve


VARIANTS: dict[str, tuple[Callable[[Tensor], tuple[Tensor, float]], torch.dtype]] = {
    "svd-float64": (svd_today, torch.float64), "svd-float32": (svd_today, torch.float32),
    "polar-float64": (polar_by("auto"), torch.float64), "polar-float32": (polar_by("auto"), torch.float32),
    "polar_eigh-float64": (polar_by("eigh"), torch.float64), "polar_svd-float64": (polar_by("svd"), torch.float64)}


@pytest.fixture(scope="session", params=["o_proj", "full"])
def matrix(request: pytest.FixtureRequest) -> tuple[str, Tensor, float]:
    """(kind, M, reference tr Σ from float64 singular values), built once per session."""
    m = make_m(request.param, max(round(WIDTH * SCALE), 2))
    return request.param, m, float(torch.linalg.svdvals(m).sum())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rotation(benchmark: BenchmarkFixture, matrix: tuple[str, Tensor, float], variant: str) -> None:
    """Time one solve; print ‖QᵀQ − I‖_F and the relative tr(QᵀM) gap; polar's must be within tolerance."""
    kind, m, nuclear = matrix
    solve, dtype = VARIANTS[variant]
    benchmark.group = f"rotation {kind} n={m.shape[0]}"
    m_dtype = m.to(dtype)
    q, _ = benchmark.pedantic(solve, args=(m_dtype,), rounds=ROUNDS, iterations=1)
    error = orthogonality_error(q)
    gap = (nuclear - float((q.to(torch.float64) * m).sum())) / nuclear
    benchmark.extra_info.update(orthogonality_error=error, relative_trace_gap=gap)
    print(f"\n{variant} {kind}: ‖QᵀQ − I‖_F = {error:.3g}, relative tr(QᵀM) gap = {gap:.3g}")
    if variant.startswith("polar"):
        assert error <= tolerance(m.shape[0], dtype) and abs(gap) <= 10 * tolerance(m.shape[0], dtype)
