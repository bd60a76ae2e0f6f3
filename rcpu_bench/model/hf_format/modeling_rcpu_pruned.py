"""A pruned causal LM whose decoder layers are built at their own widths, for every transformers family.

Written by rcpu-bench (``rcpu_bench.model.hf_format``) beside the weights of a saved pruned model; see
``configuration_rcpu_pruned.py``. Loading builds the family's own causal LM class (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Gemma2ForCausalLM``, ...) through a subclass (``per_layer_class``) that rebuilds each
decoder layer with the family's own layer class from a copy of the config holding that layer's head and
channel counts, so the forward pass is exactly the family's; linear layers named in ``layer_added_biases`` get
a bias (FLAP's bias compensation), which the families' configs cannot express for one projection alone.
"""

import copy
import functools
import shutil
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .configuration_rcpu_pruned import PER_LAYER, RcpuPrunedConfig

SOURCE_FILES = ("configuration_rcpu_pruned.py", "modeling_rcpu_pruned.py")


def _layer_config(config, index):
    """A shallow copy of ``config`` holding layer ``index``'s head and channel counts."""
    layer_config = copy.copy(config)
    layer_config.num_attention_heads = config.layer_num_attention_heads[index]
    layer_config.num_key_value_heads = config.layer_num_key_value_heads[index]
    layer_config.intermediate_size = config.layer_intermediate_sizes[index]
    return layer_config


def build_layer(layer_class, config, index):
    """Decoder layer ``index`` of ``layer_class`` at its widths, with the added biases the config lists."""
    layer_config = _layer_config(config, index)
    layer = layer_class(layer_config, index)
    for name in config.layer_added_biases[index]:
        linear = layer.get_submodule(name)
        parent, _, child = name.rpartition(".")
        layer.get_submodule(parent).register_module(child, nn.Linear(linear.in_features, linear.out_features))
    # The modules read the attention implementation from their config at run time: share the model's,
    # so that switching it (set_attn_implementation, from_pretrained's attn_implementation) reaches them.
    for module in layer.modules():
        if getattr(module, "config", None) is layer_config:
            module.config = config
    return layer


@functools.cache
def per_layer_class(model_class):
    """``model_class`` (a family's causal LM) with every decoder layer at the widths its config lists."""

    class PerLayer(model_class):
        def __init__(self, config):
            super().__init__(config)
            layers = self.base_model.layers
            for i, layer in enumerate(layers):
                layers[i] = build_layer(type(layer), config, i)
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
