"""The paper's recipes, defined once, and the one rule that names a run from its final configuration.

Glossary ("method" alone is ambiguous; the code says which one it means):

- *scorer*, *compensator*: a function registered in the plugin registry (``rcpu-bench plugins``);
- *whole-model method*: a registered function that prunes the whole model instead (the ``model_method``
  option, e.g. SliceGPT);
- *recipe*: a named configuration of the paper's tables (:class:`Recipe`, e.g. RCPU (Rot.) = variance
  scorer × procrustes compensator, every other recipe option at its default); its *key* (``rcpu-rot``) is
  what a matrix lists, its *label* (``RCPU (Rot.)``) what the tables show;
- *method entry*: an item of a matrix's ``methods:`` list: a recipe key, a named custom configuration or a
  scorers × compensators product (:mod:`rcpu_bench.matrix.spec`);
- *label*: the name a cell carries (:func:`method_label`), computed from the final configuration, after the
  recipe's values, the entry's fields and the matrix's ``prune:`` overrides are merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rcpu_bench.pruning.options import BY_NAME, MODULES, RECIPE_OPTIONS

__all__ = ["CUSTOM", "MODULES", "RECIPES", "Recipe", "cell_label", "get_recipe", "label_of", "method_label",
           "percent", "recipe_of"]
CUSTOM = "custom"  # the key of a cell whose final configuration is no recipe, or that a matrix named itself


@dataclass(frozen=True)
class Recipe:
    """A named configuration of the paper: the option values it sets (the others keep their defaults).

    ``identity`` lists the options that decide whether a run is this recipe; by default the options it sets
    and every recipe option (:data:`rcpu_bench.pruning.options.RECIPE_OPTIONS`).
    """

    key: str
    label: str
    prune: dict[str, Any] = field(default_factory=dict)
    identity: tuple[str, ...] | None = None

    def matches(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` is this recipe: the options it sets equal, its other identity options at their default."""
        names = self.identity or (*self.prune, *RECIPE_OPTIONS)
        return all(config[name] == self.prune.get(name, BY_NAME[name].default) for name in names)


RECIPES: dict[str, Recipe] = {r.key: r for r in (
    # Nothing is pruned, so no other option matters.
    Recipe("original", "Original", {"ratio": 0.0, "compensator": "none"}, identity=("ratio", "model_method")),
    Recipe("wanda-sp", "WANDA-sp", {"scorer": "wanda-sp", "compensator": "none"}),
    Recipe("flap", "FLAP", {"scorer": "flap-wifv", "compensator": "flap-bias", "structure": "al-am",
                            "statistics": "one-shot"}),
    Recipe("ls-best", "Prop.Score+LS (lambda_best)", {"scorer": "variance", "compensator": "ridge"}),
    # Ridge at SparseGPT's damping λ = 0.01·mean diag G_KK instead of a λ grid: its own row, not a λ_best candidate.
    Recipe("ls-damped", "Prop.Score+LS (damped)",
           {"scorer": "variance", "compensator": "ridge", "compensator_params": {"lam": 0.0, "lam_rel": 0.01}}),
    Recipe("rcpu-rot", "RCPU (Rot.)", {"scorer": "variance", "compensator": "procrustes"}),
    Recipe("rcpu-rot-scale", "RCPU (Rot.+Scale)", {"scorer": "variance", "compensator": "scaled-procrustes"}),
    # The official code's numerics on purpose (docs/methods.md §7): γ with mean|x|, M formed in float32,
    # torch.linalg.svd's default driver; its orthogonality error is recorded instead of checked.
    Recipe("rcpu-official", "RCPU (Rot., official numerics)",
           {"scorer": "variance", "scorer_params": {"activation": "mean-abs"}, "compensator": "procrustes",
            "compensator_params": {"dtype": "float32", "solver": "official"}}),
    # Needs the rcpu-slicegpt plugin (plugins/rcpu-slicegpt): ratio = sliced hidden fraction, or parameters removed.
    Recipe("slicegpt", "SliceGPT", {"model_method": "slicegpt"}, identity=("model_method", "model_method_params")),
    Recipe("slicegpt-params", "SliceGPT (param. budget)",
           {"model_method": "slicegpt", "model_method_params": {"budget": "params"}},
           identity=("model_method", "model_method_params")),
    # Depth baselines (rcpu_bench/methods/depth/): whole layers, as many as width pruning at the ratio removes.
    Recipe("shortgpt", "ShortGPT", {"model_method": "shortgpt"}, identity=("model_method", "model_method_params")),
    Recipe("replaceme", "ReplaceMe (LS)", {"model_method": "replaceme"},
           identity=("model_method", "model_method_params")),
)}


def get_recipe(key: str) -> Recipe:
    if key not in RECIPES:
        raise KeyError(f"unknown recipe {key!r}; known recipes: {', '.join(RECIPES)}")
    return RECIPES[key]


def recipe_of(config: Mapping[str, Any]) -> Recipe | None:
    """The recipe a final configuration (PruneConfig fields) is, or None.

    When several match, the most specific (most options set) wins, the first listed among equals: an
    rcpu-official run also matches rcpu-rot, which sets fewer options.
    """
    matches = [recipe for recipe in RECIPES.values() if recipe.matches(config)]
    return max(matches, key=lambda recipe: len(recipe.prune)) if matches else None


def label_of(config: Mapping[str, Any]) -> str | None:
    """The label of the recipe a final configuration is, or None."""
    recipe = recipe_of(config)
    return recipe.label if recipe else None


def method_label(config: Mapping[str, Any], name: str | None = None) -> str:
    """A cell's label: the name a matrix gave its method entry, else the recipe's label, else a description.

    The description is ``scorer+compensator`` (or the whole-model method) followed by the recipe options set
    away from their default, e.g. ``variance+procrustes [statistics=one-shot]``.
    """
    if name is not None:
        return name
    recipe = recipe_of(config)
    if recipe is not None:
        return recipe.label
    head = config["model_method"] or f"{config['scorer']}+{config['compensator']}"
    changed = [f"{key}={config[key]}" for key in RECIPE_OPTIONS
               if key not in ("scorer", "compensator", "model_method") and config[key] != BY_NAME[key].default]
    return f"{head} [{', '.join(changed)}]" if changed else head


def cell_label(cell: Mapping[str, Any]) -> str:
    """The label of a stored matrix cell by today's rule: a name the matrix gave (key ``custom``) is kept, any
    other label is recomputed from the cell's final configuration (stores written before the rule may differ)."""
    return method_label(cell["prune"], cell["method_label"] if cell["method"] == CUSTOM else None)


def percent(ratio: float) -> str:
    """A pruning ratio as the tables, plots and plans write it: 0.25 -> ``25%``."""
    return f"{round(ratio * 100, 6):g}%"
