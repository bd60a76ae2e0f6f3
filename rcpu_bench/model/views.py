"""What the harness asks of a decoder model, whatever its family: per-layer and model-level views.

A decoder layer has two prunable modules (:data:`MODULES`): ``"attention"``,
whose pruned projection (the *consumer*) is the output projection, its input columns grouped into query
heads of ``head_dim``; and ``"mlp"``, whose consumer is the down projection, one column per intermediate
channel. The *producers* are the projections whose output rows go with those columns (docs/methods.md §1):
query, key and value rows for a head or key/value group, gate and up rows for a channel.

A family (``rcpu_bench.model.llama``, the Llama-like base of ``rcpu_bench.model.families``) subclasses
``LayerView`` and ``ModelView`` and names its modules;
``rcpu_bench.model.adapter`` lists the families. Everything else here (geometry, units, their parameter
cost, applying a selection) follows from the projections' current shapes, because layers differ after
pruning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rcpu_bench.model.surgery import heads_of_columns
from rcpu_bench.selection.select import Selection, UnitMap

MODULES = ("attention", "mlp")  # the prunable modules of a decoder layer: heads (o_proj) and channels (down_proj)
GQA_RULES = ("group", "query")


@dataclass(frozen=True)
class LayerGeometry:
    """Head and channel counts of one decoder layer, read from its current weight shapes."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def queries_per_group(self) -> int:
        """Query heads served by one key/value head: n_heads / n_kv_heads (1 for multi-head attention)."""
        return self.n_heads // self.n_kv_heads


class LayerView(ABC):
    """One decoder layer seen through its family: projections, geometry, units, and the removal of units."""

    PROJECTIONS: dict[str, str]  # module → attribute name of its consumer, e.g. {"attention": "o_proj", ...}

    def __init__(self, layer: nn.Module):
        self.layer = layer

    @property
    @abstractmethod
    def PARTS(self) -> tuple[str, ...]:
        """The names of a plain layer's children (its blocks and norms)."""

    @classmethod
    @abstractmethod
    def problem(cls, layer: nn.Module) -> str | None:
        """What stops this family from handling ``layer``, or None."""

    @abstractmethod
    def block(self, module: str) -> nn.Module:
        """The attention or MLP submodule of the layer."""

    @abstractmethod
    def producers(self, module: str) -> tuple[nn.Linear, ...]:
        """The projections whose output rows are removed with the consumer's columns (they read the norm's output)."""

    @abstractmethod
    def norm(self, module: str) -> nn.Module:
        """The normalisation the module's producers read (pre-norm layers)."""

    @property
    @abstractmethod
    def geometry(self) -> LayerGeometry:
        """Current head and channel counts."""

    @abstractmethod
    def prune_heads(self, kept_heads: Tensor, kept_kv_heads: Tensor, weight: Tensor, bias: Tensor | None = None,
                    *, physical: bool = True) -> None:
        """Keep query heads ``kept_heads`` and key/value heads ``kept_kv_heads`` (``rcpu_bench.model.surgery``)."""

    @abstractmethod
    def prune_channels(self, kept: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                       physical: bool = True) -> None:
        """Keep intermediate channels ``kept`` (``rcpu_bench.model.surgery``)."""

    def post_norm(self, module: str) -> nn.Module | None:
        """The norm the module's output goes through before the residual (Gemma's sandwich norms), or None."""
        return None

    def refusal(self, module: str) -> str | None:
        """Why the module's units cannot be removed exactly in this layer (OLMo-2's heads), or None."""
        return None

    def projection(self, module: str) -> nn.Linear:
        """The module's pruned projection (consumer), whose input columns the units are."""
        return getattr(self.block(check_module(module)), self.PROJECTIONS[module])

    def bias_key(self, module: str) -> str:
        """The name under which saved manifests record whether the consumer has a bias (e.g. ``o_proj_bias``)."""
        return f"{self.PROJECTIONS[check_module(module)]}_bias"

    def units(self, module: str, gqa_rule: str = "group") -> UnitMap:
        """Units of the attention consumer: key/value groups (head_dim × queries per group, rule "group") or query
        heads selected within their groups (rule "query"); of the MLP consumer: channels."""
        if check_module(module) == "mlp":
            return UnitMap(1)
        if gqa_rule not in GQA_RULES:
            raise ValueError(f"gqa_rule={gqa_rule!r}; allowed: {', '.join(GQA_RULES)}")
        geometry = self.geometry
        if gqa_rule == "group":
            return UnitMap(geometry.head_dim * geometry.queries_per_group)
        return UnitMap(geometry.head_dim, group_size=geometry.queries_per_group)

    def n_units(self, module: str, gqa_rule: str = "group") -> int:
        """How many units the module has under ``gqa_rule`` (:meth:`units`): its consumer's input columns over the
        unit size, i.e. key/value groups (rule "group") or query heads (rule "query") of the attention, channels
        of the MLP."""
        return self.projection(module).weight.shape[1] // self.units(module, gqa_rule).unit_size

    def unit_cost(self, module: str) -> float:
        """Weights removed with one unit ("group" rule): Σ over producers and consumer of their weights / units.

        For a Llama layer of width d: (2·queries per group + 2)·head_dim·d per key/value group, 3·d per channel.
        """
        linears = (*self.producers(module), self.projection(module))
        total, units = sum(linear.weight.numel() for linear in linears), self.n_units(module)
        if total % units:
            raise ValueError(f"{module}: {total} weights do not split into {units} equal units")
        return float(total // units)

    def apply(self, module: str, columns: Selection, weight: Tensor, bias: Tensor | None = None, *,
              physical: bool = True) -> None:
        """Shrink the module to the consumer's kept input ``columns`` (physically, or masked with ``physical=False``).

        ``weight`` is the compensated consumer weight over the kept columns (d_out × |K|, kept order), ``bias``
        its new bias (None keeps the existing one). Attention: the kept columns must be whole query heads; a
        key/value head is kept iff any of its query heads is (``surgery.check_head_groups`` checks the rest).
        """
        if check_module(module) == "mlp":
            self.prune_channels(columns.kept, weight, bias, physical=physical)
            return
        geometry = self.geometry
        kept_heads = heads_of_columns(columns.kept, geometry.head_dim)
        kept_kv_heads = torch.unique(kept_heads // geometry.queries_per_group)
        self.prune_heads(kept_heads, kept_kv_heads, weight, bias, physical=physical)


class ModelView(ABC):
    """A whole causal LM seen through its family: decoder layers, embeddings, head, and its config."""

    LAYER: type[LayerView]
    SUPPORTED: str  # a description of the models the family covers, for error messages

    def __init__(self, model: nn.Module):
        self.model = model

    @classmethod
    @abstractmethod
    def problem(cls, model: nn.Module) -> str | None:
        """What stops this family from handling ``model``, or None."""

    @classmethod
    @abstractmethod
    def handles(cls, model_type: str | None) -> bool:
        """Whether this family claims models of this ``config.model_type``."""

    @property
    @abstractmethod
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order (assignable: a method may replace a layer)."""

    @property
    @abstractmethod
    def embeddings(self) -> nn.Embedding:
        """The input token embeddings."""

    @property
    @abstractmethod
    def front(self) -> list[nn.Module]:
        """The modules that run before layer 0 (embeddings, rotary tables): what capture needs on the device."""

    @property
    @abstractmethod
    def final_norm(self) -> nn.Module:
        """The normalisation after the last layer."""

    @final_norm.setter
    @abstractmethod
    def final_norm(self, norm: nn.Module) -> None: ...

    @property
    @abstractmethod
    def lm_head(self) -> nn.Linear:
        """The output projection to the vocabulary."""

    @abstractmethod
    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The final-norm output h (batch, tokens, d) of the decoder on a right-padded batch, without a cache."""

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """The causal LM's logits of hidden states h (..., d): the LM head, then what the family applies to it;
        ``logits(hidden_states(ids, mask))`` is ``model(ids, attention_mask=mask).logits``, a row at a time if
        needed."""

    def layer(self, index: int) -> LayerView:
        """A view of decoder layer ``index``."""
        return self.LAYER(self.layers[index])

    def views(self) -> list[LayerView]:
        """A view of every decoder layer."""
        return [self.LAYER(layer) for layer in self.layers]


def check_module(module: str) -> str:
    """``module`` if it names a prunable module (one of ``MODULES``), else ValueError."""
    if module not in MODULES:
        raise ValueError(f"unknown module {module!r}; allowed: {', '.join(MODULES)}")
    return module
