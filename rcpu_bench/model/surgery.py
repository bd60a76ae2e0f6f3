"""Structured pruning of one attention block or MLP: physical removal, or same-shape masking.

Both follow the coupling of methods-spec §3.1. Pruning query head h removes q_proj output rows
[h·hd, (h+1)·hd) and the same o_proj input columns; pruning key/value head g removes those k_proj and
v_proj rows; pruning MLP channel c removes gate_proj/up_proj row c and down_proj column c. The
consumer (o_proj, down_proj) gets the caller's compensated weight over the kept columns, and a bias
when one is given.

``prune_*`` slices the weights, so shapes shrink and the module keeps working (transformers ≥ 4.48
reshapes with -1 and ``head_dim``; only ``num_key_value_groups`` has to follow the new head counts).
``mask_*`` keeps every shape, zeroes what pruning would remove and writes the compensated weight into
the kept columns: the reference for the physical version, and the ``--unstr``-style model. Both go
through one helper, ``_rewrite``. The model's config is left as it was: after pruning, layers may
differ from it and from each other, so read head counts from ``models.LayerGeometry``.

Index tensors must be 1-D, non-empty, strictly increasing and in range. Weights and biases keep the
dtype and device of the module they replace.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rcpu_bench.model.loading import head_counts
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
        linear.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=requires_grad)
    linear.out_features, linear.in_features = weight.shape


def _keep_rows(linear: nn.Linear, rows: Selection, physical: bool) -> None:
    """Keep output rows ``rows.kept`` of a producer (q/k/v, gate/up), with its bias."""
    bias = None if linear.bias is None else _take_rows(linear.bias, rows, physical)
    _set_linear(linear, _take_rows(linear.weight, rows, physical), bias)


def _set_columns(linear: nn.Linear, columns: Selection, weight: Tensor, bias: Tensor | None, physical: bool) -> None:
    """Give a consumer (o_proj, down_proj) the compensated ``weight`` over its kept input columns.

    ``bias`` replaces the module's bias (adding one if it had none); None keeps the existing bias.
    """
    expected = (linear.out_features, len(columns.kept))
    if tuple(weight.shape) != expected:
        raise ValueError(f"compensated weight has shape {tuple(weight.shape)}; expected {expected} "
                         "(output rows × kept input columns, in kept order)")
    if bias is not None and tuple(bias.shape) != (linear.out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({linear.out_features},)")
    like = dict(dtype=linear.weight.dtype, device=linear.weight.device)
    weight = weight.to(**like, copy=True)
    if not physical:
        weight = weight.new_zeros(linear.weight.shape).index_copy(1, columns.kept.to(weight.device), weight)
    _set_linear(linear, weight, linear.bias if bias is None else bias.to(**like, copy=True))


def _rewrite(producers: Sequence[tuple[nn.Linear, Selection]], consumer: nn.Linear, columns: Selection,
             weight: Tensor, bias: Tensor | None, *, physical: bool) -> None:
    """Prune (or mask) the producers' output rows and the consumer's input columns of one block."""
    _set_columns(consumer, columns, weight, bias, physical)  # validates shapes before anything changes
    for linear, rows in producers:
        _keep_rows(linear, rows, physical)


def _attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor, o_bias: Tensor | None,
               *, physical: bool) -> int:
    """Prune or mask query/kv heads of ``attn``; returns the new query heads per kv head."""
    n_heads, n_kv_heads = head_counts(attn, attn.head_dim)
    heads = _selection("kept_heads", kept_heads, n_heads)
    kv_heads = _selection("kept_kv_heads", kept_kv_heads, n_kv_heads)
    groups = check_head_groups(heads.kept, kv_heads.kept, n_heads // n_kv_heads)
    q_rows, kv_rows = heads.columns(attn.head_dim), kv_heads.columns(attn.head_dim)
    _rewrite([(attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows)], attn.o_proj, q_rows,
             o_weight, o_bias, physical=physical)
    return groups


def prune_attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                    o_bias: Tensor | None = None) -> None:
    """Physically remove the query heads not in ``kept_heads`` and kv heads not in ``kept_kv_heads``.

    q_proj keeps the rows of the kept query heads, k_proj/v_proj those of the kept kv heads, and
    o_proj becomes d_out × len(kept_heads)·head_dim with weight ``o_weight`` (compensated, columns in
    kept order) and bias ``o_bias`` if given. Whole kv groups may be pruned (MHA: groups of one), or
    every kv head kept with the same number of query heads pruned in each group; the module's
    ``num_key_value_groups`` is updated to len(kept_heads) // len(kept_kv_heads).
    """
    attn.num_key_value_groups = _attention(attn, kept_heads, kept_kv_heads, o_weight, o_bias, physical=True)


def mask_attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                   o_bias: Tensor | None = None) -> None:
    """Same-shape counterpart of ``prune_attention``: zero the pruned q/k/v rows and o_proj columns.

    ``o_weight`` is the same compensated d_out × len(kept_heads)·head_dim matrix that
    ``prune_attention`` takes; it is written into o_proj's kept columns.
    """
    _attention(attn, kept_heads, kept_kv_heads, o_weight, o_bias, physical=False)


def _mlp(mlp: nn.Module, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None, *, physical: bool) -> None:
    """Prune or mask intermediate channels of ``mlp``."""
    channels = _selection("kept channels", kept, mlp.gate_proj.out_features)
    _rewrite([(mlp.gate_proj, channels), (mlp.up_proj, channels)], mlp.down_proj, channels, down_weight, down_bias,
             physical=physical)


def prune_mlp(mlp: nn.Module, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None) -> None:
    """Physically keep only the intermediate channels ``kept``.

    gate_proj/up_proj keep those output rows; down_proj becomes d_out × len(kept) with weight
    ``down_weight`` (compensated, columns in kept order) and bias ``down_bias`` if given.
    """
    _mlp(mlp, kept, down_weight, down_bias, physical=True)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(kept)


def mask_mlp(mlp: nn.Module, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None) -> None:
    """Same-shape counterpart of ``prune_mlp``: zero the pruned gate/up rows and down_proj columns."""
    _mlp(mlp, kept, down_weight, down_bias, physical=False)
