"""Test helpers: tiny random-init LLaMA models, the shared fixture models, and random pruning plans."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.llama import mask_attention, mask_mlp, prune_attention, prune_mlp
from rcpu_bench.paths import SHARED_ENV, shared_dir


def or_missing(lookup) -> Path:
    """``lookup()`` (a fixture directory), or a path that does not exist, so that tests skip instead of erroring."""
    try:
        return lookup()
    except FileNotFoundError:
        return Path("shared-fixtures-not-found")


SHARED = or_missing(shared_dir)
STORIES = SHARED / "models" / "stories260K"
STORIES_MHA = SHARED / "models" / "stories260K-mha"
WIKI_TEST = SHARED / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"
TINYSTORIES = SHARED / "data" / "tinystories" / "validation_first1000.jsonl"
needs_stories = pytest.mark.skipif(not STORIES.is_dir() or not STORIES_MHA.is_dir(),
                                   reason=f"fixture models not found ({STORIES}); set ${SHARED_ENV}")


def tiny_config(*, n_heads: int = 6, n_kv_heads: int = 3, head_dim: int = 6, hidden: int = 24,
                intermediate: int = 20, layers: int = 3, vocab: int = 61, tie: bool = True,
                attention_bias: bool = False, mlp_bias: bool = False) -> LlamaConfig:
    """A tiny Llama config; by default GQA with head_dim (6) ≠ hidden / heads (4) and ≠ 128, tied embeddings.

    (transformers 5 still requires hidden % heads == 0 even when head_dim is given.)

    initializer_range 0.3 (not 0.02) so that logits vary and comparisons are not trivially met.
    """
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                       head_dim=head_dim, tie_word_embeddings=tie, attention_bias=attention_bias,
                       mlp_bias=mlp_bias, initializer_range=0.3, max_position_embeddings=64,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(config: LlamaConfig, *, seed: int = 0, attn: str = "eager") -> LlamaForCausalLM:
    """A random-init model of ``config`` in eval mode, without touching the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.eval()


def tokens(vocab: int, *, batch: int = 2, length: int = 9, seed: int = 0) -> Tensor:
    """A batch of random token ids (avoiding the special ids 0-2)."""
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return model(ids).logits


@dataclass
class LayerPlan:
    """What to keep in one layer, and the (random) compensated weights to write."""

    heads: Tensor
    kv_heads: Tensor
    o_weight: Tensor
    o_bias: Tensor | None
    channels: Tensor
    down_weight: Tensor
    down_bias: Tensor | None


def _subset(n: int, size: int, g: torch.Generator) -> Tensor:
    return torch.randperm(n, generator=g)[:size].sort().values


def _heads(n_heads: int, n_kv_heads: int, layer: int, rule: str, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Kept (query, kv) heads: rule "groups" keeps whole kv groups, "within" keeps every kv head and
    the same number of query heads in each group. Counts shrink with the layer index."""
    groups = n_heads // n_kv_heads
    if rule == "groups":
        kv = _subset(n_kv_heads, n_kv_heads - layer % n_kv_heads, g)
        return (kv[:, None] * groups + torch.arange(groups)).reshape(-1), kv
    if rule == "within":
        per_group = groups - layer % groups
        heads = [g_ * groups + _subset(groups, per_group, g) for g_ in range(n_kv_heads)]
        return torch.cat(heads), torch.arange(n_kv_heads)
    raise ValueError(f"unknown rule {rule!r}")


def random_plan(model, *, rule: str = "groups", bias: bool = False, seed: int = 0) -> list[LayerPlan]:
    """Random selections (different counts per layer) and random compensated weights for every layer."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    randn = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    plan = []
    for i, geo in enumerate(layer_geometries(model)):
        heads, kv = _heads(geo.n_heads, geo.n_kv_heads, i, rule, g)
        channels = _subset(geo.intermediate, max(1, geo.intermediate - 1 - 3 * i), g)
        plan.append(LayerPlan(heads, kv, randn(hidden, len(heads) * geo.head_dim), randn(hidden) if bias else None,
                              channels, randn(hidden, len(channels)), randn(hidden) if bias else None))
    return plan


def apply_plan(model, plan: list[LayerPlan], *, physical: bool = True):
    """Prune (or, with physical=False, mask) every layer of ``model`` by ``plan``; returns the model."""
    attention, mlp = (prune_attention, prune_mlp) if physical else (mask_attention, mask_mlp)
    for layer, p in zip(model.model.layers, plan):
        attention(layer.self_attn, p.heads, p.kv_heads, p.o_weight, p.o_bias)
        mlp(layer.mlp, p.channels, p.down_weight, p.down_bias)
    return model
