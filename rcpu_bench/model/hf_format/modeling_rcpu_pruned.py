"""A pruned causal LM whose decoder layers are built at their own widths, for every transformers family.

Written by rcpu-bench (``rcpu_bench.model.hf_format``) beside the weights of a saved pruned model; see
``configuration_rcpu_pruned.py``. Loading builds the family's own causal LM class (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Phi3ForCausalLM``, ...) through a subclass (``per_layer_class``) that rebuilds each
decoder layer with the family's own layer class from a view of the config holding that layer's head and
channel counts (``LayerConfig``), so the forward pass is exactly the family's; linear layers named in
``layer_added_biases`` get a bias (FLAP's bias compensation), which the families' configs cannot express for
one projection alone.
"""

import functools
import shutil
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .configuration_rcpu_pruned import PER_LAYER, RcpuPrunedConfig

SOURCE_FILES = ("configuration_rcpu_pruned.py", "modeling_rcpu_pruned.py")


class LayerConfig:
    """Layer ``index``'s view of the model's config: its own head and channel counts; every other setting read from
    the model's config when read, so that a later change (the attention implementation, switched by
    ``set_attn_implementation`` or from_pretrained's ``attn_implementation``) reaches the layer. Some families read
    the counts at run time (Phi-3 slices its fused qkv_proj by ``config.num_attention_heads``)."""

    def __init__(self, config, index):
        self._model_config = config
        self.num_attention_heads = config.layer_num_attention_heads[index]
        self.num_key_value_heads = config.layer_num_key_value_heads[index]
        self.intermediate_size = config.layer_intermediate_sizes[index]

    def __getattr__(self, name):
        if name == "_model_config":  # not set yet: copy.deepcopy asks a bare instance
            raise AttributeError(name)
        return getattr(self._model_config, name)


def build_layer(layer_class, config, index):
    """Decoder layer ``index`` of ``layer_class`` at its widths, with the added biases the config lists."""
    layer = layer_class(LayerConfig(config, index), index)
    for name in config.layer_added_biases[index]:
        linear = layer.get_submodule(name)
        parent, _, child = name.rpartition(".")
        layer.get_submodule(parent).register_module(child, nn.Linear(linear.in_features, linear.out_features))
    return layer


@functools.cache
def per_layer_class(model_class):
    """``model_class`` (a family's causal LM) with every decoder layer at the widths its config lists."""

    class PerLayer(model_class):
        def __init__(self, config):
            super().__init__(config)
            layers = self.base_model.layers
            for i, layer in enumerate(layers):  # self.config: the model may hold a copy of ``config``
                layers[i] = build_layer(type(layer), self.config, i)
            self.post_init()

        def save_pretrained(self, save_directory, *args, **kwargs):
            """Save as the family's model does, then write config.json in the per-layer format and its source."""
            super().save_pretrained(save_directory, *args, **kwargs)
            config = RcpuPrunedConfig.of(self.config, **{k: getattr(self.config, k) for k in PER_LAYER})
            write_per_layer_config(config, Path(save_directory))

    PerLayer.__name__ = PerLayer.__qualname__ = f"RcpuPruned{model_class.__name__}"
    return PerLayer


AUTO_MAP = {"AutoConfig": "configuration_rcpu_pruned.RcpuPrunedConfig",
            "AutoModelForCausalLM": "modeling_rcpu_pruned.RcpuPrunedForCausalLM"}


def write_per_layer_config(config, directory):
    """Write ``config`` (an ``RcpuPrunedConfig``) as ``directory``'s config.json, its ``auto_map`` naming this
    source, copied beside it, so that transformers alone loads the directory (with ``trust_remote_code``)."""
    config.auto_map = dict(AUTO_MAP)
    config.architectures = [RcpuPrunedForCausalLM.__name__]
    config.save_pretrained(directory)
    for name in SOURCE_FILES:
        shutil.copyfile(Path(__file__).with_name(name), directory / name)


class RcpuPrunedForCausalLM(PreTrainedModel):
    """The Auto classes' entry for ``RcpuPrunedConfig``: never instantiated itself, it builds the family's causal
    LM with per-layer widths (``per_layer_class``) from ``config.family_config()``."""

    config_class = RcpuPrunedConfig

    @classmethod
    def family_class(cls, config):
        return per_layer_class(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        if not isinstance(config, RcpuPrunedConfig):
            config = RcpuPrunedConfig.from_pretrained(pretrained_model_name_or_path)
        family = config.family_config()
        return cls.family_class(family).from_pretrained(pretrained_model_name_or_path, *args, config=family, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        family = config.family_config()
        return cls.family_class(family)._from_config(family, **kwargs)
