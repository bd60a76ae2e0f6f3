"""The options of a pruning run, each declared once (:data:`OPTIONS`), and what is derived from the declaration.

An :class:`rcpu_bench.declaration.Option` (the mechanism shared with :class:`rcpu_bench.experiment.Experiment`) holds a
:class:`PruneConfig` field's name, default, kind of value (which fixes how it is parsed and checked), allowed
choices, help text, whether it enters a cell id always or only when set away from its default (options added
after results were stored, so that stored ids stay valid) and whether it
belongs to a recipe's identity (:func:`rcpu_bench.pruning.methods.recipe_of`: a run is a paper recipe only
when every such option it does not set keeps its default). From the declaration come the dataclass
:class:`PruneConfig` (its fields and defaults), :meth:`PruneConfig.validate`, the ``rcpu-bench prune`` flags
(:func:`add_arguments`, :func:`from_args`), the YAML reader of the matrices (:func:`coerce`), the README's
option table (:func:`markdown_table`) and the cell-id rule (:data:`HASHED_WHEN_SET`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from rcpu_bench.declaration import Option, add_argument, declared, option
from rcpu_bench.declaration import markdown_table as options_table
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.views import MODULES
from rcpu_bench.pruning.allocation import AL_AM, UNIFORM
from rcpu_bench.selection.select import Rounding, kept_multiple, n_pruned
from rcpu_bench.statistics.activations import GramPrecision

if TYPE_CHECKING:
    from torch import nn

    from rcpu_bench.model.views import LayerGeometry
    from rcpu_bench.registry import Registry


@dataclass
class PruneConfig:
    """Everything that decides how a model is pruned; recorded verbatim with every result."""

    scorer: str = option("name", "variance", "a registered scorer or selector (e.g. obs): which heads / channels to "
                         "prune", recipe=True)
    compensator: str = option("name", "procrustes", "a registered compensator: how the kept weights absorb the "
                              "pruning error", recipe=True)
    ratio: float = option("ratio", 0.2, "structural ratio ρ ∈ [0, 1): ⌊ρ·units⌋ heads (or key/value groups) "
                          "and channels pruned per layer")
    scorer_params: dict[str, Any] = option("params", {}, "the scorer's parameters, e.g. activation='mean-abs'")
    compensator_params: dict[str, Any] = option("params", {}, "the compensator's parameters, e.g. lam=1e-2, "
                                                "dtype='float32'")
    rounding: Rounding = option("choice", "floor", "units pruned: ⌊ρ·n⌋ as the official code (floor) or ⌈ρ·n⌉ as "
                                "the paper's text (ceil)", recipe=True)
    prune: tuple[str, ...] = option("modules", MODULES, "modules to prune, comma-separated, or none")
    compensate: tuple[str, ...] = option("modules", MODULES, "pruned modules to compensate, comma-separated, or "
                                         "none; the paper's ablation compensates one of them")
    # Not a recipe option: which units a GQA model's attention has is the setting's, not the method's (a method
    # pruning query heads within groups is the same method).
    gqa_rule: Literal["group", "query"] = option("choice", "group", "group: prune whole key/value groups; query: "
                                                 "the same number of query heads in every group")
    head_aggregation: Literal["sum", "standardized-mean"] = option(
        "choice", "sum", "head score = sum of its column scores (RCPU) or mean of standardized scores (FLAP)",
        recipe=True)
    statistics: Literal["sequential", "one-shot"] = option(
        "choice", "sequential", "statistics from the already pruned model (RCPU), or from the dense model (FLAP)",
        recipe=True)
    structure: Literal["uniform", "al-am"] = option(
        "choice", "uniform", "uniform ratio per layer, or FLAP's global adaptive structure (= allocation al-am)",
        recipe=True)
    recollect_mlp: bool = option("flag", False, "re-collect down_proj statistics after attention is pruned (not "
                                 "RCPU's default)", recipe=True)
    offload: bool = option("flag", False, "while pruning, keep the model in CPU memory and move each decoder layer "
                           "(and the embeddings, for the layer-0 inputs) to the device only while it is pruned; "
                           "this lowers the device memory of pruning only: the pruned model is then moved to the "
                           "device whole for evaluation, so it must fit there; the moves are timed as the phase "
                           "'offload'")
    batch_size: int = option("count", 8, "calibration sequences per forward pass (does not change the result)",
                             cli="--calib-batch-size")
    gram_precision: GramPrecision = option(
        "choice", "mixed", "G = Σ x xᵀ and C = Σ y xᵀ from float32 block products summed into float64, ‖Y‖² from "
        "the module outputs (mixed: about 3-4x faster on CPU, relative error ~1e-7), or every product in float64 "
        "from G alone (the reference)", hashed="when-set")
    model_method: str | None = option("name", None, "a registered whole-model method (e.g. slicegpt) instead of "
                                      "scorer × compensator", hashed="when-set", recipe=True)
    model_method_params: dict[str, Any] = option("params", {}, "the whole-model method's parameters, e.g. "
                                                 "budget='params'", hashed="when-set", recipe=True)
    allocation: str = option("name", "uniform", "units pruned per layer: uniform, al-am (stored as structure=al-am), "
                             "log-increase (SlimGPT) or a registered allocation; the mean layer ratio is ratio",
                             hashed="when-set", recipe=True)
    allocation_params: dict[str, Any] = option("params", {}, "the allocation's parameters, e.g. spread=0.5",
                                               hashed="when-set", recipe=True)
    holdout: int = option("windows", 0, "held-out calibration windows, disjoint from the calibration ones: record "
                          "each module's calibration and held-out reconstruction error (record['generalisation'])",
                          hashed="when-set")
    round_to: int = option("multiple", 0, "round each pruned module's kept width (o_proj / down_proj input columns) "
                           "to the nearest multiple of N channels, with whole units (heads of a key/value group, "
                           "channels), for the inference kernels' sake (e.g. 32 for llama.cpp's q8_0, 64, 128); "
                           "0: off", hashed="when-set")

    def __post_init__(self) -> None:
        """``allocation='al-am'`` is FLAP's adaptive structure, the ``structure`` option that came first: store it
        as ``structure='al-am'`` so that both spellings give one cell id (that of the cells already stored)."""
        if self.allocation == AL_AM:
            if self.structure not in ("uniform", AL_AM):
                raise ValueError(f"allocation='al-am' with structure={self.structure!r}; allowed: structure "
                                 "'uniform' or 'al-am'")
            self.structure, self.allocation = AL_AM, UNIFORM

    @property
    def pruned_modules(self) -> tuple[str, ...]:
        """The modules this run prunes, in the order it prunes them (:data:`MODULES`: attention, then the MLP)."""
        return tuple(module for module in MODULES if module in self.prune)

    def validate(self, registry: Registry) -> None:
        """Raise a clear error for any bad value before work starts: each option's own check, then the registry's."""
        for declared_option in OPTIONS:
            declared_option.check(getattr(self, declared_option.name))
        grouped = self.gqa_rule == "query" and "attention" in self.prune and self.model_method is None
        registry.selection(self.scorer).validate(self.scorer_params, group_size=2 if grouped else 1)
        if self.structure == AL_AM and (self.allocation != UNIFORM or self.allocation_params):
            raise ValueError(f"structure='al-am' is itself the allocation; got allocation={self.allocation!r} "
                             f"with {self.allocation_params}; allowed: allocation 'uniform' or 'al-am', no parameters")
        registry.allocation(self.allocation).validate(self.allocation_params)
        registry.compensator(self.compensator).validate(self.compensator_params)
        if self.model_method is not None:
            registry.get("model-method", self.model_method).validate(self.model_method_params)
            if self.offload:
                raise ValueError(f"offload=True is not supported with the whole-model method {self.model_method!r}")
        if self.structure == "al-am" and self.gqa_rule == "query":
            raise ValueError("gqa_rule='query' is not allowed with structure='al-am', which prunes whole key/value "
                             "groups; allowed: gqa_rule='group'")
        if self.holdout and (self.model_method is not None or self.recollect_mlp):
            raise ValueError(f"holdout={self.holdout} needs the layer-wise pipeline without recollect_mlp; allowed: "
                             "holdout=0 with a whole-model method or recollect_mlp")
        if self.round_to and (self.model_method is not None or self.gqa_rule != "group"):
            raise ValueError(f"round_to={self.round_to} needs the layer-wise pipeline with gqa_rule='group'; "
                             "allowed: round_to=0 with a whole-model method or gqa_rule='query'")
        if self.round_to and registry.selection(self.scorer).kind == "selector" and self.structure != AL_AM:
            raise ValueError(f"round_to={self.round_to} rounds by unit scores, which the selector {self.scorer!r} does "
                             "not give; allowed: round_to=0 with a selector, or a scorer")

    def check_budget(self, skeleton: nn.Module, registry: Registry) -> None:
        """Raise a clear error for every limit the model's shape decides, before its weights load: the units each
        layer loses under the allocation (``check_units``), ``round_to`` against each module's units, and a whole-model
        method's own check of the model at the ratio (its ``check=``: a depth method's layer count, say);
        ``skeleton`` may be weightless (meta)."""
        geometries = layer_geometries(skeleton)
        self.check_units(geometries, self.layer_ratios(registry, len(geometries)))
        if self.round_to:
            self._check_round_to(geometries)
        method = registry.get("model-method", self.model_method) if self.model_method is not None else None
        if method is not None and method.check is not None:
            method.check(skeleton, ratio=self.ratio)

    def layer_ratios(self, registry: Registry, n_layers: int) -> list[float] | None:
        """The allocation profile's per-layer ratios, computed as the pipeline computes them (so a budget it cannot
        meet, log-increase's last layer at ratio >= 1 say, fails now), or None where the counts are chosen on the
        model itself: a whole-model method, AL-AM, or a model allocation."""
        if self.model_method is not None or self.structure != "uniform":
            return None
        profile = registry.allocation(self.allocation)(n_layers, self.ratio, **self.allocation_params)
        return None if callable(profile) else profile.tolist()

    def check_units(self, geometries: Sequence[LayerGeometry], ratios: Sequence[float] | None = None) -> None:
        """Raise a clear error, before pruning, if the ratio would prune every unit of some layer's module.

        The units one selection chooses from: key/value groups or MLP channels, or under ``gqa_rule='query'`` the
        query heads of one group. ``n_pruned(n, ρ) < n`` always holds with floor rounding (ρ < 1); with ceil it
        needs ρ ≤ (n − 1)/n. ``ratios``: each layer's ratio under the allocation (default: ``ratio`` everywhere).
        FLAP's global structure and whole-model methods choose their own counts.
        """
        if self.model_method is not None or self.structure != "uniform":
            return
        for module in self.prune:
            self._check_prunable(module, geometries)
        for index, (geometry, ratio) in enumerate(zip(geometries, ratios or [self.ratio] * len(geometries),
                                                      strict=True)):
            for module in self.prune:
                n, what = selection_units(geometry, module, self.gqa_rule)
                try:
                    n_pruned(n, ratio, self.rounding)
                except ValueError:
                    bound = f"ratio <= {n - 1}/{n} = {(n - 1) / n:.4g}" if n > 1 else "ratio=0"
                    given = (f"ratio={ratio}" if ratio == self.ratio else
                             f"allocation {self.allocation!r} at ratio={self.ratio} gives layer {index} ratio "
                             f"{ratio:.4g}, which")
                    raise ValueError(f"{given} with rounding={self.rounding!r} would prune all {n} {what} "
                                     f"of layer {index}'s {module}; allowed: {bound}, or rounding='floor'") from None

    def _check_round_to(self, geometries: Sequence[LayerGeometry]) -> None:
        """Raise when some pruned module's whole units cannot make a kept width that is a multiple of ``round_to``
        channels: that takes round_to / gcd(round_to, unit size) units (``kept_multiple``)."""
        for index, geometry in enumerate(geometries):
            for module in self.prune:
                n, what = selection_units(geometry, module, self.gqa_rule)
                size = geometry.head_dim * geometry.queries_per_group if module == "attention" else 1
                needed = kept_multiple(self.round_to, size)
                if n < needed:
                    raise ValueError(f"round_to={self.round_to}: a multiple of {self.round_to} channels takes "
                                     f"{needed} {what} of {size} channels, and layer {index}'s {module} has {n}; "
                                     f"allowed: 0, or a round_to of at most {n * size} whose multiples whole units "
                                     f"make (round_to / gcd(round_to, {size}) <= {n})")

    def _check_prunable(self, module: str, geometries: Sequence[LayerGeometry]) -> None:
        """Raise when ``module`` is asked to be pruned but its selection has a single unit in every layer (one
        key/value group under the group rule, one query head per group under the query rule): no ratio below 1
        can prune it."""
        units = {selection_units(geometry, module, self.gqa_rule) for geometry in geometries}
        if self.ratio == 0 or any(n > 1 for n, _ in units):
            return
        what = next(iter(units))[1]
        other = {"group": "gqa_rule='query' (--gqa-rule query: query heads within the group)",
                 "query": "gqa_rule='group' (--gqa-rule group: whole heads or key/value groups)"}[self.gqa_rule]
        hint = f"{other} or prune=('mlp',) (--prune mlp)" if module == "attention" else "prune without this module"
        raise ValueError(f"the model's {module} has a single unit to choose from in every layer ({what}: 1, under "
                         f"gqa_rule={self.gqa_rule!r}), so no ratio below 1 prunes it; allowed: {hint}")

    def unpruned_modules(self, geometries: Sequence[LayerGeometry]) -> list[str]:
        """The modules asked to be pruned that lose no unit in any layer at this ratio (⌊ρ·n⌋ = 0 everywhere), under
        a uniform per-layer ratio; other allocations and whole-model methods choose their own counts."""
        if (self.ratio == 0 or self.model_method is not None or self.structure != "uniform"
                or self.allocation != UNIFORM):
            return []
        return [module for module in self.prune
                if all(n_pruned(selection_units(g, module, self.gqa_rule)[0], self.ratio, self.rounding) == 0
                       for g in geometries)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> dict[str, Any]:
        """The configuration as JSON data (tuples as lists), as cells and records store it."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def selection_units(geometry: LayerGeometry, module: str, gqa_rule: str) -> tuple[int, str]:
    """How many units one selection of ``module`` chooses from, and what they are."""
    if module == "mlp":
        return geometry.intermediate, "MLP channels"
    if gqa_rule == "query":
        return geometry.queries_per_group, "query heads of a key/value group"
    return geometry.n_kv_heads, "key/value groups" if geometry.queries_per_group > 1 else "heads"


OPTIONS: tuple[Option, ...] = declared(PruneConfig)
BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
# Options added after results were stored, with their default: a cell id hashes them only when set away from it.
HASHED_WHEN_SET: dict[str, Any] = {o.name: o.default for o in OPTIONS if o.hashed == "when-set"}
# The options that make a run another recipe when set away from their default (method labels, plots).
RECIPE_OPTIONS: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.recipe)


def is_default_pipeline(config: Mapping[str, Any]) -> bool:
    """Whether a configuration runs the RCPU pipeline: every recipe option but the scorer and compensator at its
    default (what the plots compare: scorer × compensator on the same pipeline)."""
    return all(config[name] == BY_NAME[name].default for name in RECIPE_OPTIONS
               if name not in ("scorer", "compensator"))


def as_field_type(option: Option, value: Any) -> Any:
    """A stored or YAML value of ``option`` as the field's type (lists of modules as tuples), not checked."""
    if option.kind == "modules" and isinstance(value, (list, tuple, str)):
        return tuple([value] if isinstance(value, str) else value)
    return value


def coerce(name: str, value: Any) -> Any:
    """A stored or YAML value of option ``name`` as the field's type (:func:`as_field_type`), checked."""
    if name not in BY_NAME:
        raise KeyError(f"unknown option {name!r}; options: {', '.join(BY_NAME)}")
    value = as_field_type(BY_NAME[name], value)
    BY_NAME[name].check(value)
    return value


def from_dict(mapping: Mapping[str, Any]) -> PruneConfig:
    """A PruneConfig from a mapping of options (as recorded, or read from YAML), each coerced and checked."""
    return PruneConfig(**{name: coerce(name, value) for name, value in mapping.items()})


# ---------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option (:attr:`Option.flag`); parameters are repeatable ``KEY=VALUE`` pairs."""
    for declared_option in OPTIONS:
        add_argument(parser, declared_option)


def from_args(args: argparse.Namespace) -> PruneConfig:
    """The PruneConfig of parsed ``add_arguments`` flags (not yet validated against the registry)."""
    values: dict[str, Any] = {o.name: dict(getattr(args, o.name)) if o.kind == "params" else getattr(args, o.name)
                              for o in OPTIONS}
    return PruneConfig(**values)


# ------------------------------------------------------------------------------------------------ README


def markdown_table() -> str:
    """The README's table of ``rcpu-bench prune``'s run options, one row per option."""
    return options_table(OPTIONS)
