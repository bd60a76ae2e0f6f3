"""The model adapter: which architecture families the harness handles, and the views of a model or a layer.

Everything that touches a model's modules (the pipeline, surgery, persistence, FLAP's AL-AM structure,
the SliceGPT plugin) goes through ``model_view(model)`` / ``layer_view(layer)``
(``rcpu_bench.model.views``); module names are known only to the families (``rcpu_bench.model.llama``,
the shared Llama-like base, and ``rcpu_bench.model.families``, each family's differences as data).

A model is handled by the family whose model types include its ``config.model_type`` (and whose layer
structure it has); a layer alone by the first family whose layer structure fits it (families with the same
layer structure have the same view). Model types in ``families.REFUSED`` (mixtures of experts) are refused
with what is missing. To add a Llama-like family: a module in ``rcpu_bench.model.families``; any other
family: subclass ``LayerView`` and ``ModelView`` and append the ``ModelView`` subclass to ``FAMILIES``.
"""

from __future__ import annotations

from torch import nn

from rcpu_bench.model import families
from rcpu_bench.model.llama import views
from rcpu_bench.model.views import LayerGeometry, LayerView, ModelView

FAMILIES: tuple[type[ModelView], ...] = tuple(views(family) for family in families.FAMILIES)


def supported() -> str:
    """What the families cover, for error messages."""
    return "; ".join(family.SUPPORTED for family in FAMILIES)


def _family(model: nn.Module) -> type[ModelView]:
    """The family that handles ``model``; ValueError naming the model class, the problem and what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in families.REFUSED:
        raise ValueError(f"unsupported architecture {type(model).__name__} (model_type {model_type!r}): "
                         f"{families.REFUSED[model_type]}; supported: {supported()}")
    problems = []
    for family in FAMILIES:
        problem = family.problem(model)
        if problem is None:
            return family
        problems.append(problem)
    matching = [p for p in problems if not p.startswith("model_type ")]  # the family of its model type, if any
    reason = matching[0] if matching else f"model_type {model_type!r} is not a supported family's"
    raise ValueError(f"unsupported architecture {type(model).__name__}: {reason}; supported: {supported()}")


def head_view(model: nn.Module) -> ModelView | None:
    """The view of ``model``'s decoder and LM head through the family of its model type (its layers unchecked: a
    whole-model method may have changed them), or None for a model type no family claims."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = next((f for f in FAMILIES if f.handles(model_type)), None)
    return None if family is None else family(model)


def check_architecture(model: nn.Module) -> None:
    """Raise ValueError, naming the model class and what is supported, unless a family handles ``model``."""
    _family(model)


def model_view(model: nn.Module) -> ModelView:
    """The view of ``model`` through its family."""
    return _family(model)(model)


def layer_view(layer: nn.Module) -> LayerView:
    """The view of one decoder layer through the first family whose layers it fits."""
    problems = []
    for family in FAMILIES:
        problem = family.LAYER.problem(layer)
        if problem is None:
            return family.LAYER(layer)
        problems.append(problem)
    raise ValueError(f"unsupported decoder layer {type(layer).__name__}: {'; '.join(problems)}; "
                     f"supported: {supported()}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a supported model."""
    return model_view(model).layers


def layer_geometries(model: nn.Module) -> list[LayerGeometry]:
    """The current geometry of every decoder layer."""
    return [view.geometry for view in model_view(model).views()]


def layer_geometry(layer: nn.Module) -> LayerGeometry:
    """The current geometry of one decoder layer."""
    return layer_view(layer).geometry


def check_prunable(model: nn.Module, modules: tuple[str, ...] | list[str]) -> None:
    """Raise ValueError, before any work, if a layer's ``modules`` cannot be pruned exactly (``LayerView.refusal``)."""
    for i, view in enumerate(model_view(model).views()):
        for module in modules:
            refusal = view.refusal(module)
            if refusal:
                raise ValueError(f"cannot prune {module} of {type(model).__name__} (layer {i}): {refusal}")
