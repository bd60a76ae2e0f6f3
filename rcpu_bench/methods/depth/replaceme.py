"""ReplaceMe (Shopkhoev et al. 2025, LS variant): replace the run of layers closest in cosine distance by one linear map
T merged into the preceding layer's down_proj (the package docstring states T)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench.methods.depth.layers import cosine_sum, dense_walk, matched_layer_count, remove_layers
from rcpu_bench.model.adapter import decoder_layers, layer_view


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
            total = sum(cosine_sum(a, b) for a, b in zip(held, step.outputs, strict=True))
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
