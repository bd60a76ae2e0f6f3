"""compensation/diagnostics.py against explicit float64 activations (hypothesis property tests)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcpu_bench.compensation import compensators
from rcpu_bench.compensation.diagnostics import (
    module_generalisation,
    relative_error,
    ridge_degrees_of_freedom,
    rotation_degrees_of_freedom,
    summary,
)
from rcpu_bench.methods.olica.calibration import low_rank_dof
from rcpu_bench.plugins import default_registry
from rcpu_bench.statistics.activations import ActivationStats

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def problems(draw):
    """W (d_out × d_in), calibration and held-out activations X (N × d_in), kept columns K, a random W̃ and bias."""
    d_out, d_in = draw(st.integers(2, 7)), draw(st.integers(2, 9))
    n_kept = draw(st.integers(1, d_in))
    n_cal, n_held = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    normal = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    kept = torch.randperm(d_in, generator=gen)[:n_kept].sort().values
    shift = normal(d_in)  # non-zero means, so that a bias term matters
    return (normal(d_out, d_in), normal(n_cal, d_in) + shift, normal(n_held, d_in) + shift, kept,
            normal(d_out, n_kept), normal(d_out))


def explicit_error(w, x, kept, new_w, bias=None):
    """‖Y − W̃ X_K − b1ᵀ‖_F² / ‖Y‖_F² with Y = W X materialised (rows of x are tokens)."""
    y = x @ w.T
    fit = x[:, kept] @ new_w.T + (0 if bias is None else bias)
    return float((y - fit).square().sum() / y.square().sum())


def stats_of(x):
    return ActivationStats.from_activations(x, gram_precision="float64")


@SETTINGS
@given(problems(), st.booleans())
def test_relative_error_from_g_matches_explicit_activations(problem, with_bias):
    w, x, _, kept, new_w, bias = problem
    bias = bias if with_bias else None
    assert relative_error(w, stats_of(x), kept, new_w, bias) == pytest.approx(
        explicit_error(w, x, kept, new_w, bias), rel=1e-9, abs=1e-12)


@SETTINGS
@given(problems(), st.floats(1e-3, 1e3))
def test_ridge_degrees_of_freedom_is_the_trace_of_the_hat_matrix(problem, lam):
    """d_out · tr(X_K (X_Kᵀ X_K + λI)⁻¹ X_Kᵀ), rows of x tokens: the textbook effective degrees of freedom."""
    w, x, _, kept, _, _ = problem
    xk = x[:, kept]
    hat = xk @ torch.linalg.solve(xk.T @ xk + lam * torch.eye(len(kept), dtype=torch.float64), xk.T)
    want = w.shape[0] * float(torch.trace(hat))
    assert ridge_degrees_of_freedom(xk.T @ xk, lam, w.shape[0]) == pytest.approx(want, rel=1e-8)


@SETTINGS
@given(problems())
def test_ridge_degrees_of_freedom_at_lambda_zero_is_d_out_times_the_rank(problem):
    w, x, _, kept, _, _ = problem
    xk = x[:, kept]
    assert ridge_degrees_of_freedom(xk.T @ xk, 0.0, w.shape[0]) == w.shape[0] * torch.linalg.matrix_rank(xk)


@pytest.mark.parametrize("d_out", [1, 2, 5, 9])
def test_rotation_degrees_of_freedom_is_the_dimension_of_skew_symmetric_matrices(d_out):
    """O(d) has the dimension of its Lie algebra, the skew-symmetric d × d matrices: one free entry per i < j."""
    skew = torch.stack([(torch.eye(d_out)[i][:, None] * torch.eye(d_out)[j] - torch.eye(d_out)[j][:, None]
                         * torch.eye(d_out)[i]).flatten() for i in range(d_out) for j in range(d_out)])
    rank = int(torch.linalg.matrix_rank(skew)) if d_out > 1 else 0
    assert rotation_degrees_of_freedom(d_out) == rank
    assert rotation_degrees_of_freedom(d_out, scaled=True) == rank + 1


@SETTINGS
@given(problems())
def test_calibration_errors_order_least_squares_scaled_rotation_rotation_none(problem):
    """In sample, each compensator's feasible set contains the next one's (LS ⊃ sQ ⊃ Q ⊃ I)."""
    w, x, held, kept, _, _ = problem
    n = x.shape[0]
    x = torch.cat([x, torch.randn(len(kept) + 1, x.shape[1], dtype=torch.float64)])[: max(n, len(kept) + 1)]
    cal, pruned = stats_of(x), torch.tensor([j for j in range(w.shape[1]) if j not in kept.tolist()])
    errors = {}
    for name, fn, params in (("ridge", compensators.ridge, {"lam": 0.0}), ("none", compensators.none, {}),
                             ("procrustes", compensators.procrustes, {}),
                             ("scaled-procrustes", compensators.scaled_procrustes, {})):
        if name == "scaled-procrustes" and not float(((w[:, kept] @ x[:, kept].T) ** 2).sum()) > 0:
            continue
        result = fn(w, cal, kept, pruned, **params)
        errors[name] = module_generalisation(w, cal, stats_of(held), kept, result,
                                             default_registry().compensator(name).dof)
        assert errors[name]["calibration_error"] == pytest.approx(explicit_error(w, x, kept, result.weight), rel=1e-7,
                                                                  abs=1e-10)
        assert errors[name]["holdout_error"] == pytest.approx(explicit_error(w, held, kept, result.weight), rel=1e-7,
                                                              abs=1e-10)
    order = [errors[name]["calibration_error"] for name in ("ridge", "scaled-procrustes", "procrustes", "none")
             if name in errors]
    assert all(a <= b + 1e-9 for a, b in zip(order, order[1:], strict=False))
    assert errors["none"]["degrees_of_freedom"] == 0
    assert errors["procrustes"]["degrees_of_freedom"] == w.shape[0] * (w.shape[0] - 1) // 2


def test_each_compensator_declares_its_degrees_of_freedom_and_an_undeclared_one_records_none():
    w, kept = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 2])
    stats = stats_of(torch.randn(10, 4, dtype=torch.float64))
    result = compensators.none(w, stats, kept, torch.tensor([1, 3]))
    assert module_generalisation(w, stats, stats, kept, result, None)["degrees_of_freedom"] is None
    registry = default_registry()
    declared = {name: registry.compensator(name).dof(w, stats, kept, result)
                for name in ("none", "flap-bias", "slimllm", "procrustes", "scaled-procrustes")}
    assert declared == {"none": 0, "flap-bias": 3, "slimllm": 6, "procrustes": 3, "scaled-procrustes": 4}
    # A rank-r update of a d_out × k matrix: rank-r matrices form a manifold of dimension r(d_out + k − r); brute
    # force: the rank of the Jacobian of (A, B) ↦ A Bᵀ at a random point.
    d_out, k, r = 3, 2, 1
    a, b = torch.randn(d_out, r, dtype=torch.float64), torch.randn(k, r, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(lambda a, b: (a @ b.T).flatten(), (a, b))
    dimension = torch.linalg.matrix_rank(torch.cat([j.reshape(d_out * k, -1) for j in jacobian], dim=1))
    olica_like = compensators.Compensation(w[:, kept], None, {"rank": r})
    assert low_rank_dof(w, stats, kept, olica_like) == dimension


def test_zero_output_is_refused_with_a_clear_error():
    stats = stats_of(torch.randn(5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="‖Y‖_F² = 0"):
        relative_error(torch.zeros(2, 3, dtype=torch.float64), stats, torch.tensor([0]), torch.zeros(2, 1))


def test_negative_lambda_is_refused():
    with pytest.raises(ValueError, match="lam=-1"):
        ridge_degrees_of_freedom(torch.eye(2, dtype=torch.float64), -1.0, 3)


def test_summary_means_and_total_over_every_module():
    module = lambda c, h, d: {"generalisation": {"calibration_error": c, "holdout_error": h,  # noqa: E731
                                                 "degrees_of_freedom": d}}
    layers = [{"layer": 0, "attention": module(0.1, 0.2, 10), "mlp": module(0.3, 0.5, 20.5)},
              {"layer": 1, "attention": module(0.2, 0.4, 10), "mlp": module(0.4, 0.9, None)}]
    got = summary(layers, 16)
    assert got["holdout_windows"] == 16
    assert [(row["layer"], row["module"]) for row in got["layers"]] == [(0, "attention"), (0, "mlp"), (1, "attention"),
                                                                        (1, "mlp")]
    assert set(got["layers"][0]) == {"layer", "module", "calibration_error", "holdout_error", "degrees_of_freedom"}
    assert got["calibration_error_mean"] == pytest.approx(1.0 / 4)
    assert got["holdout_error_mean"] == pytest.approx(2.0 / 4)
    assert got["degrees_of_freedom_total"] is None
    layers[1]["mlp"]["generalisation"]["degrees_of_freedom"] = 1
    assert math.isclose(summary(layers, 16)["degrees_of_freedom_total"], 41.5)


def test_summary_without_diagnostics_is_an_error():
    with pytest.raises(ValueError, match="holdout > 0"):
        summary([{"layer": 0, "attention": {}, "mlp": {}}], 4)
