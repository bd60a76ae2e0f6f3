"""The paper's method names, defined once: each is a scorer × compensator × pipeline setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


MODULES = ("attention", "mlp")  # the prunable modules of a decoder layer: heads (o_proj) and channels (down_proj)


@dataclass(frozen=True)
class MethodAlias:
    """A named method of the paper's tables and the PruneConfig fields it stands for."""

    key: str
    label: str
    prune: dict[str, Any] = field(default_factory=dict)
    lambda_grid: bool = False  # ridge: run the λ grid and report λ_best (lowest calibration perplexity)


ALIASES: dict[str, MethodAlias] = {a.key: a for a in (
    MethodAlias("original", "Original", {"ratio": 0.0, "compensator": "none"}),
    MethodAlias("wanda-sp", "WANDA-sp", {"scorer": "wanda-sp", "compensator": "none"}),
    MethodAlias("flap", "FLAP", {"scorer": "flap-wifv", "compensator": "flap-bias", "structure": "al-am",
                                 "statistics": "one-shot"}),
    MethodAlias("ls-best", "Prop.Score+LS (lambda_best)", {"scorer": "variance", "compensator": "ridge"},
                lambda_grid=True),
    MethodAlias("rcpu-rot", "RCPU (Rot.)", {"scorer": "variance", "compensator": "procrustes"}),
    MethodAlias("rcpu-rot-scale", "RCPU (Rot.+Scale)", {"scorer": "variance", "compensator": "scaled-procrustes"}),
    # The official code's numerics on purpose (methods-spec §2.1, §6 item 2): γ with mean|x|, M formed in float32,
    # torch.linalg.svd's default driver; its orthogonality error is recorded instead of checked.
    MethodAlias("rcpu-official", "RCPU (Rot., official numerics)",
                {"scorer": "variance", "scorer_params": {"activation": "mean-abs"}, "compensator": "procrustes",
                 "compensator_params": {"dtype": "float32", "solver": "official"}}),
    # Needs the rcpu-slicegpt plugin (plugins/rcpu-slicegpt): ratio = sliced hidden fraction, or parameters removed.
    MethodAlias("slicegpt", "SliceGPT", {"model_method": "slicegpt"}),
    MethodAlias("slicegpt-params", "SliceGPT (param. budget)",
                {"model_method": "slicegpt", "model_method_params": {"budget": "params"}}),
)}


def get_alias(key: str) -> MethodAlias:
    if key not in ALIASES:
        raise KeyError(f"unknown method {key!r}; known methods: {', '.join(ALIASES)}")
    return ALIASES[key]


def label_of(prune: dict[str, Any]) -> str | None:
    """The label of a recorded PruneConfig, or None when it matches no named method.

    When several aliases match, the most specific (most fields set) wins, the first listed among equals:
    an rcpu-official record also matches rcpu-rot, which sets fewer fields.
    """
    matches = [alias for alias in ALIASES.values()
               if all(prune.get(k) == v for k, v in alias.prune.items()) and _defaults_elsewhere(prune, alias)]
    return max(matches, key=lambda alias: len(alias.prune)).label if matches else None


def _defaults_elsewhere(prune: dict[str, Any], alias: MethodAlias) -> bool:
    """The fields an alias does not set keep their defaults (so e.g. a one-shot RCPU run is not 'RCPU')."""
    defaults = {"structure": "uniform", "statistics": "sequential", "model_method": None, "model_method_params": {}}
    return all(prune.get(k, v) == v for k, v in defaults.items() if k not in alias.prune)
