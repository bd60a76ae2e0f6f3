"""Configuration of a Llama model whose decoder layers have their own widths (a pruned Llama).

Written by rcpu-bench (``rcpu_bench.model.hf_format``) beside the weights of a saved pruned model and named in
its config.json's ``auto_map``, so that ``AutoModelForCausalLM.from_pretrained(directory,
trust_remote_code=True)`` loads it without rcpu-bench installed. It needs only transformers.
"""

from transformers import LlamaConfig

PER_LAYER = ("layer_num_attention_heads", "layer_num_key_value_heads", "layer_intermediate_sizes",
             "layer_o_proj_bias", "layer_down_proj_bias")


class RcpuLlamaConfig(LlamaConfig):
    """A ``LlamaConfig`` plus, per decoder layer, its query heads, key/value heads, MLP channels and
    whether o_proj / down_proj carry a bias.

    The inherited ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size`` stay those
    of the unpruned model; ``head_dim`` is stored explicitly because it no longer equals
    hidden_size / heads once heads are removed. A list left out means every layer as the global value
    (no bias for the bias flags).
    """

    model_type = "rcpu_llama"

    def __init__(self, layer_num_attention_heads=None, layer_num_key_value_heads=None,
                 layer_intermediate_sizes=None, layer_o_proj_bias=None, layer_down_proj_bias=None, **kwargs):
        super().__init__(**kwargs)
        n = self.num_hidden_layers
        given = {"layer_num_attention_heads": (layer_num_attention_heads, self.num_attention_heads),
                 "layer_num_key_value_heads": (layer_num_key_value_heads, self.num_key_value_heads),
                 "layer_intermediate_sizes": (layer_intermediate_sizes, self.intermediate_size),
                 "layer_o_proj_bias": (layer_o_proj_bias, False),
                 "layer_down_proj_bias": (layer_down_proj_bias, False)}
        for name, (values, default) in given.items():
            values = [default] * n if values is None else list(values)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries; num_hidden_layers is {n}")
            setattr(self, name, values)
        for i, (heads, kv_heads) in enumerate(zip(self.layer_num_attention_heads, self.layer_num_key_value_heads)):
            if kv_heads < 1 or heads % kv_heads:
                raise ValueError(f"layer {i}: {heads} query heads is not a positive multiple of {kv_heads} "
                                 "key/value heads")

    def layer_widths(self, index):
        """(query heads, key/value heads, MLP channels, o_proj bias, down_proj bias) of layer ``index``."""
        return tuple(getattr(self, name)[index] for name in PER_LAYER)
