"""ShortGPT (Men et al. 2024): remove the layers of lowest block influence BI_l = 1 − E_tokens[cos(x_in, x_out)]."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from rcpu_bench.methods.depth.layers import cosine_sum, dense_walk, matched_layer_count, remove_layers


def block_influence(model: nn.Module, calib_ids: Tensor) -> Tensor:
    """ShortGPT's BI_l = 1 − mean over tokens of cos(x_in, x_out) of each layer (float64, shape (L,))."""
    scores = []
    for step in dense_walk(model, calib_ids):
        total = sum(cosine_sum(x.hidden, out) for x, out in zip(step.inputs, step.outputs, strict=True))
        tokens = sum(x.hidden.shape[0] * x.hidden.shape[1] for x in step.inputs)
        scores.append(1 - cast(Tensor, total) / tokens)
    return torch.stack(scores)


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
