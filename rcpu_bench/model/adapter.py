"""The model adapter: which architecture families the harness handles, and the views of a model or a layer.

Everything that touches a model's modules (the pipeline, surgery, persistence, FLAP's AL-AM structure,
the SliceGPT plugin) goes through ``model_view(model)`` / ``layer_view(layer)``
(``rcpu_bench.model.views``); module names are known only to the family (``rcpu_bench.model.llama``).

To add a family: subclass ``LayerView`` and ``ModelView`` (its projections, blocks, norms, geometry and the
removal of heads and channels through ``rcpu_bench.model.surgery``; its decoder layers, embeddings, head
and saved config) and append the ``ModelView`` subclass to ``FAMILIES``. The first family whose
``problem`` is None handles a model.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from rcpu_bench.model.llama import LlamaModel
from rcpu_bench.model.views import LayerGeometry, LayerView, ModelView

FAMILIES: tuple[type[ModelView], ...] = (LlamaModel,)


def supported() -> str:
    """What the families cover, for error messages."""
    return "; ".join(family.SUPPORTED for family in FAMILIES)


def _family(model: nn.Module) -> type[ModelView]:
    """The first family that handles ``model``; ValueError naming the model class, the problem and what is supported."""
    problems = []
    for family in FAMILIES:
        problem = family.problem(model)
        if problem is None:
            return family
        problems.append(problem)
    raise ValueError(f"unsupported architecture {type(model).__name__}: {'; '.join(problems)}; "
                     f"supported: {supported()}")


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


def layer_geometries(model: PreTrainedModel) -> list[LayerGeometry]:
    """The current geometry of every decoder layer."""
    return [view.geometry for view in model_view(model).views()]


def layer_geometry(layer: nn.Module) -> LayerGeometry:
    """The current geometry of one decoder layer."""
    return layer_view(layer).geometry
