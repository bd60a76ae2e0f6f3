"""The Hugging Face format of saved pruned models whose layers differ: a config + modeling file pair.

A pruned model whose layers the family's own config can describe (all layers alike, biases as the family
has them) is saved with that config (``LlamaConfig``, ``Qwen2Config``, ...). Otherwise (per-layer widths, as
FLAP's AL-AM structure gives, or an o_proj / down_proj bias the family lacks, as FLAP's bias compensation
gives) config.json is an ``RcpuPrunedConfig``: the family's config plus per-layer lists, whose ``auto_map``
names the two source files of this package, written beside the weights. Importing rcpu_bench.model (not the
lazy top package, which loads no model library) registers these classes with ``AutoConfig`` /
``AutoModelForCausalLM``, so that such a directory loads with plain ``from_pretrained`` and no remote code (and
no trust prompt); elsewhere ``trust_remote_code=True`` builds it
with transformers alone. One pair of files serves every family: the model class built is the family's own,
with each decoder layer rebuilt by the family's layer class at its widths.

Why remote code and not transformers' own per-layer configuration: transformers 5.23 has
``PreTrainedConfig.per_layer_config`` (``transformers.integrations.heterogeneity``), but only some model
families read it (Gemma 4, dots3, Laguna, ...); ``LlamaModel`` does not, and building
``LlamaForCausalLM`` from a Llama config with per-layer head counts raises
``AmbiguousGlobalPerLayerAttributeError``. It also has no way to give o_proj alone a bias, and it does
not exist in the transformers 4 releases this package supports.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from rcpu_bench.model.hf_format.configuration_rcpu_pruned import PER_LAYER, RcpuPrunedConfig
from rcpu_bench.model.hf_format.modeling_rcpu_pruned import RcpuPrunedForCausalLM, write_per_layer_config

AutoConfig.register(RcpuPrunedConfig.model_type, RcpuPrunedConfig, exist_ok=True)
AutoModelForCausalLM.register(RcpuPrunedConfig, RcpuPrunedForCausalLM, exist_ok=True)

__all__ = ["PER_LAYER", "RcpuPrunedConfig", "RcpuPrunedForCausalLM", "write_per_layer_config"]
