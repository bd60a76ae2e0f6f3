"""What both depth baselines share: how many layers match width pruning's parameters at ρ (the ``check=`` they register,
which refuses a ratio that matches none or every layer before any weights load), the dense layer walk they read,
and the removal of layers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, cast

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


def cosine_sum(a: Tensor, b: Tensor) -> Tensor:
    """Σ over tokens of cos(a_t, b_t), in float64."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()


def dense_walk(model: nn.Module, calib_ids: Tensor) -> Iterator[LayerStep]:
    """The layer walk over the dense model on its own device, in batches of :data:`BATCH` windows: each layer's
    inputs and outputs."""
    device = next(model.parameters()).device
    return walk_layers(model, calib_ids, PruneConfig(batch_size=BATCH), device)


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
