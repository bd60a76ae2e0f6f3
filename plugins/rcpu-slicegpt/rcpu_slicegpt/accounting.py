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

from rcpu_bench.model.loading import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, decoder_layers
from rcpu_slicegpt.layers import LayerDims, SlicePlan

_READ_ATTN = ("q_proj", "k_proj", "v_proj")
_READ_MLP = ("gate_proj", "up_proj")


def linear_parameters(linear: nn.Linear, *, in_features: int | None = None, out_features: int | None = None) -> int:
    """out·in (+ out for a bias), with the residual-facing side replaced by its sliced width."""
    n_in = linear.in_features if in_features is None else in_features
    n_out = linear.out_features if out_features is None else out_features
    return n_out * n_in + (n_out if linear.bias is not None else 0)


def _untouched_parameters(layer: nn.Module) -> int:
    """Parameters of attention and MLP outside the seven projections (e.g. per-head q/k norms): kept as they are."""
    projections = {id(p) for block, names in ((layer.self_attn, ATTENTION_PROJECTIONS), (layer.mlp, MLP_PROJECTIONS))
                   for name in names for p in getattr(block, name).parameters()}
    return sum(p.numel() for block in (layer.self_attn, layer.mlp) for p in block.parameters() if id(p) not in projections)


def layer_parameters(layer: nn.Module, dims: LayerDims) -> int:
    """One sliced layer: q/k/v read d_in, o writes d_mid, gate/up read d_mid, down writes d_out, plus shortcuts."""
    attn, mlp = layer.self_attn, layer.mlp
    reads = sum(linear_parameters(getattr(attn, n), in_features=dims.attn_in) for n in _READ_ATTN)
    reads += sum(linear_parameters(getattr(mlp, n), in_features=dims.mlp_in) for n in _READ_MLP)
    writes = (linear_parameters(attn.o_proj, out_features=dims.mlp_in)
              + linear_parameters(mlp.down_proj, out_features=dims.out))
    shortcuts = dims.attn_in * dims.mlp_in + dims.mlp_in * dims.out
    return reads + writes + shortcuts + _untouched_parameters(layer)


def sliced_parameter_count(model: nn.Module, plan: SlicePlan) -> int:
    """Parameters of ``model`` (dense or already sliced) once sliced to ``plan``: V·d_0 + Σ layers + d_L·V."""
    layers = decoder_layers(model)
    if len(layers) != len(plan.layers):
        raise ValueError(f"the slice plan has {len(plan.layers)} layers; the model has {len(layers)}")
    embedding = model.model.embed_tokens.num_embeddings * plan.embedding
    body = sum(layer_parameters(layer, dims) for layer, dims in zip(layers, plan.layers))
    return embedding + body + linear_parameters(model.lm_head, in_features=plan.head)
