"""Ridge's relative damping: λ = lam + lam_rel · mean diag G_KK, recorded on both scales."""

from __future__ import annotations

import pytest
import torch

from rcpu_bench.compensation.compensators import ridge
from rcpu_bench.statistics.activations import ActivationStats


def problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 10, generator=generator, dtype=torch.float64)
    x = torch.randn(30, 10, generator=generator, dtype=torch.float64)
    return w, ActivationStats.from_activations(x), x, torch.tensor([0, 2, 3, 5, 7, 9]), torch.tensor([1, 4, 6, 8])


@pytest.mark.parametrize(("lam", "lam_rel"), [(0.0, 0.01), (0.5, 0.1), (2.0, 0.0)])
def test_relative_damping_is_the_absolute_one_at_lam_rel_times_mean_diag_gkk(lam, lam_rel):
    w, stats, x, kept, pruned = problem()
    scale = float((x[:, kept].T @ x[:, kept]).diagonal().mean())  # mean diag G_KK, from the activations
    total = lam + lam_rel * scale
    result = ridge(w, stats, kept, pruned, lam=lam, lam_rel=lam_rel)
    # the ridge solution from the activations: (W XᵀX_K + λ W_K)(X_KᵀX_K + λI)⁻¹
    direct = (w @ x.T @ x[:, kept] + total * w[:, kept]) @ torch.linalg.inv(x[:, kept].T @ x[:, kept]
                                                                             + total * torch.eye(len(kept)))
    torch.testing.assert_close(result.weight, direct)
    assert result.info["lambda"] == pytest.approx(total) and result.info["lambda_rel"] == pytest.approx(total / scale)


def test_negative_damping_is_refused_naming_both_values():
    w, stats, _, kept, pruned = problem()
    with pytest.raises(ValueError, match="lam=0.0, lam_rel=-0.1"):
        ridge(w, stats, kept, pruned, lam=0.0, lam_rel=-0.1)
