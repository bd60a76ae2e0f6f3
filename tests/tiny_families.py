"""Tiny random-init models of each family rcpu-bench prunes, built offline from transformers' own config classes.

Two layers, GQA (8 query heads over 4 key/value heads), the stories260K fixture's vocabulary size (512, so that
its tokenizer serves them), and non-trivial biases and norm weights: every 1-D parameter is perturbed after
init, so a bias or norm lost on a round trip changes the logits.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    OlmoConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
          "initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

FAMILIES = {  # name: (config class, the family's shape features)
    "llama3": (LlamaConfig, {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "mistral": (MistralConfig, {"sliding_window": 4}),
    "qwen2": (Qwen2Config, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, {"head_dim": 6}),  # per-head q/k norms, heads·head_dim ≠ hidden
    "gemma2": (Gemma2Config, {"head_dim": 4, "query_pre_attn_scalar": 4, "sliding_window": 4,
                              "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3_text": (Gemma3TextConfig, {"head_dim": 4, "query_pre_attn_scalar": 4, "sliding_window": 4,
                                       "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo": (OlmoConfig, {"clip_qkv": 2.0}),
    "olmo2": (Olmo2Config, {}),  # q/k norms over all heads: heads are not pruned (MLP only)
    "phi3": (Phi3Config, {}),  # fused qkv_proj, gate_up_proj
    "granite": (GraniteConfig, {"embedding_multiplier": 2.0, "logits_scaling": 3.0, "residual_multiplier": 0.5,
                                "attention_multiplier": 0.3}),
}


def family_config(name: str):
    """The tiny config of family ``name`` (a key of ``FAMILIES``)."""
    config_class, features = FAMILIES[name]
    return config_class(**COMMON, **features)


def family_model(name: str, *, seed: int = 0, attn: str | None = None):
    """A random-init model of family ``name`` in eval mode, its 1-D parameters (norms, biases) perturbed."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(family_config(name), attn_implementation=attn)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(0.2 * torch.randn_like(parameter))
    return model.eval()
