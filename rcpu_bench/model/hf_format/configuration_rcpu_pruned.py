"""Configuration of a pruned causal LM whose decoder layers have their own widths (rcpu-bench's per-layer format).

Written by rcpu-bench (``rcpu_bench.model.hf_format``) beside the weights of a saved pruned model and named in
its config.json's ``auto_map``, so that ``AutoModelForCausalLM.from_pretrained(directory,
trust_remote_code=True)`` loads it without rcpu-bench installed; where rcpu-bench is imported these classes are
registered with the Auto classes and load it without remote code. It needs only transformers.
"""

from transformers import CONFIG_MAPPING, PretrainedConfig

PER_LAYER = ("layer_num_attention_heads", "layer_num_key_value_heads", "layer_intermediate_sizes",
             "layer_added_biases")


class RcpuPrunedConfig(PretrainedConfig):
    """The family's own config (``base_config``: Llama, Mistral, Qwen2, Gemma-2, ... with its ``model_type``, the
    unpruned head and channel counts and an explicit ``head_dim``) plus, per decoder layer, its query heads,
    key/value heads, MLP channels, and the linear layers given a bias the family's layers lack (names inside the
    layer, e.g. ``self_attn.o_proj`` after FLAP's bias compensation).
    """

    model_type = "rcpu_pruned"

    def __init__(self, base_config=None, layer_num_attention_heads=(), layer_num_key_value_heads=(),
                 layer_intermediate_sizes=(), layer_added_biases=(), **kwargs):
        super().__init__(**kwargs)
        self.base_config = dict(base_config or {})
        self.layer_num_attention_heads = list(layer_num_attention_heads)
        self.layer_num_key_value_heads = list(layer_num_key_value_heads)
        self.layer_intermediate_sizes = list(layer_intermediate_sizes)
        self.layer_added_biases = [list(names) for names in layer_added_biases]
        n = self.base_config.get("num_hidden_layers", 0)
        for name in PER_LAYER:
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; num_hidden_layers is {n}")
        for i, (heads, kv_heads) in enumerate(zip(self.layer_num_attention_heads, self.layer_num_key_value_heads)):
            if kv_heads < 1 or heads % kv_heads:
                raise ValueError(f"layer {i}: {heads} query heads is not a positive multiple of {kv_heads} "
                                 "key/value heads")

    def __getattr__(self, name):
        """The family config's settings (max_position_embeddings, vocab_size, ...), read through for the tools
        that read them from any config (set after ``__init__``, so transformers' own set-up never sees them)."""
        base = self.__dict__.get("base_config")
        if base is None or name.startswith("_") or name not in base:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return base[name]

    def family_config(self):
        """The family's config, carrying the per-layer lists (read by ``modeling_rcpu_pruned``) as attributes, and
        the attention implementation asked of this config."""
        base = dict(self.base_config)
        model_type = base.pop("model_type", None)
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"base_config has model_type {model_type!r}, which this transformers does not know")
        config = CONFIG_MAPPING[model_type].from_dict(base)
        if self._attn_implementation is not None:  # from_pretrained(attn_implementation=...) set it on this config
            config._attn_implementation = self._attn_implementation
        for name in PER_LAYER:
            setattr(config, name, getattr(self, name))
        return config

    @classmethod
    def of(cls, family_config, **per_layer):
        """The per-layer config of a model of ``family_config`` (its per-layer lists, if any, replaced by
        ``per_layer``: lists named as ``PER_LAYER``)."""
        base = {k: v for k, v in family_config.to_dict().items()
                if k not in (*PER_LAYER, "architectures", "auto_map", "transformers_version", "_name_or_path")}
        return cls(base_config=base, **per_layer)
