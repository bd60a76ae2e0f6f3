"""The Llama-like families: one shared base, each family's differences stated as data (a ``Family``).

A Llama-like causal LM has its decoder layers at ``model.model.layers``; each layer has an attention block
``self_attn`` and an MLP ``mlp``. The attention's consumer is ``o_proj`` and its producers are the q/k/v
rows (``q_proj``, ``k_proj``, ``v_proj``, or one fused ``qkv_proj`` whose rows stack q|k|v); the MLP's
consumer is ``down_proj`` and its producers are the gate/up rows (``gate_proj``, ``up_proj``, or one
fused ``gate_up_proj`` stacking gate|up). What differs between families is data: the fused projections,
the norms the producers read (pre-norms), the norms applied to a block's output (Gemma's sandwich
post-norms), per-head q/k norms, and whether heads can be removed at all (OLMo-2's q/k norms span all
heads). One file per family in ``rcpu_bench.model.families`` holds its ``Family``.

Pruning a head or key/value group rewrites q/k/v rows and o_proj columns, a channel gate/up rows and a
down_proj column (``rcpu_bench.model.surgery``); transformers ≥ 4.48 reshapes with -1 and ``head_dim``,
so only ``num_key_value_groups`` (and ``num_key_value_heads`` / ``intermediate_size`` where a module keeps
them) has to follow the new counts. Phi-3's attention reads its query-head count from the config at run
time; a physically pruned one gets a ``ConfigOverride`` of that count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from rcpu_bench.model.surgery import channel_rows, head_counts, head_rows, rewrite, stacked
from rcpu_bench.model.views import LayerGeometry, LayerView, ModelView, check_module

BLOCKS = {"attention": "self_attn", "mlp": "mlp"}
CONSUMERS = {"attention": "o_proj", "mlp": "down_proj"}


@dataclass(frozen=True)
class Family:
    """A Llama-like family: the config model types it covers and how its decoder layers differ from Llama's.

    ``pre_norms`` / ``post_norms``: the layer's norms (attention's, MLP's) that the producers read, or that
    the block's output goes through before the residual (empty: none). ``head_norms``: norms inside the
    attention (q_norm, k_norm), per head unless ``head_pruning_refused`` says why heads cannot be removed.
    ``counts_in_config``: the attention reads its query-head count from ``config.num_attention_heads``.
    ``logit_softcapping`` / ``logit_divisor``: the config attributes of what the causal LM applies to the LM head's
    output, c·tanh(z / c) (Gemma) or z / s (Granite), when set.
    """

    name: str
    model_types: tuple[str, ...]
    attention_producers: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: fused q|k|v rows
    mlp_producers: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: fused gate|up rows
    pre_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    post_norms: tuple[str, ...] = ()
    head_norms: tuple[str, ...] = ()
    head_pruning_refused: str | None = None
    counts_in_config: bool = False
    logit_softcapping: str | None = None
    logit_divisor: str | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        """The children of a plain decoder layer: its blocks and norms."""
        return (*BLOCKS.values(), *self.pre_norms, *self.post_norms)

    def producers(self, module: str) -> tuple[str, ...]:
        return self.attention_producers if check_module(module) == "attention" else self.mlp_producers

    def post_norm(self, module: str) -> str | None:
        """The norm the module's output goes through before the residual, or None."""
        return self.post_norms[list(BLOCKS).index(check_module(module))] if self.post_norms else None


class ConfigOverride:
    """The shared model config seen through a module that needs its own counts (Phi-3's pruned attention).

    Every other attribute is read from the shared config at access time, so that switching the attention
    implementation on the model still reaches the module.
    """

    def __init__(self, config: PretrainedConfig | ConfigOverride, **overrides: Any):
        shared = config.__dict__["_shared"] if isinstance(config, ConfigOverride) else config
        previous = config.__dict__["_overrides"] if isinstance(config, ConfigOverride) else {}
        self.__dict__.update(_shared=shared, _overrides={**previous, **overrides})

    def __getattr__(self, name: str) -> Any:
        if "_shared" not in self.__dict__:  # during copy / unpickling, before __dict__ is restored
            raise AttributeError(name)
        overrides = self.__dict__["_overrides"]
        return overrides[name] if name in overrides else getattr(self.__dict__["_shared"], name)


def config_head_dim(config: PretrainedConfig) -> int:
    """The attention head size: ``config.head_dim`` when set, else hidden_size // num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# Llama 1/2/3.x: GQA, llama3 rope scaling, tied or untied embeddings, optional attention_bias / mlp_bias.
LLAMA = Family("Llama", ("llama",))


def _linear_problem(block: nn.Module | None, block_name: str, names: tuple[str, ...]) -> str | None:
    missing = [n for n in names if not isinstance(getattr(block, n, None), nn.Linear)]
    return f"no nn.Linear {block_name}.{', '.join(missing)}" if missing else None


def _unknown_parameters(block: nn.Module, known: tuple[str, ...]) -> list[str]:
    """Children of ``block`` that hold parameters and are not in ``known`` (they could change the function)."""
    return [name for name, child in block.named_children()
            if name not in known and any(True for _ in child.parameters())]


class AttentionBlock(Protocol):
    """What pruning reads and sets on a Llama-like attention block besides its producers: its output projection
    and plain attributes, which nn.Module's typing does not see (``LlamaLikeLayer.problem`` checks the first two)."""

    head_dim: int
    num_key_value_groups: int
    num_key_value_heads: int  # set only where the module keeps it
    config: PretrainedConfig | ConfigOverride
    o_proj: nn.Linear


class MLPBlock(Protocol):
    """What pruning reads and sets on a Llama-like MLP block besides its producers."""

    down_proj: nn.Linear
    intermediate_size: int  # set only where the module keeps it


class DecoderStack(Protocol):
    """``model.model`` of a Llama-like causal LM."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module

    def named_children(self) -> Iterator[tuple[str, nn.Module]]: ...

    def __call__(self, *, input_ids: Tensor, attention_mask: Tensor, use_cache: bool) -> Any: ...


def attention_heads(attn: AttentionBlock, family: Family = LLAMA) -> tuple[int, int]:
    """(query heads, key/value heads) of an attention block, from its rows over ``attn.head_dim``.

    A fused q|k|v projection has n_kv·(groups + 2) heads' rows, groups = ``attn.num_key_value_groups``.
    """
    producers, hd = [getattr(attn, name) for name in family.attention_producers], attn.head_dim
    if len(producers) > 1:
        return head_counts(producers[0], producers[1], hd)
    rows, per_kv_head = producers[0].out_features, attn.num_key_value_groups + 2
    if rows % (per_kv_head * hd):
        raise ValueError(f"the fused q|k|v projection has {rows} rows, not a multiple of "
                         f"(num_key_value_groups + 2)·head_dim = {per_kv_head * hd}")
    n_kv_heads = rows // (per_kv_head * hd)
    return n_kv_heads * attn.num_key_value_groups, n_kv_heads


def mlp_channels(mlp: MLPBlock, family: Family = LLAMA) -> int:
    """Intermediate channels of an MLP block: the gate rows (half of a fused gate|up projection's)."""
    rows = getattr(mlp, family.mlp_producers[0]).out_features
    return rows // 2 if len(family.mlp_producers) == 1 else rows


def prune_attention(attn: AttentionBlock, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                    o_bias: Tensor | None = None, *, family: Family = LLAMA, physical: bool = True) -> None:
    """Keep query heads ``kept_heads`` and kv heads ``kept_kv_heads`` of an attention block.

    q rows of the kept heads, k/v rows of the kept kv heads (inside a fused q|k|v: ``surgery.stacked``),
    o_proj d_out × len(kept_heads)·head_dim = ``o_weight`` (``surgery.rewrite``); physically, the module's
    counts follow (``num_key_value_groups``, ``num_key_value_heads``, Phi-3's config head count).
    ``physical=False`` zeroes instead of removing. ValueError for a family whose heads cannot be removed.
    """
    n_heads, n_kv_heads = attention_heads(attn, family)
    if family.head_pruning_refused and len(kept_heads) < n_heads:
        raise ValueError(f"{family.name}: attention heads cannot be pruned: {family.head_pruning_refused}")
    q_rows, kv_rows, groups = head_rows(n_heads, n_kv_heads, attn.head_dim, kept_heads, kept_kv_heads)
    producers = [getattr(attn, name) for name in family.attention_producers]
    rows = [stacked(q_rows, kv_rows, kv_rows)] if len(producers) == 1 else [q_rows, kv_rows, kv_rows]
    rewrite(list(zip(producers, rows, strict=True)), attn.o_proj, q_rows, o_weight, o_bias, physical=physical)
    if physical:
        attn.num_key_value_groups = groups
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = len(kept_kv_heads)
        if family.counts_in_config:
            attn.config = ConfigOverride(attn.config, num_attention_heads=len(kept_heads))


def mask_attention(attn: AttentionBlock, kept_heads: Tensor, kept_kv_heads: Tensor, o_weight: Tensor,
                   o_bias: Tensor | None = None, *, family: Family = LLAMA) -> None:
    """Same-shape counterpart of ``prune_attention``: zero the pruned q/k/v rows and o_proj columns."""
    prune_attention(attn, kept_heads, kept_kv_heads, o_weight, o_bias, family=family, physical=False)


def prune_mlp(mlp: MLPBlock, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None, *,
              family: Family = LLAMA, physical: bool = True) -> None:
    """Keep intermediate channels ``kept``: gate/up rows (inside a fused gate|up: ``surgery.stacked``),
    down_proj d_out × len(kept) = ``down_weight``; ``physical=False`` zeroes instead of removing."""
    channels = channel_rows(kept, mlp_channels(mlp, family))
    producers = [getattr(mlp, name) for name in family.mlp_producers]
    rows = [stacked(channels, channels)] if len(producers) == 1 else [channels] * len(producers)
    rewrite(list(zip(producers, rows, strict=True)), mlp.down_proj, channels, down_weight, down_bias,
            physical=physical)
    if physical and hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(kept)


def mask_mlp(mlp: MLPBlock, kept: Tensor, down_weight: Tensor, down_bias: Tensor | None = None, *,
             family: Family = LLAMA) -> None:
    """Same-shape counterpart of ``prune_mlp``: zero the pruned gate/up rows and down_proj columns."""
    prune_mlp(mlp, kept, down_weight, down_bias, family=family, physical=False)


class LlamaLikeLayer(LayerView):
    """A decoder layer of a Llama-like family (``FAMILY``, set by ``views``)."""

    FAMILY: Family
    PROJECTIONS = CONSUMERS

    @property
    def PARTS(self) -> tuple[str, ...]:
        return self.FAMILY.parts

    @classmethod
    def problem(cls, layer: nn.Module) -> str | None:
        family = cls.FAMILY
        for module, block_name in BLOCKS.items():
            block = getattr(layer, block_name, None)
            names = (*family.producers(module), CONSUMERS[module])
            problem = _linear_problem(block, block_name, names)
            if problem:
                return problem
            extra = _unknown_parameters(cast(nn.Module, block),  # not None: it has the linears
                                        (*names, *(family.head_norms if module == "attention" else ())))
            if extra:
                what = "a mixture of experts" if module == "mlp" else "parameters this family does not know"
                return f"{block_name} has {', '.join(extra)} ({what})"
        children = {name for name, _ in layer.named_children()}
        missing = [name for name in family.parts if name not in children]
        if missing:
            return f"no {', '.join(missing)}"
        unknown_norms = sorted(name for name in children - set(family.parts) if "norm" in name)
        if unknown_norms:
            return f"norms {', '.join(unknown_norms)} that {family.name} does not have"
        attn = cast(AttentionBlock, layer.self_attn)
        if not all(hasattr(attn, a) for a in ("head_dim", "num_key_value_groups")):
            return "self_attn has no head_dim / num_key_value_groups attributes"
        if family.head_pruning_refused is None:
            for name in family.head_norms:
                width = getattr(attn, name).weight.numel()
                if width != attn.head_dim:
                    return f"self_attn.{name} has width {width}, not head_dim={attn.head_dim}: it spans several heads"
        return None

    def block(self, module: str) -> nn.Module:
        return getattr(self.layer, BLOCKS[check_module(module)])

    @property
    def _attention(self) -> AttentionBlock:
        return cast(AttentionBlock, self.layer.self_attn)

    @property
    def _mlp(self) -> MLPBlock:
        return cast(MLPBlock, self.layer.mlp)

    def producers(self, module: str) -> tuple[nn.Linear, ...]:
        block = self.block(module)
        return tuple(getattr(block, name) for name in self.FAMILY.producers(module))

    def norm(self, module: str) -> nn.Module:
        if not self.FAMILY.pre_norms:
            raise ValueError(f"{self.FAMILY.name} layers have no norm before their blocks (post-norms only)")
        return getattr(self.layer, self.FAMILY.pre_norms[list(BLOCKS).index(check_module(module))])

    def post_norm(self, module: str) -> nn.Module | None:
        name = self.FAMILY.post_norm(module)
        return None if name is None else getattr(self.layer, name)

    def refusal(self, module: str) -> str | None:
        return self.FAMILY.head_pruning_refused if check_module(module) == "attention" else None

    @property
    def geometry(self) -> LayerGeometry:
        """Heads from the attention's q/k rows (``attention_heads``), channels from the MLP's gate rows."""
        attn = self._attention
        n_heads, n_kv_heads = attention_heads(attn, self.FAMILY)
        return LayerGeometry(n_heads, n_kv_heads, attn.head_dim, mlp_channels(self._mlp, self.FAMILY))

    def prune_heads(self, kept_heads: Tensor, kept_kv_heads: Tensor, weight: Tensor, bias: Tensor | None = None,
                    *, physical: bool = True) -> None:
        prune_attention(self._attention, kept_heads, kept_kv_heads, weight, bias, family=self.FAMILY,
                        physical=physical)

    def prune_channels(self, kept: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                       physical: bool = True) -> None:
        prune_mlp(self._mlp, kept, weight, bias, family=self.FAMILY, physical=physical)


class LlamaLikeModel(ModelView):
    """A causal LM of a Llama-like family: ``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``."""

    FAMILY: Family
    LAYER: type[LlamaLikeLayer]

    @classmethod
    def handles(cls, model_type: str | None) -> bool:
        return model_type in cls.FAMILY.model_types

    @classmethod
    def problem(cls, model: nn.Module) -> str | None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if not cls.handles(model_type):
            return f"model_type {model_type!r} is not one of {cls.FAMILY.name}'s ({', '.join(cls.FAMILY.model_types)})"
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            return "no decoder layers at model.model.layers"
        for i, layer in enumerate(layers):
            problem = cls.LAYER.problem(layer)
            if problem:
                return f"layer {i}: {problem}"
        return None

    @property
    def family(self) -> Family:
        return self.FAMILY

    @property
    def _base(self) -> DecoderStack:
        return cast(DecoderStack, self.model.model)

    @property
    def layers(self) -> nn.ModuleList:
        return self._base.layers

    @property
    def embeddings(self) -> nn.Embedding:
        return self._base.embed_tokens

    @property
    def front(self) -> list[nn.Module]:
        base = self._base
        return [base.embed_tokens, *(m for name, m in base.named_children() if name.startswith("rotary_emb"))]

    @property
    def final_norm(self) -> nn.Module:
        return self._base.norm

    @final_norm.setter
    def final_norm(self, norm: nn.Module) -> None:
        self._base.norm = norm

    @property
    def lm_head(self) -> nn.Linear:
        return cast(nn.Linear, self.model.lm_head)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self._base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)
        config = self.model.config
        cap = getattr(config, self.FAMILY.logit_softcapping, None) if self.FAMILY.logit_softcapping else None
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        divisor = getattr(config, self.FAMILY.logit_divisor, None) if self.FAMILY.logit_divisor else None
        return logits / divisor if divisor is not None else logits


@cache
def views(family: Family) -> type[LlamaLikeModel]:
    """The ``ModelView`` class of ``family`` (its ``LAYER`` the ``LayerView`` class), one per family."""
    layer = type(f"{family.name}Layer", (LlamaLikeLayer,), {"FAMILY": family, "__module__": __name__})
    supported = f"{family.name} ({', '.join(family.model_types)})"
    return type(f"{family.name}Model", (LlamaLikeModel,),
                {"FAMILY": family, "LAYER": layer, "SUPPORTED": supported, "__module__": __name__})
