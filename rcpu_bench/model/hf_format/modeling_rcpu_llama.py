"""A Llama causal LM whose decoder layers are built at their own widths (a pruned Llama).

Written by rcpu-bench (``rcpu_bench.model.hf_format``) beside the weights of a saved pruned model; see
``configuration_rcpu_llama.py``. Each layer is transformers' own ``LlamaDecoderLayer``, built from a
copy of the config holding that layer's head and channel counts, so the forward pass is exactly
Llama's; o_proj / down_proj get a bias where the configuration says so (FLAP's bias compensation),
which ``LlamaConfig.attention_bias`` / ``mlp_bias`` cannot express (they add biases to every
projection).
"""

import copy

from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from .configuration_rcpu_llama import RcpuLlamaConfig


def _layer_config(config, index):
    """A shallow copy of ``config`` holding layer ``index``'s head and channel counts."""
    heads, kv_heads, channels, _, _ = config.layer_widths(index)
    layer_config = copy.copy(config)
    layer_config.num_attention_heads, layer_config.num_key_value_heads = heads, kv_heads
    layer_config.intermediate_size = channels
    return layer_config


def build_layer(config, index):
    """Decoder layer ``index`` at its width, with o_proj / down_proj biases where the config has them."""
    layer = LlamaDecoderLayer(_layer_config(config, index), index)
    _, _, _, o_bias, down_bias = config.layer_widths(index)
    attn, mlp = layer.self_attn, layer.mlp
    if o_bias:
        attn.o_proj = nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=True)
    if down_bias:
        mlp.down_proj = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=True)
    # The modules read the attention implementation from their config at run time: share the model's,
    # so that switching it (set_attn_implementation, from_pretrained's attn_implementation) reaches them.
    for module in (layer, attn, mlp):
        if hasattr(module, "config"):
            module.config = config
    return layer


class RcpuLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with every decoder layer at the widths of ``RcpuLlamaConfig``."""

    config_class = RcpuLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.model.layers = nn.ModuleList(build_layer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()
