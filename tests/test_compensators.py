"""Compensators against direct float64 computations on materialised X (d_in × N), Y = W X and Z = W_K X_K.

The code under test only sees the streamed statistics (G = X Xᵀ, Σx); every reference value here is
computed from the matrices themselves: SVD of Y Zᵀ, least squares on X_K, residual norms of Y − W̃ X_K.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcpu_bench.compensation import compensators as C
from rcpu_bench.statistics import activations
from rcpu_bench.statistics.activations import ActivationStats

F64 = torch.float64


# --- the paper's matrices ---------------------------------------------------------------------------

def make_W_X(d_out: int, d_in: int, n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W (d_out × d_in) and calibration inputs X (d_in × N) with per-channel scales and non-zero means."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=F64)
    scales = torch.rand(d_in, 1, generator=g, dtype=F64) * 1.5 + 0.5
    means = torch.rand(d_in, 1, generator=g, dtype=F64) - 0.5
    X = torch.randn(d_in, n_tokens, generator=g, dtype=F64) * scales + means
    return W, X


def split(d_in: int, n_drop: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random kept set K and dropped set D (sorted), |D| = n_drop."""
    perm = torch.randperm(d_in, generator=torch.Generator().manual_seed(seed + 1))
    return perm[n_drop:].sort().values, perm[:n_drop].sort().values


def stats_of(X: torch.Tensor, with_gram: bool = True) -> ActivationStats:
    return ActivationStats.from_activations(X.T, with_gram=with_gram)


def Y_of(W, X):
    return W @ X


def Z_of(W, X, K):
    return W[:, K] @ X[K]


def error(Y, W_new, X_K, b=None) -> float:
    """‖Y − W̃_K X_K − b 1ᵀ‖_F² from the materialised matrices."""
    R = Y - W_new @ X_K
    if b is not None:
        R = R - b[:, None]
    return float((R * R).sum())


def procrustes_Q(Y, Z) -> torch.Tensor:
    """Q* = U Vᵀ from a numpy SVD of M = Y Zᵀ."""
    u, _, vt = np.linalg.svd((Y @ Z.T).numpy())
    return torch.from_numpy(u @ vt)


def ridge_direct(Y, X_K, W_K, lam: float) -> torch.Tensor:
    """argmin ‖Y − W* X_K‖² + λ‖W* − W_K‖² as one least-squares problem [Y, √λ W_K] ≈ W* [X_K, √λ I]."""
    k = X_K.shape[0]
    A = torch.cat([X_K, lam**0.5 * torch.eye(k, dtype=F64)], dim=1)
    B = torch.cat([Y, lam**0.5 * W_K], dim=1)
    return torch.linalg.lstsq(A.T, B.T, driver="gelsd").solution.T


def assert_rel_close(actual, expected, tol):
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    scale = max(float(expected.norm()), 1e-300)
    assert float((actual - expected).norm()) <= tol * scale, float((actual - expected).norm()) / scale


def random_orthogonal(d: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=F64))
    return q * torch.sign(torch.diagonal(r))


# d_out < d_in, d_out > d_in, square, d_out < k, d_out > k; (d_out, d_in, N, |D|)
SHAPES = [(6, 10, 60, 3), (12, 8, 60, 2), (8, 8, 50, 4), (5, 12, 40, 6), (10, 6, 40, 3), (1, 5, 20, 2)]


@pytest.fixture(params=SHAPES, ids=lambda s: "dout{}-din{}-N{}-drop{}".format(*s))
def case(request):
    d_out, d_in, n_tokens, n_drop = request.param
    W, X = make_W_X(d_out, d_in, n_tokens, seed=sum(request.param))
    K, D = split(d_in, n_drop, seed=d_in)
    return W, X, K, D


problems = st.tuples(st.integers(1, 9), st.integers(2, 9), st.integers(0, 10_000), st.data())


def draw_problem(dims):
    d_out, d_in, seed, data = dims
    n_drop = data.draw(st.integers(0, d_in - 1))
    W, X = make_W_X(d_out, d_in, 3 * max(d_in, d_out) + 5, seed)
    K, D = split(d_in, n_drop, seed)
    return W, X, K, D


# --- none and FLAP bias -----------------------------------------------------------------------------

def test_none_keeps_W_K(case):
    W, X, K, D = case
    out = C.none(W, stats_of(X), K, D)
    assert torch.equal(out.weight, W[:, K]) and out.bias is None


def test_flap_bias_is_dropped_columns_at_mean_input(case):
    W, X, K, D = case
    out = C.flap_bias(W, stats_of(X), K, D)
    torch.testing.assert_close(out.weight, W[:, K])
    expected = W[:, D] @ X[D].mean(dim=1) if len(D) else torch.zeros(W.shape[0], dtype=F64)
    torch.testing.assert_close(out.bias, expected, rtol=1e-10, atol=1e-12)


def test_flap_bias_makes_mean_error_over_tokens_zero(case):
    W, X, K, D = case
    out = C.flap_bias(W, stats_of(X), K, D)
    residual = Y_of(W, X) - out.weight @ X[K] - out.bias[:, None]
    assert float(residual.mean(dim=1).abs().max()) <= 1e-10 * float(Y_of(W, X).abs().max())


def test_flap_bias_error_not_above_no_compensation(case):
    W, X, K, D = case
    Y, out = Y_of(W, X), C.flap_bias(W, stats_of(X), K, D)
    assert error(Y, out.weight, X[K], out.bias) <= error(Y, W[:, K], X[K]) * (1 + 1e-12)


def test_none_and_flap_bias_work_without_gram(case):
    W, X, K, D = case
    stats = stats_of(X, with_gram=False)
    assert torch.equal(C.none(W, stats, K, D).weight, W[:, K])
    out = C.flap_bias(W, stats, K, D)
    torch.testing.assert_close(out.bias, W[:, D] @ X[D].mean(dim=1), rtol=1e-10, atol=1e-12)
    assert "objective_after" not in out.info


# --- ridge ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lam", [0.0, 1e-4, 1.0, 1e3])
def test_ridge_matches_direct_least_squares(case, lam):
    W, X, K, D = case
    out = C.ridge(W, stats_of(X), K, D, lam=lam)
    assert_rel_close(out.weight, ridge_direct(Y_of(W, X), X[K], W[:, K], lam), 1e-8)
    assert out.info["lambda"] == lam


def test_ridge_lam_zero_matches_lstsq_on_X_K(case):
    W, X, K, D = case
    direct = torch.linalg.lstsq(X[K].T, Y_of(W, X).T).solution.T
    assert_rel_close(C.ridge(W, stats_of(X), K, D, lam=0.0).weight, direct, 1e-8)


@settings(max_examples=25, deadline=None)
@given(problems, st.sampled_from([0.0, 1e-6, 1e-2, 10.0]))
def test_ridge_matches_direct_least_squares_property(dims, lam):
    W, X, K, D = draw_problem(dims)
    out = C.ridge(W, stats_of(X), K, D, lam=lam)
    assert_rel_close(out.weight, ridge_direct(Y_of(W, X), X[K], W[:, K], lam), 1e-7)


def test_ridge_default_lambda_is_1e_4(case):
    W, X, K, D = case
    assert C.ridge(W, stats_of(X), K, D).info["lambda"] == 1e-4


def test_ridge_grid_equals_separate_ridge_solves(case):
    W, X, K, D = case
    stats = stats_of(X)
    grid = C.ridge_grid(W, stats, K, D)
    assert [r.info["lambda"] for r in grid] == list(C.LAMBDA_GRID)
    for result in grid:
        single = C.ridge(W, stats, K, D, lam=result.info["lambda"])
        assert_rel_close(result.weight, single.weight, 1e-8)


def test_lambda_grid_is_the_papers_13_decades():
    np.testing.assert_allclose(C.LAMBDA_GRID, [10.0**e for e in range(-6, 7)], rtol=1e-15)


def test_ridge_grid_custom_lams_match_direct(case):
    W, X, K, D = case
    lams = [0.0, 0.5, 50.0]
    for lam, result in zip(lams, C.ridge_grid(W, stats_of(X), K, D, lams=lams)):
        assert_rel_close(result.weight, ridge_direct(Y_of(W, X), X[K], W[:, K], lam), 1e-8)


def test_ridge_with_lam_handles_rank_deficient_gram():
    """Fewer tokens than kept columns: G_KK is singular, but G_KK + λI is not."""
    W, X = make_W_X(4, 8, 3, seed=11)
    K, D = split(8, 2, seed=11)
    out = C.ridge(W, stats_of(X), K, D, lam=1.0)
    assert_rel_close(out.weight, ridge_direct(Y_of(W, X), X[K], W[:, K], 1.0), 1e-8)


# --- Procrustes -------------------------------------------------------------------------------------

def test_procrustes_is_svd_of_Y_Zt(case):
    W, X, K, D = case
    Y, Z = Y_of(W, X), Z_of(W, X, K)
    out = C.procrustes(W, stats_of(X), K, D)
    assert_rel_close(out.weight, procrustes_Q(Y, Z) @ W[:, K], 1e-8)


@settings(max_examples=25, deadline=None)
@given(problems)
def test_procrustes_is_svd_of_Y_Zt_property(dims):
    W, X, K, D = draw_problem(dims)
    out = C.procrustes(W, stats_of(X), K, D)
    assert_rel_close(out.weight, procrustes_Q(Y_of(W, X), Z_of(W, X, K)) @ W[:, K], 1e-6)


def test_procrustes_update_is_orthogonal(case):
    """W̃_K = Q W_K with QᵀQ = I preserves all inner products of W_K's columns; the info agrees."""
    W, X, K, D = case
    out = C.procrustes(W, stats_of(X), K, D)
    assert_rel_close(out.weight.T @ out.weight, W[:, K].T @ W[:, K], 1e-10)
    assert out.info["orthogonality_error"] < 1e-10
    # A square Q has a determinant; Q restricted to span(W_K) (k < d_out) has none to report.
    assert out.info["span"] == ("kept columns" if len(K) < W.shape[0] else "outputs")
    assert out.info.get("det_sign") in ((-1.0, 1.0) if out.info["span"] == "outputs" else (None,))


@settings(max_examples=20, deadline=None)
@given(problems, st.integers(0, 1000))
def test_procrustes_beats_any_other_orthogonal_update(dims, q_seed):
    W, X, K, D = draw_problem(dims)
    Y = Y_of(W, X)
    best = error(Y, C.procrustes(W, stats_of(X), K, D).weight, X[K])
    R = random_orthogonal(W.shape[0], q_seed)
    for other in (R, -R, torch.eye(W.shape[0], dtype=F64)):
        assert best <= error(Y, other @ W[:, K], X[K]) + 1e-10 * error(Y, 0 * W[:, K], X[K])


def test_procrustes_at_ratio_zero_is_identity(case):
    W, X, _, _ = case
    everything, nothing = torch.arange(W.shape[1]), torch.empty(0, dtype=torch.long)
    out = C.procrustes(W, stats_of(X), everything, nothing)
    assert_rel_close(out.weight, W, 1e-10)
    if W.shape[0] <= W.shape[1]:  # W has full row rank, so Q = W̃ W⁺ is recoverable
        Q = out.weight @ torch.linalg.pinv(W)
        assert_rel_close(Q, torch.eye(W.shape[0], dtype=F64), 1e-9)


# --- scaled Procrustes ------------------------------------------------------------------------------

def test_scaled_procrustes_scale_is_trace_sigma_over_Z_norm(case):
    W, X, K, D = case
    Y, Z = Y_of(W, X), Z_of(W, X, K)
    out = C.scaled_procrustes(W, stats_of(X), K, D)
    s = np.linalg.svd((Y @ Z.T).numpy(), compute_uv=False).sum() / float((Z * Z).sum())
    assert out.info["scale"] == pytest.approx(s, rel=1e-10)
    assert_rel_close(out.weight, s * procrustes_Q(Y, Z) @ W[:, K], 1e-8)
    assert out.info["orthogonality_error"] < 1e-10


@settings(max_examples=20, deadline=None)
@given(problems)
def test_scaled_procrustes_scale_is_optimal(dims):
    W, X, K, D = draw_problem(dims)
    Y = Y_of(W, X)
    out = C.scaled_procrustes(W, stats_of(X), K, D)
    best = error(Y, out.weight, X[K])
    for factor in (0.9, 1.1):
        assert best <= error(Y, factor * out.weight, X[K]) * (1 + 1e-12)


def test_scaled_procrustes_at_ratio_zero_is_identity(case):
    W, X, _, _ = case
    out = C.scaled_procrustes(W, stats_of(X), torch.arange(W.shape[1]), torch.empty(0, dtype=torch.long))
    assert out.info["scale"] == pytest.approx(1.0, rel=1e-10)
    assert_rel_close(out.weight, W, 1e-10)


def test_scaled_procrustes_rejects_zero_Z():
    W, X = make_W_X(4, 6, 20, seed=3)
    K, D = split(6, 2, seed=3)
    W[:, K] = 0.0
    with pytest.raises(ValueError, match="‖Z‖"):
        C.scaled_procrustes(W, stats_of(X), K, D)


# --- invariants across compensators -----------------------------------------------------------------

@pytest.mark.parametrize("lam", [0.0, 1e-4, 1.0])
def test_ridge_at_ratio_zero_returns_W(case, lam):
    W, X, _, _ = case
    out = C.ridge(W, stats_of(X), torch.arange(W.shape[1]), torch.empty(0, dtype=torch.long), lam=lam)
    assert_rel_close(out.weight, W, 1e-9)


def test_flap_bias_at_ratio_zero_is_zero(case):
    W, X, _, _ = case
    out = C.flap_bias(W, stats_of(X), torch.arange(W.shape[1]), torch.empty(0, dtype=torch.long))
    assert torch.equal(out.bias, torch.zeros(W.shape[0], dtype=F64))


def calibration_errors(W, X, K, D) -> dict[str, float]:
    """Each compensator's error computed directly from the materialised X and Y."""
    stats, Y = stats_of(X), Y_of(W, X)
    fns = {"none": C.none, "procrustes": C.procrustes, "scaled": C.scaled_procrustes,
           "ridge0": lambda *a: C.ridge(*a, lam=0.0)}
    return {name: error(Y, fn(W, stats, K, D).weight, X[K]) for name, fn in fns.items()}


def test_error_ordering_none_procrustes_scaled_ridge(case):
    W, X, K, D = case
    e = calibration_errors(W, X, K, D)
    slack = 1e-10 * error(Y_of(W, X), 0 * W[:, K], X[K])
    assert e["none"] + slack >= e["procrustes"]
    assert e["procrustes"] + slack >= e["scaled"]
    assert e["scaled"] + slack >= e["ridge0"]


@settings(max_examples=25, deadline=None)
@given(problems)
def test_error_ordering_property(dims):
    W, X, K, D = draw_problem(dims)
    e = calibration_errors(W, X, K, D)
    slack = 1e-9 * error(Y_of(W, X), 0 * W[:, K], X[K])
    assert e["none"] + slack >= e["procrustes"] and e["procrustes"] + slack >= e["scaled"]
    assert e["scaled"] + slack >= e["ridge0"]


def test_pruning_really_loses_something_and_compensation_recovers_some(case):
    W, X, K, D = case
    e = calibration_errors(W, X, K, D)
    assert e["none"] > 0
    assert e["ridge0"] < e["none"]


COMPENSATORS = {
    "none": C.none,
    "flap_bias": C.flap_bias,
    "ridge": lambda *a: C.ridge(*a, lam=1e-2),
    "procrustes": C.procrustes,
    "scaled_procrustes": C.scaled_procrustes,
}


@pytest.fixture(params=[None, 2], ids=["block-default", "block-2"])
def gram_block(request):
    """The block size of the upper-block-triangle Grams (G, W_DᵀW_D, T Tᵀ in ridge, MᵀM in the rotation); 2 gives
    these small problems several blocks, so that a triangle left unmirrored changes the result."""
    if request.param is None:
        yield
    else:
        with mock.patch.object(activations, "GRAM_BLOCK", request.param):
            yield


@pytest.mark.parametrize("name", list(COMPENSATORS))
def test_objective_info_equals_direct_errors(case, name, gram_block):
    W, X, K, D = case
    Y = Y_of(W, X)
    out = COMPENSATORS[name](W, stats_of(X), K, D)
    scale = error(Y, 0 * W[:, K], X[K])
    assert out.info["objective_before"] == pytest.approx(error(Y, W[:, K], X[K]), rel=1e-9, abs=1e-10 * scale)
    assert out.info["objective_after"] == pytest.approx(error(Y, out.weight, X[K], out.bias), rel=1e-9,
                                                         abs=1e-10 * scale)


def test_ridge_grid_objective_info_equals_direct_errors(case, gram_block):
    W, X, K, D = case
    Y = Y_of(W, X)
    scale = error(Y, 0 * W[:, K], X[K])
    for result in C.ridge_grid(W, stats_of(X), K, D, lams=[1e-6, 1.0, 1e6]):
        assert result.info["objective_after"] == pytest.approx(error(Y, result.weight, X[K]), rel=1e-9,
                                                                abs=1e-10 * scale)


def test_calibration_error_equals_direct_error(case):
    W, X, K, D = case
    g = torch.Generator().manual_seed(5)
    W_new = torch.randn(W.shape[0], len(K), generator=g, dtype=F64)
    b = torch.randn(W.shape[0], generator=g, dtype=F64)
    Y = Y_of(W, X)
    assert C.calibration_error(W, stats_of(X), K, W_new) == pytest.approx(error(Y, W_new, X[K]), rel=1e-9)
    assert C.calibration_error(W, stats_of(X), K, W_new, b) == pytest.approx(error(Y, W_new, X[K], b), rel=1e-9)


# --- float32 compute dtype --------------------------------------------------------------------------

@pytest.mark.parametrize("name,fn", [
    ("ridge", lambda *a, **k: C.ridge(*a, lam=1e-3, **k)),
    ("procrustes", C.procrustes),
    ("scaled_procrustes", C.scaled_procrustes),
    ("ridge_grid", lambda *a, **k: C.ridge_grid(*a, lams=[1e-3, 1.0], **k)[0]),
])
def test_float32_compute_is_close_to_float64(case, name, fn):
    W, X, K, D = case
    stats = stats_of(X)
    out32, out64 = fn(W, stats, K, D, dtype="float32"), fn(W, stats, K, D, dtype="float64")
    assert out32.weight.dtype == F64  # cast back to the module's dtype
    assert_rel_close(out32.weight, out64.weight, 1e-3)


@pytest.mark.parametrize("fn", [C.none, C.flap_bias, C.ridge, C.procrustes, C.scaled_procrustes])
def test_result_has_module_dtype(case, fn):
    W, X, K, D = case
    out = fn(W.to(torch.float32), stats_of(X), K, D)
    assert out.weight.dtype == torch.float32 and out.weight.shape == (W.shape[0], len(K))
    assert out.bias is None or out.bias.dtype == torch.float32


# --- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [C.ridge, C.ridge_grid, C.procrustes, C.scaled_procrustes])
def test_bad_dtype_is_rejected_naming_it(fn):
    W, X = make_W_X(3, 5, 20, seed=1)
    K, D = split(5, 1, seed=1)
    with pytest.raises(ValueError, match="'float16'.*allowed"):
        fn(W, stats_of(X), K, D, dtype="float16")


@pytest.mark.parametrize("lam,shown", [(-1.0, "-1.0"), (-1e-9, "-1e-09"), (float("nan"), "nan")])
def test_bad_lam_is_rejected_naming_it(lam, shown):
    W, X = make_W_X(3, 5, 20, seed=2)
    K, D = split(5, 1, seed=2)
    with pytest.raises(ValueError, match=f"lam={shown}"):
        C.ridge(W, stats_of(X), K, D, lam=lam)


@pytest.mark.parametrize("lams,shown", [([1.0, -1.0], "-1.0"), ([], r"\[\]"), ([float("nan")], "nan")])
def test_bad_lams_are_rejected_naming_them(lams, shown):
    W, X = make_W_X(3, 5, 20, seed=2)
    K, D = split(5, 1, seed=2)
    with pytest.raises(ValueError, match=shown):
        C.ridge_grid(W, stats_of(X), K, D, lams=lams)


# Fewer calibration tokens N than kept columns k: X_K X_Kᵀ is singular, lam=0 has no unique solution.
RANK_DEFICIENT = [(4, 8, 2, 3, seed) for seed in range(3)] + [(4, 8, 2, 5, seed) for seed in range(3)]


@pytest.mark.parametrize("d_out,d_in,n_drop,n_tokens,seed", RANK_DEFICIENT)
def test_ridge_lam_zero_on_rank_deficient_gram_raises(d_out, d_in, n_drop, n_tokens, seed):
    W, X = make_W_X(d_out, d_in, n_tokens, seed)
    K, D = split(d_in, n_drop, seed)
    assert int(torch.linalg.matrix_rank(X[K])) < len(K)
    with pytest.raises(ValueError, match="lam=0"):
        C.ridge(W, stats_of(X), K, D, lam=0.0)


@pytest.mark.parametrize("d_out,d_in,n_drop,n_tokens,seed", RANK_DEFICIENT)
def test_ridge_grid_lam_zero_on_rank_deficient_gram_raises(d_out, d_in, n_drop, n_tokens, seed):
    W, X = make_W_X(d_out, d_in, n_tokens, seed)
    K, D = split(d_in, n_drop, seed)
    with pytest.raises(ValueError, match="lam=0"):
        C.ridge_grid(W, stats_of(X), K, D, lams=[0.0])


def test_ridge_lam_zero_with_duplicated_kept_channel_raises():
    """Two identical input channels in K: G_KK is exactly singular in exact arithmetic."""
    W, X = make_W_X(4, 6, 30, seed=7)
    X[3] = X[2]
    K, D = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([5])
    with pytest.raises(ValueError, match="lam=0"):
        C.ridge(W, stats_of(X), K, D, lam=0.0)


@pytest.mark.parametrize("fn", [C.ridge, C.ridge_grid, C.procrustes, C.scaled_procrustes])
def test_gram_needing_compensators_reject_stats_without_gram(fn):
    W, X = make_W_X(3, 5, 20, seed=4)
    K, D = split(5, 2, seed=4)
    with pytest.raises(ValueError, match="Gram"):
        fn(W, stats_of(X, with_gram=False), K, D)


@pytest.mark.parametrize("fn", [C.none, C.flap_bias, C.ridge, C.procrustes, C.scaled_procrustes])
def test_width_mismatch_is_rejected(fn):
    W, _ = make_W_X(3, 5, 20, seed=5)
    _, X = make_W_X(3, 6, 20, seed=5)
    with pytest.raises(ValueError, match="d_in=6"):
        fn(W, stats_of(X), torch.tensor([0, 1, 2]), torch.tensor([3, 4]))


def test_float32_ridge_rounds_the_correction_not_the_weight():
    """W* = W_K + Δ with Δ solved in float32: the float32 error scales with ‖Δ‖, not ‖W‖ (dropped inputs
    1e-5 of the kept ones, so ‖Δ‖ < 1e-4‖W_K‖; κ(G_KK) ≈ 1e2)."""
    g = torch.Generator().manual_seed(7)
    n_tokens, d_in, d_out, n_drop = 4000, 40, 24, 8
    X = torch.randn(d_in, n_tokens, generator=g, dtype=F64) * torch.logspace(0, -1, d_in, dtype=F64)[:, None]
    X[:n_drop] *= 1e-5
    W = torch.randn(d_out, d_in, generator=g, dtype=F64)
    D, K = torch.arange(n_drop), torch.arange(n_drop, d_in)
    Y, XK = W @ X, X[K]
    exact = torch.linalg.solve(XK @ XK.T + 1e-3 * torch.eye(len(K), dtype=F64), (Y @ XK.T + 1e-3 * W[:, K]).T).T
    delta = exact - W[:, K]
    assert float(delta.norm()) < 1e-4 * float(W[:, K].norm())
    out32 = C.ridge(W, stats_of(X), K, D, lam=1e-3, dtype="float32")
    assert float((out32.weight - exact).norm()) <= 1e-4 * float(delta.norm())
