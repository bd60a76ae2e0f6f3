"""OBS selection against brute-force least squares in float64 (ZipLM / SlimGPT's ε_S and greedy order)."""

from __future__ import annotations

import itertools

import pytest
import torch

from rcpu_bench.selection.obs import damped_inverse, greedy_order, obs, remove_columns, unit_errors
from rcpu_bench.selection.select import UnitMap
from rcpu_bench.statistics.activations import ActivationStats


def problem(seed: int, d_out: int = 5, d_in: int = 12, n: int = 40):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=generator, dtype=torch.float64)
    x = torch.randn(n, d_in, generator=generator, dtype=torch.float64) @ torch.randn(
        d_in, d_in, generator=generator, dtype=torch.float64)  # correlated columns, so the refit matters
    return w, x


def refit_error(w: torch.Tensor, x: torch.Tensor, removed: list[int], lam: float) -> float:
    """min over W' of ‖X Wᵀ − X_K W'ᵀ‖² + λ‖Wᵀ − E_K W'ᵀ‖², by lstsq on the data stacked with √λ I."""
    d_in = w.shape[1]
    kept = [j for j in range(d_in) if j not in removed]
    data = torch.cat([x, lam**0.5 * torch.eye(d_in, dtype=torch.float64)])  # H = dataᵀ data = G + λI
    target = data @ w.T
    solution = torch.linalg.lstsq(data[:, kept], target).solution
    return float((target - data[:, kept] @ solution).square().sum())


def columns(units: list[int], size: int) -> list[int]:
    return [u * size + c for u in units for c in range(size)]


def lam_of(x: torch.Tensor, percdamp: float) -> float:
    return percdamp * float((x.T @ x).diagonal().mean())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("size", [1, 3])
def test_eps_of_a_set_is_the_error_of_removing_it_and_refitting(seed, size):
    w, x = problem(seed)
    lam = lam_of(x, 0.01)
    hinv = damped_inverse(x.T @ x, 0.01)
    n_units = w.shape[1] // size
    for subset in itertools.islice(itertools.combinations(range(n_units), 2), 6):
        cols = torch.tensor(columns(list(subset), size))
        # ε_S of the set S taken as one block: tr(W_S [(H⁻¹)_SS]⁻¹ W_Sᵀ)
        eps = float(unit_errors(w[:, cols], hinv[cols[:, None], cols], torch.tensor([0]), len(cols)))
        assert eps == pytest.approx(refit_error(w, x, cols.tolist(), lam), rel=1e-9)


@pytest.mark.parametrize("size", [1, 2])
def test_sequential_removals_with_downdates_add_up_to_the_joint_refit_error(size):
    w, x = problem(7)
    lam = lam_of(x, 0.01)
    hinv, current, total = damped_inverse(x.T @ x, 0.01), w.clone(), 0.0
    removed: list[int] = []
    for unit in (3, 0, 5):
        total += float(unit_errors(current, hinv, torch.tensor([unit]), size))
        current, hinv = remove_columns(current, hinv, torch.tensor(columns([unit], size)))
        removed.append(unit)
        assert total == pytest.approx(refit_error(w, x, columns(removed, size), lam), rel=1e-9)


def naive_greedy(w, x, size: int, n_prune: int, batch: int, lam: float) -> list[int]:
    """Each step: the refit error of (removed ∪ {u}) from scratch for every remaining u; the batch smallest go."""
    order: list[int] = []
    while len(order) < n_prune:
        remaining = [u for u in range(w.shape[1] // size) if u not in order]
        errors = {u: refit_error(w, x, columns([*order, u], size), lam) for u in remaining}
        order += sorted(remaining, key=lambda u: errors[u])[: min(batch, n_prune - len(order))]
    return order


@pytest.mark.parametrize(("seed", "size", "batch"), [(0, 1, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 1, 3),
                                                     (5, 2, 2)])
def test_greedy_order_equals_a_naive_recomputation(seed, size, batch):
    w, x = problem(seed)
    n_prune = (w.shape[1] // size) // 2
    order = greedy_order(w, damped_inverse(x.T @ x, 0.01), size, n_prune, batch)
    expected = naive_greedy(w, x, size, n_prune, batch, lam_of(x, 0.01))
    if batch == 1:
        assert order == expected
    else:  # within a batch the order is by ε, between batches it is the same sets
        for step in range(0, n_prune, batch):
            assert set(order[step:step + batch]) == set(expected[step:step + batch])


def test_obs_returns_a_partition_with_the_asked_count_and_checks_its_input():
    w, x = problem(0)
    stats = ActivationStats.from_activations(x)
    selection = obs(w.float(), stats, UnitMap(3), 2)
    assert len(selection.pruned) == 2 and sorted([*selection.kept.tolist(), *selection.pruned.tolist()]) == [0, 1, 2, 3]
    expected = naive_greedy(w, x, 3, 2, 1, lam_of(x, 0.01))
    assert selection.pruned.tolist() == sorted(expected)
    with pytest.raises(ValueError, match="gqa_rule='group'"):
        obs(w, stats, UnitMap(3, group_size=2), 2)
    with pytest.raises(ValueError, match="percdamp=0"):
        obs(w, stats, UnitMap(3), 2, percdamp=0)
    with pytest.raises(ValueError, match="batch=0"):
        obs(w, stats, UnitMap(3), 2, batch=0)
    with pytest.raises(ValueError, match="Gram matrix"):
        obs(w, ActivationStats.from_activations(x, with_gram=False), UnitMap(3), 2)
