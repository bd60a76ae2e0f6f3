"""Layer-wise prune-and-compensate (the paper's Algorithm 1, in the official code's order).

For each decoder layer in turn:
  1. run the calibration inputs (outputs of the already pruned layers) through the dense layer while
     forward hooks stream the input statistics of o_proj and down_proj;
  2. score and select heads (or key/value groups) and MLP channels;
  3. compensate o_proj, then down_proj, both from that one dense pass (the official code's order);
  4. physically shrink the layer and re-run it to produce the next layer's inputs.
``statistics="one-shot"`` instead feeds every layer the dense model's activations (FLAP's protocol),
and ``structure="al-am"`` chooses all selections up front with FLAP's global adaptive structure.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from rcpu_bench.pruning.methods import MODULES
from rcpu_bench.model.loading import decoder_layers, layer_geometry
from rcpu_bench.registry import Registry, default_registry
from rcpu_bench.selection.scorers import unit_scores
from rcpu_bench.selection.select import Rounding, Selection, n_pruned, select_by_score, select_within_groups
from rcpu_bench.statistics.activations import ActivationStats, GramPrecision, check_gram_precision, collect_input_stats
from rcpu_bench.model.surgery import prune_attention, prune_mlp

_PROJ = {"attention": "o_proj", "mlp": "down_proj"}


@dataclass
class PruneConfig:
    """Everything that decides how a model is pruned; recorded verbatim with every result."""

    scorer: str = "variance"
    compensator: str = "procrustes"
    ratio: float = 0.2
    scorer_params: dict[str, Any] = field(default_factory=dict)
    compensator_params: dict[str, Any] = field(default_factory=dict)
    rounding: Rounding = "floor"
    prune: tuple[str, ...] = MODULES
    compensate: tuple[str, ...] = MODULES
    gqa_rule: Literal["group", "query"] = "group"
    head_aggregation: Literal["sum", "standardized-mean"] = "sum"
    statistics: Literal["sequential", "one-shot"] = "sequential"
    structure: Literal["uniform", "al-am"] = "uniform"
    recollect_mlp: bool = False
    offload: bool = False
    batch_size: int = 8
    gram_precision: GramPrecision = "mixed"  # G = Σ x xᵀ from float32 products ("mixed") or all float64 (stats.py)
    model_method: str | None = None  # a registered whole-model method (e.g. slicegpt) instead of scorer × compensator
    model_method_params: dict[str, Any] = field(default_factory=dict)

    def validate(self, registry: Registry) -> None:
        """Raise a clear error for any bad value before work starts."""
        registry.scorer(self.scorer).validate(self.scorer_params)
        registry.compensator(self.compensator).validate(self.compensator_params)
        n_pruned(100, self.ratio, self.rounding)
        if self.model_method is not None:
            registry.get("model-method", self.model_method).validate(self.model_method_params)
            if self.offload:
                raise ValueError(f"offload=True is not supported with the whole-model method {self.model_method!r}")
        choices = {"gqa_rule": ("group", "query"), "head_aggregation": ("sum", "standardized-mean"),
                   "statistics": ("sequential", "one-shot"), "structure": ("uniform", "al-am")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        for key in ("prune", "compensate"):
            bad = set(getattr(self, key)) - set(MODULES)
            if bad:
                raise ValueError(f"{key} has unknown module(s) {sorted(bad)}; allowed: {', '.join(MODULES)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        check_gram_precision(self.gram_precision)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerInput:
    """One calibration batch as layer 0 receives it: hidden states plus the model's layer kwargs."""

    hidden: Tensor
    kwargs: dict[str, Any]


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass after layer 0's inputs are recorded."""


class Timer:
    """Accumulates wall time per named section, synchronising the accelerator around each."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, input_ids: Tensor, batch_size: int, device: torch.device) -> list[LayerInput]:
    """Record what layer 0 receives (hidden states, attention mask, position embeddings) per batch.

    A pre-hook with kwargs captures the call and aborts the rest of the forward, which keeps working
    across transformers versions that change the layer signature (position_embeddings since 4.48).
    """
    captured: list[LayerInput] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(LayerInput(hidden, {k: v for k, v in kwargs.items() if k != "past_key_values"}))
        raise _Captured

    handle = decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in input_ids.split(batch_size):
            try:
                model(batch.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def _layer_output(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list[LayerInput]) -> list[Tensor]:
    """The layer's outputs for every calibration batch."""
    return [_layer_output(layer(x.hidden, **x.kwargs)) for x in inputs]


@dataclass
class UnitMap:
    """How one module's prunable units map to its input columns (heads/groups for o_proj, channels for down_proj)."""

    unit_size: int
    group_size: int = 1  # query heads per key/value group ("query" GQA rule); 1 otherwise

    def select(self, scores: Tensor, config: PruneConfig) -> Selection:
        units = unit_scores(scores, self.unit_size, config.head_aggregation)
        if self.group_size > 1:
            return select_within_groups(units, self.group_size, config.ratio, config.rounding)
        return select_by_score(units, config.ratio, config.rounding)


def unit_map(layer: nn.Module, module: str, gqa_rule: str) -> UnitMap:
    """Units of o_proj: kv groups (head_dim × queries per group) or query heads; of down_proj: channels."""
    if module == "mlp":
        return UnitMap(1)
    geometry = layer_geometry(layer)
    per_group = geometry.n_heads // geometry.n_kv_heads
    if gqa_rule == "group":
        return UnitMap(geometry.head_dim * per_group)
    return UnitMap(geometry.head_dim, group_size=per_group)


def _apply(layer: nn.Module, module: str, units: Selection, gqa_rule: str, weight: Tensor, bias: Tensor | None) -> None:
    """Physically shrink the layer to the kept units, writing the compensated weight (and bias)."""
    if module == "mlp":
        prune_mlp(layer.mlp, units.kept, weight, bias)
        return
    geometry = layer_geometry(layer)
    per_group = geometry.n_heads // geometry.n_kv_heads
    if gqa_rule == "group":
        kept_heads = units.columns(per_group).kept
        kept_kv = units.kept
    else:
        kept_heads = units.kept
        kept_kv = torch.arange(geometry.n_kv_heads, device=units.kept.device)
    prune_attention(layer.self_attn, kept_heads, kept_kv, weight, bias)


def _projection(layer: nn.Module, module: str) -> nn.Linear:
    return getattr(layer.self_attn if module == "attention" else layer.mlp, _PROJ[module])


def prune_module(layer: nn.Module, module: str, stats: ActivationStats, config: PruneConfig, registry: Registry,
                 timer: Timer, units: Selection | None = None) -> dict[str, Any]:
    """Score, select, compensate and shrink one module of one layer; returns its diagnostics."""
    proj = _projection(layer, module)
    mapping = unit_map(layer, module, config.gqa_rule)
    if units is None:
        with timer("score"):
            scores = registry.scorer(config.scorer)(proj.weight, stats, **config.scorer_params)
            units = mapping.select(scores, config)
    columns = units.columns(mapping.unit_size)
    name = config.compensator if module in config.compensate else "none"
    params = config.compensator_params if module in config.compensate else {}
    with timer("solve"):
        result = registry.compensator(name)(proj.weight, stats, columns.kept, columns.pruned, **params)
    _apply(layer, module, units, config.gqa_rule, result.weight, result.bias)
    return {"compensator": name, "units_total": len(units.kept) + len(units.pruned),
            "units_pruned": len(units.pruned), "pruned_units": units.pruned.tolist(), **result.info}


def _gram_modules(modules: list[str], config: PruneConfig, registry: Registry) -> list[str]:
    """Modules whose compensator needs G; the others collect only the cheaper moments."""
    if registry.compensator(config.compensator).needs != "gram":
        return []
    return [m for m in modules if m in config.compensate]


@contextmanager
def _on_device(layer: nn.Module, device: torch.device, offload: bool):
    """With offloading, only the current layer sits on the accelerator."""
    if offload:
        layer.to(device)
    try:
        yield
    finally:
        if offload:
            layer.to("cpu")


def _collect(layer: nn.Module, modules: list[str], inputs: list[LayerInput], gram_modules: list[str],
             gram_precision: GramPrecision = "mixed") -> tuple[dict[str, ActivationStats], list[Tensor]]:
    """One pass of the layer over the calibration inputs, streaming the chosen modules' statistics."""
    projections = {m: _projection(layer, m) for m in modules}
    with collect_input_stats(projections, with_gram=gram_modules, gram_precision=gram_precision) as stats:
        outputs = run_layer(layer, inputs)
    return stats, outputs


@dataclass
class PruneReport:
    """Per-layer diagnostics and timings of one pruning run."""

    layers: list[dict[str, Any]]
    seconds: dict[str, float]
    peak_memory_bytes: int
    method_report: dict[str, Any] | None = None  # what a whole-model method reported


def _peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated on the accelerator, or the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def prune_model(model: nn.Module, calib_ids: Tensor, config: PruneConfig, *, registry: Registry | None = None,
                device: torch.device | str | None = None, progress: bool = True,
                reuse_capture: Callable[[Callable[[], list[LayerInput]]], list[LayerInput]] | None = None) -> PruneReport:
    """Prune and compensate every decoder layer of ``model`` in place from calibration token windows.

    ``reuse_capture(capture)``, when given, returns layer 0's inputs: ``capture()``, or an equal result
    remembered from an earlier call with the same model and calibration (rcpu_bench.matrix.reuse).
    """
    registry = registry or default_registry()
    config.validate(registry)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if config.model_method is not None:
        return _run_model_method(model, calib_ids, config, registry, device)
    layers = decoder_layers(model)
    selections = global_selections(model, calib_ids, config, registry, device) if config.structure == "al-am" else None
    totals = Timer(device)
    with totals("capture"):
        capture = partial(_capture, model, calib_ids, config, device)
        inputs = reuse_capture(capture) if reuse_capture else capture()
    reports = []
    for index, layer in enumerate(tqdm(layers, desc="pruning layers", disable=not progress)):
        timer = Timer(device)
        with _on_device(layer, device, config.offload):
            report, outputs = _prune_layer(layer, inputs, config, registry, timer, selections[index] if selections else None)
            if config.statistics == "sequential":
                with timer("forward"):
                    outputs = run_layer(layer, inputs)
        inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs)]
        reports.append({"layer": index, **report, "seconds": timer.seconds})
        for key, value in timer.seconds.items():
            totals.seconds[key] = totals.seconds.get(key, 0.0) + value
    return PruneReport(reports, totals.seconds, _peak_memory(device))


def _run_model_method(model: nn.Module, calib_ids: Tensor, config: PruneConfig, registry: Registry,
                      device: torch.device) -> PruneReport:
    """Hand the whole model to a registered model method (ratio and its own parameters)."""
    timer = Timer(device)
    method = registry.get("model-method", config.model_method)
    with timer(config.model_method):
        report = method(model, calib_ids.to(device), ratio=config.ratio, **config.model_method_params)
    return PruneReport([], timer.seconds, _peak_memory(device), report)


def _capture(model: nn.Module, calib_ids: Tensor, config: PruneConfig, device: torch.device) -> list[LayerInput]:
    """Layer-0 inputs; with offloading only the embeddings (and rotary tables) visit the device."""
    if not config.offload:
        return capture_layer_inputs(model, calib_ids, config.batch_size, device)
    base = model.model
    front = [m for m in (base.embed_tokens, getattr(base, "rotary_emb", None)) if m is not None]
    for module in front:
        module.to(device)
    try:
        return capture_layer_inputs(model, calib_ids, config.batch_size, device)
    finally:
        for module in front:
            module.to("cpu")


def _prune_layer(layer: nn.Module, inputs: list[LayerInput], config: PruneConfig, registry: Registry, timer: Timer,
                 selections: dict[str, Selection] | None) -> tuple[dict[str, Any], list[Tensor]]:
    """Statistics pass, then attention and MLP pruning; returns the diagnostics and the dense layer outputs."""
    modules = [m for m in MODULES if m in config.prune]
    gram = _gram_modules(modules, config, registry)
    with timer("statistics"):
        stats, dense_outputs = _collect(layer, modules, inputs, gram, config.gram_precision)
    report: dict[str, Any] = {}
    for module in modules:
        if module == "mlp" and config.recollect_mlp and "attention" in modules:
            with timer("statistics"):
                stats["mlp"] = _collect(layer, ["mlp"], inputs, gram, config.gram_precision)[0]["mlp"]
        units = selections[module] if selections else None
        report[module] = prune_module(layer, module, stats[module], config, registry, timer, units)
    return report, dense_outputs


# FLAP's adaptive structure (AL-AM) ------------------------------------------------------------------

class Unit(NamedTuple):
    score: float
    cost: float
    layer: int
    module: str
    index: int


def _unit_cost(layer: nn.Module, module: str) -> float:
    """Parameters removed with one unit: a kv group's q,k,v rows and o_proj columns, or an MLP channel's 3·d."""
    hidden = _projection(layer, "attention").weight.shape[0]
    if module == "mlp":
        return 3.0 * hidden
    geometry = layer_geometry(layer)
    per_group = geometry.n_heads // geometry.n_kv_heads
    return float((2 * per_group + 2) * geometry.head_dim * hidden)


def _layer_units(layer: nn.Module, index: int, module: str, scores: Tensor, gqa_rule: str) -> list[Unit]:
    """AL-AM unit scores of one module: mean of standardized column scores (o_proj scores squared first)."""
    mapping = unit_map(layer, module, gqa_rule)
    if mapping.group_size > 1:
        raise ValueError("structure='al-am' prunes whole key/value groups; use gqa_rule='group'")
    if module == "attention":
        scores = scores.square()
    cost = _unit_cost(layer, module)
    units = unit_scores(scores, mapping.unit_size, "standardized-mean")
    return [Unit(float(score), cost, index, module, u) for u, score in enumerate(units)]


@torch.no_grad()
def global_selections(model: nn.Module, calib_ids: Tensor, config: PruneConfig, registry: Registry,
                      device: torch.device) -> list[dict[str, Selection]]:
    """FLAP AL-AM: standardized per-layer scores, units weighted by parameter cost, one global threshold.

    Scores come from one dense pass (one-shot statistics, moments only). All units of all layers are
    sorted by score and kept, best first, while the kept cost moves closer to (1 − ρ) of the total.
    Unlike FLAP, every module keeps at least its best unit, so no layer loses all heads or channels.
    """
    modules = [m for m in MODULES if m in config.prune]
    inputs = _capture(model, calib_ids, config, device)
    units: list[Unit] = []
    for index, layer in enumerate(decoder_layers(model)):
        with _on_device(layer, device, config.offload):
            stats, outputs = _collect(layer, modules, inputs, gram_modules=[])
            for module in modules:
                scores = registry.scorer(config.scorer)(_projection(layer, module).weight, stats[module],
                                                        **config.scorer_params)
                units += _layer_units(layer, index, module, scores, config.gqa_rule)
        inputs = [LayerInput(out, x.kwargs) for out, x in zip(outputs, inputs)]
    kept = _global_keep(units, config.ratio)
    n_layers = len(decoder_layers(model))
    return [{m: _selection([u for u in units if u.layer == i and u.module == m], kept) for m in modules}
            for i in range(n_layers)]


def _global_keep(units: list[Unit], ratio: float) -> set[Unit]:
    """Best-first units whose cumulative cost is closest to (1 − ρ)·total, plus each module's best unit."""
    ordered = sorted(units, key=lambda u: (-u.score, u.layer, u.module, u.index))
    target = (1 - ratio) * sum(u.cost for u in units)
    kept, cost = set(), 0.0
    for unit in ordered:
        if abs(cost + unit.cost - target) > abs(cost - target):
            break
        kept.add(unit)
        cost += unit.cost
    best: dict[tuple[int, str], Unit] = {}
    for unit in ordered:
        best.setdefault((unit.layer, unit.module), unit)
    return kept | set(best.values())


def _selection(module_units: list[Unit], kept: set[Unit]) -> Selection:
    mask = torch.tensor([u in kept for u in sorted(module_units, key=lambda u: u.index)])
    return Selection(mask.nonzero().flatten(), (~mask).nonzero().flatten())
