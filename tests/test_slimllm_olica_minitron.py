"""SlimLLM's and Olica's compensators against float64 brute force on raw activations, Minitron's scorer against a
direct computation from raw activations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcpu_bench.plugins import default_registry
from rcpu_bench.selection.scorers import unit_scores
from rcpu_bench.statistics.activations import ActivationStats


def problem(seed: int, n: int = 40, d_in: int = 8, d_out: int = 5, n_kept: int = 5, offset: float = 0.7):
    """Raw activations X (n × d_in, correlated, off-centre), W (d_out × d_in) and a random kept set, float64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d_in)) @ rng.standard_normal((d_in, d_in)) + offset * rng.standard_normal(d_in)
    w = rng.standard_normal((d_out, d_in))
    kept = np.sort(rng.choice(d_in, n_kept, replace=False))
    pruned = np.setdiff1d(np.arange(d_in), kept)
    return x, w, kept, pruned


def compensate(name: str, x, w, kept, pruned, **params):
    """The registered compensator on float64 statistics of x (through the registry, so its contract is checked)."""
    stats = ActivationStats.from_activations(torch.from_numpy(x), gram_precision="float64")
    return default_registry().compensator(name)(torch.from_numpy(w), stats, torch.from_numpy(kept),
                                                torch.from_numpy(pruned), **params)


# --- SlimLLM -----------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_kept=st.integers(1, 7))
def test_slimllm_is_the_per_row_affine_fit_of_the_dense_output_on_the_pruned_one(seed, n_kept):
    x, w, kept, pruned = problem(seed, n_kept=n_kept)
    dense, kept_out = x @ w.T, x[:, kept] @ w[:, kept].T  # Y and Ŷ, n × d_out
    fits = [np.polyfit(kept_out[:, i], dense[:, i], 1) for i in range(w.shape[0])]  # (a_i, b_i), as SlimLLM's code
    scale, bias = np.array([f[0] for f in fits]), np.array([f[1] for f in fits])
    result = compensate("slimllm", x, w, kept, pruned)
    np.testing.assert_allclose(result.weight.numpy(), scale[:, None] * w[:, kept], rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(result.bias.numpy(), bias, rtol=1e-8, atol=1e-9)
    before = ((dense - kept_out) ** 2).sum()
    after = ((dense - kept_out * scale - bias) ** 2).sum()
    assert result.info["objective_before"] == pytest.approx(before, rel=1e-9)
    assert result.info["objective_after"] == pytest.approx(after, rel=1e-7, abs=1e-9) and after <= before * (1 + 1e-12)


def test_slimllm_keeps_the_scale_of_a_row_whose_pruned_output_is_constant():
    x, w, kept, pruned = problem(3)
    w[1, kept] = 0.0  # row 1 of the pruned output is 0 on every token
    result = compensate("slimllm", x, w, kept, pruned)
    assert result.weight[1].abs().max() == 0
    assert float(result.bias[1]) == pytest.approx(float((x @ w.T)[:, 1].mean()), rel=1e-12)


# --- Olica -------------------------------------------------------------------------------------------------------

def reduced_rank_ridge(x, w, kept, pruned, rank: int, lam: float) -> np.ndarray:
    """Δ_r (d_out × |K|) by the textbook reduced-rank regression on the ridge-augmented raw problem
    [X_K; √λ I] B ≈ [E; 0], E = X_D W_Dᵀ: B_r = B V_r V_rᵀ, V_r the top-r right singular vectors of the fit."""
    design = np.vstack([x[:, kept], math.sqrt(lam) * np.eye(len(kept))])
    target = np.vstack([x[:, pruned] @ w[:, pruned].T, np.zeros((len(kept), w.shape[0]))])
    solution = np.linalg.lstsq(design, target, rcond=None)[0]  # |K| × d_out
    top = np.linalg.svd(design @ solution, full_matrices=False)[2][:rank].T  # d_out × r
    return (solution @ top @ top.T).T


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rank=st.sampled_from([0.2, 0.5, 1.0]), lam_rel=st.sampled_from([0.01, 0.5]))
def test_olica_is_the_rank_r_ridge_least_squares_of_the_pruned_error(seed, rank, lam_rel):
    x, w, kept, pruned = problem(seed, d_out=6)
    r = math.ceil(rank * min(w.shape[0], len(kept)))
    lam = lam_rel * float((x[:, kept] ** 2).sum(0).mean())
    result = compensate("olica", x, w, kept, pruned, rank=rank, lam_rel=lam_rel)
    expected = w[:, kept] + reduced_rank_ridge(x, w, kept, pruned, r, lam)
    np.testing.assert_allclose(result.weight.numpy(), expected, rtol=1e-7, atol=1e-8)
    assert result.info["rank"] == r and result.info["lambda"] == pytest.approx(lam, rel=1e-12)
    error = ((x @ w.T - x[:, kept] @ expected.T) ** 2).sum()
    assert result.info["objective_after"] == pytest.approx(error, rel=1e-7)
    assert error <= result.info["objective_before"]  # any rank lowers the error: Δ = 0 is a candidate


def test_olica_at_full_rank_is_ridge_at_the_same_damping():
    x, w, kept, pruned = problem(5)
    olica = compensate("olica", x, w, kept, pruned, rank=1.0, lam_rel=0.3)
    ridge = compensate("ridge", x, w, kept, pruned, lam=0.0, lam_rel=0.3)
    torch.testing.assert_close(olica.weight, ridge.weight, rtol=1e-10, atol=1e-12)


def test_olica_refuses_a_rank_outside_zero_one():
    x, w, kept, pruned = problem(1)
    with pytest.raises(ValueError, match=r"olica rank=0: .*allowed: a number in \(0, 1\]"):
        compensate("olica", x, w, kept, pruned, rank=0)


# --- Minitron ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("aggregation", ["mean-abs", "l2"])
def test_minitron_scores_are_squared_activation_magnitudes_and_rank_heads_by_their_l2(aggregation):
    rng = np.random.default_rng(0)
    head_dim, heads = 4, 6
    x = rng.standard_normal((3, 50, heads * head_dim)) * rng.uniform(0.1, 3.0, heads * head_dim)  # batch × seq × d
    flat = x.reshape(-1, heads * head_dim)
    magnitude = np.abs(flat).mean(0) if aggregation == "mean-abs" else np.sqrt((flat**2).sum(0))  # F_j
    stats = ActivationStats.from_activations(torch.from_numpy(x), with_gram=False)
    weight = torch.from_numpy(rng.standard_normal((5, heads * head_dim)))
    scores = default_registry().scorer("minitron")(weight, stats, aggregation=aggregation)
    np.testing.assert_allclose(scores.numpy(), magnitude**2, rtol=1e-12)
    head_norms = np.linalg.norm(magnitude.reshape(heads, head_dim), axis=1)  # Minitron's head score ‖F_head‖₂
    summed = unit_scores(scores, head_dim)  # what the pipeline ranks heads by (head_aggregation='sum')
    np.testing.assert_allclose(summed.numpy(), head_norms**2, rtol=1e-12)
    assert torch.argsort(summed).tolist() == np.argsort(head_norms).tolist()
