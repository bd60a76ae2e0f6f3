"""Depth pruning baselines as whole-model methods: ShortGPT and ReplaceMe (least-squares variant).

Both remove whole decoder layers; how many is chosen to match the parameters that width pruning at the same ρ
removes (:func:`matched_layer_count`: ⌊ρ·n⌋ units of every module, each unit's producer and consumer weights),
and the report records both counts.

- ShortGPT (Men et al. 2024): block influence BI_l = 1 − E_tokens[cos(x_in, x_out)] of each layer on the
  calibration tokens; the layers with the lowest BI go.
- ReplaceMe (Shopkhoev et al. 2025, LS variant): the run of n consecutive layers [i, i+n) whose input and output
  are closest in mean cosine distance is replaced by one linear map T applied to the MLP output M of layer i−1:
  T = argmin ‖M T − (X_out − R)‖² = (MᵀM)⁺ Mᵀ(X_out − R), R = X_in − M the rest of layer i−1's output, X_out
  the output of layer i+n−1, from the second-order statistics MᵀM and Mᵀ(X_out − R). T is merged into layer
  i−1's down_proj: W_down ← Tᵀ W_down (and its bias b ← Tᵀ b).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from rcpu_bench.model.adapter import decoder_layers, layer_view
from rcpu_bench.model.views import MODULES
from rcpu_bench.pruning.allocation import units_to_prune
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.walk import LayerStep, walk_layers

BATCH = 8  # calibration windows per forward pass


def matched_layer_count(model: nn.Module, ratio: float) -> tuple[int, float]:
    """Layers whose parameters are closest to what uniform width pruning at ρ removes, and that width count.

    Width: Σ over layers and modules of units_to_prune(ρ) × the unit's parameter cost (``LayerView.unit_cost``).
    """
    layers = decoder_layers(model)
    width = 0.0
    for layer in layers:
        view = layer_view(layer)
        for module in MODULES:
            mapping = view.units(module)
            width += units_to_prune(mapping, view.n_units(module), ratio, "floor") * view.unit_cost(module)
    per_layer = sum(p.numel() for p in layers[0].parameters())
    count = round(width / per_layer)
    if not 0 < count < len(layers):
        raise ValueError(f"ratio={ratio} matches {width:.0f} parameters, {count} of {len(layers)} layers; allowed: a "
                         "ratio that matches at least one layer and leaves one")
    return count, width


def check_ratio(model: nn.Module, /, *, ratio: float) -> None:
    """The depth methods' ``check=``: raise the one-line error of ``matched_layer_count`` before any work when
    ``ratio`` matches no layer or every one; ``model`` may be a weightless (meta) skeleton."""
    matched_layer_count(model, ratio)


def _cosine_sum(a: Tensor, b: Tensor) -> Tensor:
    """Σ over tokens of cos(a_t, b_t), in float64."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()


def dense_walk(model: nn.Module, calib_ids: Tensor) -> Iterator[LayerStep]:
    """The layer walk over the dense model on its own device, in batches of :data:`BATCH` windows: each layer's
    inputs and outputs."""
    device = next(model.parameters()).device
    return walk_layers(model, calib_ids, PruneConfig(batch_size=BATCH), device)


def block_influence(model: nn.Module, calib_ids: Tensor) -> Tensor:
    """ShortGPT's BI_l = 1 − mean over tokens of cos(x_in, x_out) of each layer (float64, shape (L,))."""
    scores = []
    for step in dense_walk(model, calib_ids):
        total = sum(_cosine_sum(x.hidden, out) for x, out in zip(step.inputs, step.outputs, strict=True))
        tokens = sum(x.hidden.shape[0] * x.hidden.shape[1] for x in step.inputs)
        scores.append(1 - cast(Tensor, total) / tokens)
    return torch.stack(scores)


class _CacheIndexed(Protocol):
    """A module with a KV-cache index (the attention block's ``layer_idx``)."""

    layer_idx: int


def remove_layers(model: nn.Module, removed: list[int]) -> None:
    """Delete decoder layers in place; renumber the rest (attention ``layer_idx``) and the config's layer count."""
    layers = decoder_layers(model)
    kept = [layer for i, layer in enumerate(layers) if i not in set(removed)]
    for index, layer in enumerate(kept):
        for module in layer.modules():  # the attention block's cache index, whatever the family calls it
            if hasattr(module, "layer_idx"):
                cast(_CacheIndexed, module).layer_idx = index
    cast(nn.Module, model.model).layers = nn.ModuleList(kept)
    config = cast(PretrainedConfig, model.config)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [t for i, t in enumerate(config.layer_types) if i not in set(removed)]
    config.num_hidden_layers = len(kept)


def shortgpt(model: nn.Module, calib_ids: Tensor, /, *, ratio: float) -> dict[str, Any]:
    """ShortGPT: remove the layers of lowest block influence BI = 1 − E[cos(x_in, x_out)], as many as match the
    parameters width pruning removes at ``ratio``."""
    count, width = matched_layer_count(model, ratio)
    bi = block_influence(model, calib_ids)
    removed = sorted(torch.sort(bi, stable=True).indices[:count].tolist())
    before = sum(p.numel() for p in model.parameters())
    remove_layers(model, removed)
    return {"layers_removed": removed, "n_layers_removed": count, "block_influence": bi.tolist(),
            "width_params_matched": width, "params_removed": before - sum(p.numel() for p in model.parameters())}


def cut_distances(model: nn.Module, calib_ids: Tensor, count: int) -> Tensor:
    """Mean cosine distance 1 − E[cos(x_in(i), x_out(i+count−1))] of every run of ``count`` layers starting at
    i = 1 … L−count (a run needs a preceding layer to absorb T); entry 0 is +inf."""
    n_layers = len(decoder_layers(model))
    distances = torch.full((n_layers - count + 1,), float("inf"), dtype=torch.float64)
    starts: dict[int, list[Tensor]] = {}
    for step in dense_walk(model, calib_ids):
        if 1 <= step.index <= n_layers - count:
            starts[step.index] = [x.hidden for x in step.inputs]
        start = step.index - count + 1
        if start in starts:
            held = starts.pop(start)
            total = sum(_cosine_sum(a, b) for a, b in zip(held, step.outputs, strict=True))
            distances[start] = 1 - total / sum(a.shape[0] * a.shape[1] for a in held)
    return distances


@torch.no_grad()
def replaceme_transform(model: nn.Module, calib_ids: Tensor, start: int, count: int) -> Tensor:
    """T (d × d) = (MᵀM)⁺ Mᵀ(X_out − R): M the MLP output of layer start−1, R the rest of its output, X_out the
    output of layer start+count−1 (module docstring), accumulated in float64 over the calibration tokens."""
    device = next(model.parameters()).device
    mlp_out: list[Tensor] = []
    hook = layer_view(decoder_layers(model)[start - 1]).block("mlp").register_forward_hook(
        lambda _m, _a, out: mlp_out.append(out))
    try:
        for step in dense_walk(model, calib_ids):
            outputs = step.outputs
            if step.index == start - 1:
                rest = [out - m for out, m in zip(outputs, mlp_out, strict=True)]
                hook.remove()
            if step.index == start + count - 1:
                break
    finally:
        hook.remove()
    d = outputs[0].shape[-1]
    mtm = torch.zeros(d, d, dtype=torch.float64, device=device)
    mty = torch.zeros(d, d, dtype=torch.float64, device=device)
    for m, r, out in zip(mlp_out, rest, outputs, strict=True):
        m, target = m.reshape(-1, d).double(), (out - r).reshape(-1, d).double()
        mtm += m.T @ m
        mty += m.T @ target
    return torch.linalg.pinv(mtm, hermitian=True) @ mty


def replaceme(model: nn.Module, calib_ids: Tensor, /, *, ratio: float) -> dict[str, Any]:
    """ReplaceMe (LS): replace the run of layers closest in cosine distance by a linear map T merged into the
    preceding layer's down_proj; as many layers as match the parameters width pruning removes at ``ratio``."""
    count, width = matched_layer_count(model, ratio)
    distances = cut_distances(model, calib_ids, count)
    start = int(torch.argmin(distances))
    transform = replaceme_transform(model, calib_ids, start, count)
    down = layer_view(decoder_layers(model)[start - 1]).projection("mlp")
    down.weight.copy_((transform.T @ down.weight.double()).to(down.weight.dtype))
    if down.bias is not None:
        down.bias.copy_((transform.T @ down.bias.double()).to(down.bias.dtype))
    before = sum(p.numel() for p in model.parameters())
    removed = list(range(start, start + count))
    remove_layers(model, removed)
    finite = [d if d != float("inf") else None for d in distances.tolist()]  # no run starts at layer 0
    return {"layers_removed": removed, "n_layers_removed": count, "cut_distances": finite,
            "width_params_matched": width, "params_removed": before - sum(p.numel() for p in model.parameters())}
