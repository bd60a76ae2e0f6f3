"""Column scorers and unit aggregation against direct float64 formulas on a materialised X (d_in × N)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcpu_bench.selection import scorers
from rcpu_bench.selection.select import select_by_score
from rcpu_bench.statistics.activations import ActivationStats

F64 = torch.float64


def make_W_X(d_out: int, d_in: int, n_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight W (d_out × d_in) and inputs X (d_in × N) with channel-dependent scale and mean."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d_out, d_in))
    X = rng.standard_normal((d_in, n_tokens)) * rng.uniform(0.1, 3.0, (d_in, 1)) + rng.uniform(-1, 1, (d_in, 1))
    return W, X


def stats_of(X: np.ndarray) -> ActivationStats:
    return ActivationStats.from_activations(torch.from_numpy(X.T.copy()), with_gram=False)


def score(fn, W: np.ndarray, X: np.ndarray, **params) -> np.ndarray:
    out = fn(torch.from_numpy(W), stats_of(X), **params)
    assert out.dtype == F64 and out.shape == (W.shape[1],)
    return out.numpy()


# Direct per-column quantities, written out from the definitions.
def col_l1(W):
    return np.abs(W).sum(axis=0)


def col_l2(W):
    return np.sqrt((W * W).sum(axis=0))


def act_l2(X):
    return np.sqrt((X * X).sum(axis=1))


def act_mean_abs(X):
    return np.abs(X).mean(axis=1)


def pop_var(X):
    return ((X - X.mean(axis=1, keepdims=True)) ** 2).mean(axis=1)


def sample_var(X):
    return ((X - X.mean(axis=1, keepdims=True)) ** 2).sum(axis=1) / (X.shape[1] - 1)


shapes = st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(2, 25), st.integers(0, 10_000))


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_magnitude_is_column_l2_norm(shape):
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    np.testing.assert_allclose(score(scorers.magnitude, W, X), col_l2(W), rtol=1e-12)


# variant -> (weight column norm, activation statistic):
# flap ‖W_j‖₁‖X_j‖₂, rcpu-code ‖W_j‖₁·mean|x_j|, paper ‖W_j‖₂‖X_j‖₂
WANDA_VARIANTS = {"flap": (col_l1, act_l2), "rcpu-code": (col_l1, act_mean_abs), "paper": (col_l2, act_l2)}


@pytest.mark.parametrize("variant", WANDA_VARIANTS)
@settings(max_examples=25, deadline=None)
@given(shape=shapes)
def test_wanda_sp_variants_are_weight_norm_times_activation_statistic(variant, shape):
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    weight_norm, activation = WANDA_VARIANTS[variant]
    np.testing.assert_allclose(score(scorers.wanda_sp, W, X, variant=variant), weight_norm(W) * activation(X),
                               rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_wanda_sp_flap_is_rank_equivalent_to_flap_mean_rows(shape):
    """FLAP's score mean_i |W_ij|·‖X_j‖₂ and the harness's ``flap`` variant give the same pruning choice."""
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    flap_direct = (np.abs(W) * act_l2(X)[None, :]).mean(axis=0)
    ours = score(scorers.wanda_sp, W, X, variant="flap")
    np.testing.assert_allclose(ours / d_out, flap_direct, rtol=1e-12)  # a positive constant apart
    for ratio in (0.25, 0.5):
        chosen = select_by_score(torch.from_numpy(ours), ratio)
        direct = select_by_score(torch.from_numpy(flap_direct), ratio)
        assert chosen.pruned.tolist() == direct.pruned.tolist()


def test_wanda_sp_default_variant_is_flap():
    W, X = make_W_X(3, 5, 10, seed=1)
    np.testing.assert_allclose(score(scorers.wanda_sp, W, X), col_l1(W) * act_l2(X), rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_variance_score_l2_activation_is_paper_gamma(shape):
    """γ_j = ‖W[:,j]‖₂ · ‖X[j,:]‖₂ · Var(X[j,:]) with the population variance."""
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    np.testing.assert_allclose(score(scorers.variance, W, X, activation="l2"), col_l2(W) * act_l2(X) * pop_var(X),
                               rtol=1e-9, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_variance_score_mean_abs_activation_is_rcpu_code_gamma(shape):
    """γ_j = ‖W[:,j]‖₂ · E|x_j| · Var(x_j) (the official code's activation statistic)."""
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    np.testing.assert_allclose(score(scorers.variance, W, X, activation="mean-abs"),
                               col_l2(W) * act_mean_abs(X) * pop_var(X), rtol=1e-9, atol=1e-14)


def test_variance_score_uses_centred_variance():
    """Shifting a channel's inputs by a constant changes ‖X_j‖ but not Var(X_j)."""
    W, X = make_W_X(4, 3, 30, seed=2)
    shifted = X.copy()
    shifted[1] += 5.0
    a = score(scorers.variance, W, X, activation="mean-abs")
    b = score(scorers.variance, W, shifted, activation="mean-abs")
    np.testing.assert_allclose(b[1] / a[1], act_mean_abs(shifted)[1] / act_mean_abs(X)[1], rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_flap_wifv_is_sample_variance_times_squared_column_norm(shape):
    d_out, d_in, n, seed = shape
    W, X = make_W_X(d_out, d_in, n, seed)
    np.testing.assert_allclose(score(scorers.flap_wifv, W, X), sample_var(X) * (W * W).sum(axis=0),
                               rtol=1e-9, atol=1e-14)


def test_scorers_accept_low_precision_weight():
    W, X = make_W_X(5, 4, 12, seed=3)
    W16 = torch.from_numpy(W).to(torch.bfloat16)
    out = scorers.magnitude(W16, stats_of(X))
    assert out.dtype == F64
    np.testing.assert_allclose(out.numpy(), col_l2(W16.to(F64).numpy()), rtol=1e-12)


@pytest.mark.parametrize("fn", [scorers.magnitude, scorers.wanda_sp, scorers.variance, scorers.flap_wifv])
def test_scorers_reject_width_mismatch(fn):
    W, X = make_W_X(3, 4, 10, seed=4)
    with pytest.raises(ValueError, match="d_in=5"):
        fn(torch.from_numpy(W), stats_of(np.ones((5, 10))))


def test_unknown_wanda_variant_is_rejected_with_allowed_list():
    W, X = make_W_X(3, 4, 10, seed=5)
    with pytest.raises(ValueError, match="'l1'.*allowed.*flap.*rcpu-code.*paper"):
        scorers.wanda_sp(torch.from_numpy(W), stats_of(X), variant="l1")


def test_unknown_activation_statistic_is_rejected_with_allowed_list():
    W, X = make_W_X(3, 4, 10, seed=6)
    with pytest.raises(ValueError, match="'rms'.*allowed.*l2.*mean-abs"):
        scorers.variance(torch.from_numpy(W), stats_of(X), activation="rms")


# --- unit aggregation -------------------------------------------------------------------------------

def unit_sums_direct(s: np.ndarray, unit_size: int) -> np.ndarray:
    return np.array([s[u * unit_size:(u + 1) * unit_size].sum() for u in range(len(s) // unit_size)])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000))
def test_unit_sum_adds_each_head_dim_block(n_heads, head_dim, seed):
    s = np.random.default_rng(seed).uniform(0, 5, n_heads * head_dim)
    out = scorers.unit_scores(torch.from_numpy(s), head_dim, how="sum")
    np.testing.assert_allclose(out.numpy(), unit_sums_direct(s, head_dim), rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(2, 8), st.integers(0, 10_000))
def test_unit_standardized_mean_matches_direct(n_heads, head_dim, seed):
    """FLAP AL-AM: standardize the layer's columns, (s − mean)/std (torch/FLAP std: N−1), then average per unit."""
    s = np.random.default_rng(seed).uniform(0, 5, n_heads * head_dim)
    z = (s - s.mean()) / s.std(ddof=1)
    direct = np.array([z[u * head_dim:(u + 1) * head_dim].mean() for u in range(n_heads)])
    out = scorers.unit_scores(torch.from_numpy(s), head_dim, how="standardized-mean")
    np.testing.assert_allclose(out.numpy(), direct, rtol=1e-10, atol=1e-12)


def test_standardize_constant_scores_gives_zeros_not_nan():
    out = scorers.standardize(torch.full((6,), 3.0, dtype=F64))
    assert torch.equal(out, torch.zeros(6, dtype=F64))


@pytest.mark.parametrize("n_q_heads,n_kv_heads,head_dim", [(8, 2, 4), (6, 3, 2), (4, 1, 3), (4, 4, 2)])
def test_gqa_group_units_are_contiguous_head_major_blocks(n_q_heads, n_kv_heads, head_dim):
    """A key/value group owns query heads g·q … g·q+q−1, i.e. columns [g·q·hd, (g+1)·q·hd) of o_proj."""
    q_per_group = n_q_heads // n_kv_heads
    s = np.random.default_rng(n_q_heads * 10 + n_kv_heads).uniform(0, 1, n_q_heads * head_dim)
    head_of_column = np.arange(len(s)) // head_dim
    group_of_head = np.arange(n_q_heads) // q_per_group
    direct = np.array([s[group_of_head[head_of_column] == g].sum() for g in range(n_kv_heads)])
    out = scorers.unit_scores(torch.from_numpy(s), head_dim * q_per_group, how="sum")
    np.testing.assert_allclose(out.numpy(), direct, rtol=1e-12)
    per_head = scorers.unit_scores(torch.from_numpy(s), head_dim, how="sum")
    np.testing.assert_allclose(scorers.unit_scores(per_head, q_per_group).numpy(), direct, rtol=1e-12)


@pytest.mark.parametrize("unit_size", [0, -2, 5])
def test_unit_size_must_divide_columns(unit_size):
    with pytest.raises(ValueError, match=f"unit_size={unit_size}"):
        scorers.unit_scores(torch.ones(12, dtype=F64), unit_size)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="'max'.*allowed"):
        scorers.unit_scores(torch.ones(12, dtype=F64), 3, how="max")
