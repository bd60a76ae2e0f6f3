"""Structured pruning of one attention block or MLP, on its linears: physical removal, or same-shape masking.

Both follow the coupling of docs/methods.md §1. Pruning query head h removes the query projection's
output rows [h·hd, (h+1)·hd) and the same columns of the output projection (the consumer); pruning
key/value head g removes those rows of the key and value projections; pruning MLP channel c removes row c
of the producers (gate, up) and column c of the consumer (down). The consumer gets the caller's
compensated weight over the kept columns, and a bias when one is given.

``physical=True`` slices the weights, so shapes shrink; ``physical=False`` keeps every shape, zeroes
what pruning would remove and writes the compensated weight into the kept columns: the reference for the
physical version, and the ``--unstr``-style model. Both go through one helper, ``rewrite``. Which
linears play which part (a fused projection's rows are ``stacked``), and the module attributes that
follow the new counts, are the family's (``rcpu_bench.model.llama``); the model's config is left as it
was, so read head counts from ``rcpu_bench.model.views.LayerGeometry``.

Index tensors must be 1-D, non-empty, strictly increasing and in range. Weights and biases keep the
dtype and device of the module they replace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench.selection.select import Selection


def _selection(name: str, kept: Tensor, n_units: int) -> Selection:
    """Validated kept units out of ``n_units`` (on the CPU) and their complement."""
    kept = torch.as_tensor(kept).detach().cpu()
    if kept.dim() != 1 or kept.dtype.is_floating_point or kept.dtype.is_complex or kept.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got dtype {kept.dtype} and shape {tuple(kept.shape)}")
    if kept.numel() == 0:
        raise ValueError(f"{name} is empty: at least one of the {n_units} units must be kept")
    kept = kept.long()
    if (kept.diff() <= 0).any():
        raise ValueError(f"{name} must be strictly increasing (sorted, no duplicates), got {kept.tolist()}")
    if kept[0] < 0 or kept[-1] >= n_units:
        raise ValueError(f"{name} {kept.tolist()} is out of range; allowed: 0 … {n_units - 1}")
    pruned = torch.ones(n_units, dtype=torch.bool)
    pruned[kept] = False
    return Selection(kept, pruned.nonzero().flatten())


def check_head_groups(kept_heads: Tensor, kept_kv_heads: Tensor, groups: int) -> int:
    """The new number of query heads per kv head; ValueError unless the kept heads form whole groups.

    Query head h is served by kv head h // ``groups``. Each kept kv head must serve the same number of
    kept query heads (and no kept query head may lose its kv head), in order.
    """
    n_heads, n_kv_heads = len(kept_heads), len(kept_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} kept query heads cannot be shared equally by {n_kv_heads} kept kv heads")
    new_groups = n_heads // n_kv_heads
    if not torch.equal(kept_heads // groups, kept_kv_heads.repeat_interleave(new_groups)):
        raise ValueError(f"kept query heads {kept_heads.tolist()} do not match kept kv heads {kept_kv_heads.tolist()}: "
                         f"query head h belongs to kv head h // {groups}, and every kept kv head must serve exactly "
                         f"{new_groups} kept query heads")
    return new_groups


def _take_rows(tensor: Tensor, rows: Selection, physical: bool) -> Tensor:
    """The kept rows of ``tensor`` (physical), or ``tensor`` with its pruned rows zeroed."""
    if physical:
        return tensor.index_select(0, rows.kept.to(tensor.device))
    return tensor.index_fill(0, rows.pruned.to(tensor.device), 0)


def _set_linear(linear: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
    """Give ``linear`` new parameters in place (the module object, and any hooks on it, stay)."""
    requires_grad = linear.weight.requires_grad
    linear.weight = nn.Parameter(weight.detach(), requires_grad=requires_grad)
    if bias is not linear.bias:
        # torch types Linear.bias as a Parameter, but a Linear built with bias=False holds None
        new_bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=requires_grad)
        linear.bias = new_bias  # type: ignore[assignment]
    linear.out_features, linear.in_features = weight.shape


def _keep_rows(linear: nn.Linear, rows: Selection, physical: bool) -> None:
    """Keep output rows ``rows.kept`` of a producer (q/k/v, gate/up), with its bias."""
    bias = None if linear.bias is None else _take_rows(linear.bias, rows, physical)
    _set_linear(linear, _take_rows(linear.weight, rows, physical), bias)


def _set_columns(linear: nn.Linear, columns: Selection, weight: Tensor, bias: Tensor | None, physical: bool) -> None:
    """Give a consumer (the output or down projection) the compensated ``weight`` over its kept input columns.

    ``bias`` replaces the module's bias (adding one if it had none); None keeps the existing bias.
    """
    expected = (linear.out_features, len(columns.kept))
    if tuple(weight.shape) != expected:
        raise ValueError(f"compensated weight has shape {tuple(weight.shape)}; expected {expected} "
                         "(output rows × kept input columns, in kept order)")
    if bias is not None and tuple(bias.shape) != (linear.out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({linear.out_features},)")
    like: dict[str, Any] = dict(dtype=linear.weight.dtype, device=linear.weight.device)
    weight = weight.to(**like, copy=True)
    if not physical:
        weight = weight.new_zeros(linear.weight.shape).index_copy(1, columns.kept.to(weight.device), weight)
    _set_linear(linear, weight, linear.bias if bias is None else bias.to(**like, copy=True))


def rewrite(producers: Sequence[tuple[nn.Linear, Selection]], consumer: nn.Linear, columns: Selection,
            weight: Tensor, bias: Tensor | None, *, physical: bool) -> None:
    """Prune (or mask) the producers' output rows and the consumer's input columns of one block.

    The consumer (o_proj, down_proj) becomes d_out × len(columns.kept) with ``weight`` (compensated, columns in
    kept order) and ``bias`` if given; each producer keeps its rows (a fused producer: ``stacked`` rows).
    """
    _set_columns(consumer, columns, weight, bias, physical)  # validates shapes before anything changes
    for linear, rows in producers:
        _keep_rows(linear, rows, physical)


def stacked(*segments: Selection) -> Selection:
    """The rows of a fused projection whose output stacks ``segments`` in order (Phi-3's q|k|v, gate|up).

    Row r of segment j is row o_j + r, with o_j the total size (kept + pruned) of the segments before it.
    """
    kept, pruned, offset = [], [], 0
    for segment in segments:
        kept.append(segment.kept + offset)
        pruned.append(segment.pruned + offset)
        offset += len(segment.kept) + len(segment.pruned)
    return Selection(torch.cat(kept), torch.cat(pruned))


def head_counts(queries: nn.Linear, keys: nn.Linear, head_dim: int) -> tuple[int, int]:
    """(query heads, key/value heads): the output rows of a query and a key projection over ``head_dim``."""
    counts = []
    for name, linear in (("query", queries), ("key", keys)):
        if linear.out_features % head_dim:
            raise ValueError(f"the {name} projection has {linear.out_features} output rows, not a multiple of "
                             f"head_dim={head_dim}")
        counts.append(linear.out_features // head_dim)
    return counts[0], counts[1]


def heads_of_columns(columns: Tensor, head_dim: int) -> Tensor:
    """The query heads whose columns [h·hd, (h+1)·hd) make up ``columns`` (sorted); ValueError if any is partial."""
    if columns.numel() % head_dim:
        raise ValueError(f"{columns.numel()} kept columns are not whole heads of head_dim={head_dim}")
    blocks = columns.reshape(-1, head_dim)
    heads = blocks[:, 0] // head_dim
    if not torch.equal(blocks, heads[:, None] * head_dim + torch.arange(head_dim, device=columns.device)):
        raise ValueError(f"kept columns {columns.tolist()} are not whole heads of head_dim={head_dim}")
    return heads


def head_rows(n_heads: int, n_kv_heads: int, head_dim: int, kept_heads: Tensor,
              kept_kv_heads: Tensor) -> tuple[Selection, Selection, int]:
    """Validated rows of the kept query heads and of the kept key/value heads, and the new queries per kv head.

    Whole kv groups may be pruned (MHA: groups of one), or every kv head kept with the same number of query
    heads pruned in each group (``check_head_groups``). Query rows are also the consumer's (o_proj's) columns.
    """
    heads = _selection("kept_heads", kept_heads, n_heads)
    kv_heads = _selection("kept_kv_heads", kept_kv_heads, n_kv_heads)
    groups = check_head_groups(heads.kept, kv_heads.kept, n_heads // n_kv_heads)
    return heads.columns(head_dim), kv_heads.columns(head_dim), groups


def channel_rows(kept: Tensor, n_channels: int) -> Selection:
    """Validated kept intermediate channels: rows of each producer (gate, up), columns of the consumer (down)."""
    return _selection("kept channels", kept, n_channels)
