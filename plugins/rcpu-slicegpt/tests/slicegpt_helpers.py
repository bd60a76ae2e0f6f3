"""Helpers for the SliceGPT tests: tiny random Llama models and model copies."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

STORIES = ("stories260K", "stories260K-mha")


def tiny_llama(n_kv_heads: int, *, tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer Llama (hidden 32, 4 heads of 8) with random norm weights, so norm folding matters."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=n_kv_heads, head_dim=8, vocab_size=64, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model


def copy_of(model, dtype=None):
    """A deep copy of ``model``, cast to ``dtype`` when given."""
    clone = copy.deepcopy(model)
    return clone if dtype is None else clone.to(dtype)


def random_ids(model, n: int, seqlen: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``seqlen`` uniformly random token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n, seqlen), generator=generator)
