"""Optimal Brain Surgeon (OBS) structured selection: ZipLM, SlimGPT, Týr-the-Pruner.

Removing a set S of input columns of W (d_out × d_in) and refitting the kept columns by least squares on the
damped Gram matrix H = G + λI (λ = percdamp · mean diag G, SparseGPT's ``percdamp``) costs

    ε_S = tr(W_{:,S} [(H⁻¹)_{SS}]⁻¹ W_{:,S}ᵀ)                                  (ZipLM eq. 3, SlimGPT eq. 4)

and the refit is W ← W − W_{:,S} [(H⁻¹)_{SS}]⁻¹ (H⁻¹)_{S,:}. After the removal, the inverse of the kept block
H_KK (embedded with zeros at S) is the Schur-complement downdate H⁻¹ ← H⁻¹ − (H⁻¹)_{:,S} [(H⁻¹)_{SS}]⁻¹ (H⁻¹)_{S,:}.
Greedy OBS removes, step after step, the unit (head, key/value group or channel) with the smallest ε_S given the
units already removed; SlimGPT's batched greedy removes the ``batch`` smallest at each step. Only the selection is
kept: the refit here only orders later removals, and the run's compensator then acts on the kept set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcpu_bench.selection.select import Selection, UnitMap
from rcpu_bench.statistics.activations import ActivationStats


def damped_inverse(gram: Tensor, percdamp: float) -> Tensor:
    """H⁻¹ = (G + λI)⁻¹ with λ = percdamp · mean diag G, by Cholesky (float64)."""
    if not percdamp > 0:
        raise ValueError(f"obs percdamp={percdamp} must be > 0 (SparseGPT uses 0.01)")
    h = gram.to(torch.float64, copy=True)
    h.diagonal().add_(percdamp * h.diagonal().mean())
    factor, fail = torch.linalg.cholesky_ex(h)
    if fail:
        raise ValueError(f"G + λI is not positive definite at percdamp={percdamp}; use a larger percdamp")
    return torch.cholesky_inverse(factor)


def unit_errors(w: Tensor, hinv: Tensor, units: Tensor, unit_size: int) -> Tensor:
    """ε_u = tr(W_{:,u} [(H⁻¹)_{uu}]⁻¹ W_{:,u}ᵀ) of each unit u in ``units`` (its columns [u·size, (u+1)·size))."""
    cols = units[:, None] * unit_size + torch.arange(unit_size, device=units.device)  # (n, size)
    blocks = hinv[cols[:, :, None], cols[:, None, :]]  # (n, size, size): the diagonal blocks (H⁻¹)_{uu}
    wu = w[:, cols].permute(1, 0, 2)  # (n, d_out, size)
    solved = torch.linalg.solve(blocks, wu.transpose(1, 2))  # (n, size, d_out) = (H⁻¹)_{uu}⁻¹ W_uᵀ
    return (wu.transpose(1, 2) * solved).sum((1, 2))


def remove_columns(w: Tensor, hinv: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """The OBS refit of W after removing columns S, and the Schur-complement downdate of H⁻¹ (module docstring)."""
    inv_block = torch.linalg.inv(hinv[cols[:, None], cols])  # [(H⁻¹)_{SS}]⁻¹ (|S| × |S|)
    rows = hinv[cols, :]  # (H⁻¹)_{S,:} (|S| × d_in)
    w = w - w[:, cols] @ inv_block @ rows
    hinv = hinv - rows.T @ inv_block @ rows
    w[:, cols] = 0
    hinv[cols, :], hinv[:, cols] = 0, 0
    return w, hinv


def greedy_order(w: Tensor, hinv: Tensor, unit_size: int, n_prune: int, batch: int = 1) -> list[int]:
    """Units in the order greedy OBS removes them: at each step the ``batch`` smallest ε_u given those removed."""
    if unit_size == 1 and batch == 1:
        return greedy_columns(w.clone(), hinv.clone(), n_prune)
    remaining = torch.arange(w.shape[1] // unit_size, device=w.device)
    order: list[int] = []
    while len(order) < n_prune:
        errors = unit_errors(w, hinv, remaining, unit_size)
        take = torch.sort(errors, stable=True).indices[: min(batch, n_prune - len(order))]
        chosen = remaining[take]
        cols = (chosen[:, None] * unit_size + torch.arange(unit_size, device=w.device)).reshape(-1)
        w, hinv = remove_columns(w, hinv, cols)
        order += chosen.tolist()
        keep = torch.ones(len(remaining), dtype=torch.bool, device=w.device)
        keep[take] = False
        remaining = remaining[keep]
    return order


def greedy_columns(w: Tensor, hinv: Tensor, n_prune: int) -> list[int]:
    """Single columns one at a time (greedy OBS on MLP channels), the same removals as :func:`remove_columns` as
    rank-one updates in place (``w`` and ``hinv`` are overwritten): with p the removed column and h = (H⁻¹)_{p,:},

        ε_j = ‖W_{:,j}‖² / (H⁻¹)_{jj},   W ← W − W_{:,p} hᵀ / h_p,   H⁻¹ ← H⁻¹ − h hᵀ / h_p,

    which zero column p of both (so the removed columns are masked out of the next argmin instead of re-indexed).
    """
    removed = torch.zeros(w.shape[1], dtype=torch.bool, device=w.device)
    order: list[int] = []
    for _ in range(n_prune):
        errors = w.square().sum(0).div_(hinv.diagonal()).masked_fill_(removed, float("inf"))
        p = int(torch.argmin(errors))  # the first of equal minima, as a stable sort's
        row = hinv[p].clone()  # h, (d_in,)
        pivot = float(row[p])
        w.addr_(w[:, p].clone(), row, alpha=-1 / pivot)
        hinv.addr_(row, row, alpha=-1 / pivot)
        removed[p] = True
        order.append(p)
    return order


def obs(weight: Tensor, stats: ActivationStats, units: UnitMap, n_prune: int, /, *, percdamp: float = 0.01,
        batch: int = 1) -> Selection:
    """Greedy OBS selection (ZipLM; SlimGPT's batched greedy with ``batch`` > 1).

    ε_S from H = G + λI, λ = percdamp · mean diag G (module docstring); returns the kept and pruned units.
    """
    if units.group_size > 1:
        raise ValueError(f"obs selects whole units jointly; got units in groups of {units.group_size} "
                         "(gqa_rule='query'); allowed: gqa_rule='group'")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"obs batch={batch!r}; allowed: an integer >= 1")
    d_in = weight.shape[1]
    if d_in % units.unit_size:
        raise ValueError(f"unit_size={units.unit_size} does not divide the {d_in} columns")
    hinv = damped_inverse(stats.require_gram(), percdamp)
    w = weight.detach().to(device=stats.device, dtype=torch.float64)
    pruned = torch.tensor(greedy_order(w, hinv, units.unit_size, n_prune, batch), dtype=torch.long)
    mask = torch.ones(d_in // units.unit_size, dtype=torch.bool)
    mask[pruned] = False
    return Selection(mask.nonzero().flatten(), pruned.sort().values)
