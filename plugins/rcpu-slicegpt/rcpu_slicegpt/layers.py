"""Modules of a sliced model: the parameter-free RMS norm and the decoder layer with residual shortcuts.

After SliceGPT, the residual stream entering layer ℓ is x̃ = x Q_ℓ[:, :d_in] (the dense stream x rotated
to its principal basis and sliced). A layer computes

    h̃ = x̃ S_attn + Attn(RMSN(x̃)),      S_attn = Q_inᵀ Q_mid   (d_in × d_mid, both sliced)
    ỹ = h̃ S_mlp + MLP(RMSN(h̃)),        S_mlp = Q_midᵀ Q_out   (d_mid × d_out)

with the norm weights already folded into q/k/v and gate/up, q/k/v and gate/up reading the sliced basis,
and o_proj / down_proj writing it. With nothing sliced the Q are orthogonal and the model is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass(frozen=True)
class LayerDims:
    """Widths of one sliced layer's residual stream: at its input, between attention and MLP, at its output."""

    attn_in: int
    mlp_in: int
    out: int


@dataclass(frozen=True)
class SlicePlan:
    """The residual width at every point of a sliced model; the embeddings write ``layers[0].attn_in`` and
    the LM head reads ``layers[-1].out``. Consecutive layers agree: ``layers[i].out == layers[i + 1].attn_in``."""

    hidden_size: int
    layers: tuple[LayerDims, ...]

    def __post_init__(self) -> None:
        widths = [w for dims in self.layers for w in (dims.attn_in, dims.mlp_in, dims.out)]
        if not self.layers or not all(0 < w <= self.hidden_size for w in widths):
            raise ValueError(f"slice plan widths {widths} must lie in 1..{self.hidden_size}")
        if any(a.out != b.attn_in for a, b in pairwise(self.layers)):
            raise ValueError("slice plan: each layer's output width must equal the next layer's input width")

    @property
    def embedding(self) -> int:
        return self.layers[0].attn_in

    @property
    def head(self) -> int:
        return self.layers[-1].out

    @classmethod
    def uniform(cls, hidden_size: int, dim: int, n_layers: int, *, slice_head: bool = False) -> SlicePlan:
        """Every stream sliced to ``dim``; the last layer writes the full ``hidden_size`` unless ``slice_head``
        (SliceGPT's default keeps the LM head's input unsliced)."""
        last = dim if slice_head else hidden_size
        dims = [LayerDims(dim, dim, dim) for _ in range(n_layers - 1)] + [LayerDims(dim, dim, last)]
        return cls(hidden_size, tuple(dims))


def set_weight(module: nn.Linear | nn.Embedding, weight: Tensor, bias: Tensor | None = None) -> None:
    """Give a linear (out × in) or embedding (V × d) layer a new weight, and bias; its sizes follow the weight."""
    module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=module.bias.requires_grad)
    if isinstance(module, nn.Embedding):
        module.embedding_dim = weight.shape[1]
    else:
        module.out_features, module.in_features = weight.shape


class RMSN(nn.Module):
    """Parameter-free RMS norm over the dense width d: RMSN(x) = x / sqrt(Σᵢ xᵢ² / d + ε).

    Dividing by the dense width d, not the current width, keeps the scale of a rotated, sliced stream:
    ‖x Q‖ = ‖x‖, and the kept principal coordinates carry most of that norm. Computed in at least float32
    (as the Hugging Face norms) but in float64 for float64 inputs.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = y * torch.rsqrt(y.square().sum(-1, keepdim=True) / self.dim + self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


class SlicedDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm decoder layer whose residual adds go through shortcut matrices (see the module docstring).

    It takes over the dense layer's attention and MLP modules (their KV-cache ``layer_idx`` included) and
    accepts the keyword arguments the model's forward passes to decoder layers.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, dims: LayerDims, *, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn, self.mlp, self.dims = self_attn, mlp, dims
        self.input_layernorm = RMSN(hidden_size, eps)
        self.post_attention_layernorm = RMSN(hidden_size, eps)
        weight = next(self_attn.parameters())
        self.attn_shortcut = nn.Linear(dims.attn_in, dims.mlp_in, bias=False, device=weight.device, dtype=weight.dtype)
        self.mlp_shortcut = nn.Linear(dims.mlp_in, dims.out, bias=False, device=weight.device, dtype=weight.dtype)

    def attention_branch(self, hidden_states: Tensor, **kwargs) -> Tensor:
        """Attn(RMSN(x̃)): what attention adds to the residual stream."""
        return self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]

    def mlp_branch(self, hidden_states: Tensor) -> Tensor:
        """MLP(RMSN(h̃)): what the MLP adds to the residual stream."""
        return self.mlp(self.post_attention_layernorm(hidden_states))

    def forward(self, hidden_states: Tensor, **kwargs) -> Tensor:
        """ỹ = h̃ S_mlp + MLP(RMSN(h̃)) with h̃ = x̃ S_attn + Attn(RMSN(x̃))."""
        mid = self.attn_shortcut(hidden_states) + self.attention_branch(hidden_states, **kwargs)
        return self.mlp_shortcut(mid) + self.mlp_branch(mid)
