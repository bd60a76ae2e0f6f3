"""Exact parameter counts of a sliced model, from the dense model's shapes (meta tensors suffice).

With V the vocabulary, H / KV query and key/value heads of size h, I the MLP width and a layer's residual
widths (d_in, d_mid, d_out), a sliced Llama has

    embeddings      V·d_0
    per layer       q, k, v: d_in·(H + 2·KV)·h      o: H·h·d_mid
                    gate, up: 2·d_mid·I             down: I·d_out
                    shortcuts: d_in·d_mid + d_mid·d_out
    LM head         d_L·V  (untied from the embeddings; d_L = d unless the head is sliced)

plus biases on the sliced side where the dense linears have them. The RMSNorm weights are folded into the
linears, so the norms have no parameters left. Shortcuts and the untied head can make the model *grow*.
"""

from __future__ import annotations

from torch import nn

from rcpu_bench.model import MODULES, LayerView, layer_view, model_view
from rcpu_slicegpt.layers import LayerDims, SlicePlan


def linear_parameters(linear: nn.Linear, *, in_features: int | None = None, out_features: int | None = None) -> int:
    """out·in (+ out for a bias), with the residual-facing side replaced by its sliced width."""
    n_in = linear.in_features if in_features is None else in_features
    n_out = linear.out_features if out_features is None else out_features
    return n_out * n_in + (n_out if linear.bias is not None else 0)


def _untouched_parameters(view: LayerView) -> int:
    """Parameters of attention and MLP outside their projections (e.g. per-head q/k norms): kept as they are."""
    blocks = [view.block(module) for module in MODULES]
    projections = {id(p) for module in MODULES for linear in (*view.producers(module), view.projection(module))
                   for p in linear.parameters()}
    return sum(p.numel() for block in blocks for p in block.parameters() if id(p) not in projections)


def layer_parameters(layer: nn.Module, dims: LayerDims) -> int:
    """One sliced layer: q/k/v read d_in, o writes d_mid, gate/up read d_mid, down writes d_out, plus shortcuts."""
    view = layer_view(layer)
    reads = sum(linear_parameters(linear, in_features=dims.attn_in) for linear in view.producers("attention"))
    reads += sum(linear_parameters(linear, in_features=dims.mlp_in) for linear in view.producers("mlp"))
    writes = (linear_parameters(view.projection("attention"), out_features=dims.mlp_in)
              + linear_parameters(view.projection("mlp"), out_features=dims.out))
    shortcuts = dims.attn_in * dims.mlp_in + dims.mlp_in * dims.out
    return reads + writes + shortcuts + _untouched_parameters(view)


def sliced_parameter_count(model: nn.Module, plan: SlicePlan) -> int:
    """Parameters of ``model`` (dense or already sliced) once sliced to ``plan``: V·d_0 + Σ layers + d_L·V."""
    view = model_view(model)
    if len(view.layers) != len(plan.layers):
        raise ValueError(f"the slice plan has {len(plan.layers)} layers; the model has {len(view.layers)}")
    embedding = view.embeddings.num_embeddings * plan.embedding
    body = sum(layer_parameters(layer, dims) for layer, dims in zip(view.layers, plan.layers, strict=True))
    return embedding + body + linear_parameters(view.lm_head, in_features=plan.head)
