"""The Hugging Face format of saved pruned models: a config + modeling file pair for remote code.

A pruned Llama whose layers all have the same widths and no extra biases is a plain ``LlamaConfig``.
Otherwise (per-layer widths, as FLAP's AL-AM structure gives, or o_proj / down_proj biases, as FLAP's
bias compensation gives) the saved config.json is an ``RcpuLlamaConfig`` whose ``auto_map`` names the
two source files of this package, written beside the weights, so that
``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` builds every layer at its
width with transformers alone.

Why remote code and not transformers' own per-layer configuration: transformers 5.23 has
``PreTrainedConfig.per_layer_config`` (``transformers.integrations.heterogeneity``), but only some model
families read it (Gemma 4, dots3, Laguna, ...); ``LlamaModel`` does not, and building
``LlamaForCausalLM`` from a Llama config with per-layer head counts raises
``AmbiguousGlobalPerLayerAttributeError``. It also has no way to give o_proj alone a bias, and it does
not exist in the transformers 4 releases this package supports. Remote code is the one mechanism that
loads these models in every supported version.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from rcpu_bench.model.hf_format.configuration_rcpu_llama import PER_LAYER, RcpuLlamaConfig
from rcpu_bench.model.hf_format.modeling_rcpu_llama import RcpuLlamaForCausalLM

SOURCE_FILES = ("configuration_rcpu_llama.py", "modeling_rcpu_llama.py")
AUTO_MAP = {"AutoConfig": "configuration_rcpu_llama.RcpuLlamaConfig",
            "AutoModelForCausalLM": "modeling_rcpu_llama.RcpuLlamaForCausalLM"}


def write_source(directory: Path) -> None:
    """Copy the configuration and modeling source of this package into ``directory`` (for ``auto_map``)."""
    package = resources.files(__name__)
    for name in SOURCE_FILES:
        with resources.as_file(package / name) as path:
            shutil.copyfile(path, directory / name)


__all__ = ["AUTO_MAP", "PER_LAYER", "SOURCE_FILES", "RcpuLlamaConfig", "RcpuLlamaForCausalLM", "write_source"]
