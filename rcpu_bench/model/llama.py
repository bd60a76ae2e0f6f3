"""The LLaMA family: ``LlamaForCausalLM``-shaped decoders (Llama, Mistral, Qwen2, ...), named once.

Decoder layers at ``model.model.layers``, each with ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj`` as ``nn.Linear``, pre-norms ``input_layernorm`` / ``post_attention_layernorm``,
and ``self_attn.head_dim`` / ``self_attn.num_key_value_groups``. Pruning a head or a key/value group
rewrites q/k/v rows and o_proj columns, a channel gate/up rows and a down_proj column
(``rcpu_bench.model.surgery``); transformers ≥ 4.48 reshapes with -1 and ``head_dim``, so only
``num_key_value_groups`` (and the MLP's ``intermediate_size``) has to follow the new counts.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import PretrainedConfig

from rcpu_bench.model.surgery import head_counts, rewrite_channels, rewrite_heads
from rcpu_bench.model.views import LayerGeometry, LayerView, ModelView, check_module

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED = ("LlamaForCausalLM-shaped decoders (Llama, Mistral, Qwen2, ...): model.model.layers[i] with "
             "self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj as nn.Linear, and self_attn.head_dim / "
             "self_attn.num_key_value_groups")


def config_head_dim(config: PretrainedConfig) -> int:
    """The attention head size: ``config.head_dim`` when set, else hidden_size // num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor, o_bias: Tensor | None,
               physical: bool) -> int:
    return rewrite_heads((attn.q_proj,), (attn.k_proj, attn.v_proj), attn.o_proj, attn.head_dim, kept_heads,
                         kept_kv_heads, o_weight, o_bias, physical=physical)


def prune_attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                    o_bias: Tensor | None = None) -> None:
    """Physically keep query heads ``kept_heads`` and kv heads ``kept_kv_heads`` of a Llama attention module.

    q_proj keeps the rows of the kept query heads, k_proj/v_proj those of the kept kv heads, o_proj becomes
    d_out × len(kept_heads)·head_dim with ``o_weight`` (``surgery.rewrite_heads``); ``num_key_value_groups``
    becomes len(kept_heads) // len(kept_kv_heads).
    """
    attn.num_key_value_groups = _attention(attn, kept_heads, kept_kv_heads, o_weight, o_bias, True)


def mask_attention(attn: nn.Module, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                   o_bias: Tensor | None = None) -> None:
    """Same-shape counterpart of ``prune_attention``: zero the pruned q/k/v rows and o_proj columns."""
    _attention(attn, kept_heads, kept_kv_heads, o_weight, o_bias, False)


def prune_mlp(mlp: nn.Module, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None) -> None:
    """Physically keep intermediate channels ``kept``: gate/up rows, down_proj d_out × len(kept) = ``down_weight``."""
    rewrite_channels((mlp.gate_proj, mlp.up_proj), mlp.down_proj, kept, down_weight, down_bias, physical=True)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(kept)


def mask_mlp(mlp: nn.Module, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None) -> None:
    """Same-shape counterpart of ``prune_mlp``: zero the pruned gate/up rows and down_proj columns."""
    rewrite_channels((mlp.gate_proj, mlp.up_proj), mlp.down_proj, kept, down_weight, down_bias, physical=False)


class LlamaLayer(LayerView):
    """A ``LlamaDecoderLayer`` (or one shaped like it)."""

    PROJECTIONS = {"attention": "o_proj", "mlp": "down_proj"}
    _BLOCKS = {"attention": "self_attn", "mlp": "mlp"}
    _NORMS = {"attention": "input_layernorm", "mlp": "post_attention_layernorm"}
    _PRODUCERS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
    PARTS = (*_BLOCKS.values(), *_NORMS.values())  # the children of a plain layer

    @classmethod
    def problem(cls, layer: nn.Module) -> str | None:
        for block, names in (("self_attn", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS)):
            module = getattr(layer, block, None)
            missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Linear)]
            if missing:
                return f"no nn.Linear {block}.{', '.join(missing)}"
        if not all(hasattr(layer.self_attn, a) for a in ("head_dim", "num_key_value_groups")):
            return "self_attn has no head_dim / num_key_value_groups attributes"
        return None

    def block(self, module: str) -> nn.Module:
        return getattr(self.layer, self._BLOCKS[check_module(module)])

    def producers(self, module: str) -> tuple[nn.Linear, ...]:
        block = self.block(module)
        return tuple(getattr(block, name) for name in self._PRODUCERS[module])

    def norm(self, module: str) -> nn.Module:
        return getattr(self.layer, self._NORMS[check_module(module)])

    @property
    def geometry(self) -> LayerGeometry:
        """Heads from q_proj / k_proj rows over ``self_attn.head_dim`` (set from the config as
        ``config_head_dim``), channels from gate_proj rows."""
        attn = self.layer.self_attn
        n_heads, n_kv_heads = head_counts(attn.q_proj, attn.k_proj, attn.head_dim)
        return LayerGeometry(n_heads, n_kv_heads, attn.head_dim, self.layer.mlp.gate_proj.out_features)

    def prune_heads(self, kept_heads: Tensor, kept_kv_heads: Tensor, weight: Tensor, bias: Tensor | None = None,
                    *, physical: bool = True) -> None:
        (prune_attention if physical else mask_attention)(self.layer.self_attn, kept_heads, kept_kv_heads, weight, bias)

    def prune_channels(self, kept: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                       physical: bool = True) -> None:
        (prune_mlp if physical else mask_mlp)(self.layer.mlp, kept, weight, bias)


class LlamaModel(ModelView):
    """A ``LlamaForCausalLM``-shaped model: ``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``."""

    LAYER = LlamaLayer
    SUPPORTED = SUPPORTED

    @classmethod
    def problem(cls, model: nn.Module) -> str | None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            return "no decoder layers at model.model.layers"
        for i, layer in enumerate(layers):
            problem = LlamaLayer.problem(layer)
            if problem:
                return f"layer {i}: {problem}"
        return None

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def embeddings(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def front(self) -> list[nn.Module]:
        base = self.model.model
        return [m for m in (base.embed_tokens, getattr(base, "rotary_emb", None)) if m is not None]

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    @final_norm.setter
    def final_norm(self, norm: nn.Module) -> None:
        self.model.model.norm = norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head
