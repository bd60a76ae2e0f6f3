"""Hook specifications and typed contracts between rcpu-bench and its plugins (built-in or third-party).

A plugin is a module or object with ``@hookimpl`` functions: the built-ins (``rcpu_bench.builtin``) are
registered in code, third-party plugins through the ``rcpu_bench`` entry-point group. Each hook receives
a ``register`` callable bound to its plugin (``Register`` below). What a plugin hands over is a
``Scorer``, a ``Selector``, a ``Compensator``, a ``ModelMethod`` or an ``Allocation``; what the harness looks up
is the matching entry (``ScorerEntry``, ``SelectorEntry``, ...), which checks parameters and results.

Allocation: a *profile* gives per-layer ratios from the layer count alone; an allocation that must see the model (a
search over per-layer levels) returns instead a ``ModelAllocation``, which the pipeline calls once, before any layer
is pruned, with an ``AllocationContext`` (the pipeline's ``rcpu_bench.pruning.allocation_pass.AllocationTask``).

Selection: a *selector* chooses a module's kept and pruned units jointly (OBS); a *scorer* is its common case,
a score per column, whose units with the lowest summed score are pruned. The run's ``scorer`` option names either.

Keyword-only arguments with defaults are a method's parameters. ``needs`` declares the cheapest
statistic the method reads: "moments" (N, Σx, Σ|x|, Σx², and ‖Y‖² when outputs were seen), "output_cross"
(also M = Y Zᵀ, the dense outputs against the pruned ones: read it through ``compensators.Problem.yzt``),
"cross" (also Y X_Kᵀ, from C = Σ y xᵀ or from G: read it through ``compensators.Problem.yxk``) or "gram"
(also G = Σ x xᵀ). The harness collects the cheapest sufficient statistics for the need
(``rcpu_bench.statistics.flops``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import pluggy

if TYPE_CHECKING:
    from torch import Tensor, device, dtype, nn

    from rcpu_bench.compensation.compensators import Compensation
    from rcpu_bench.selection.select import Selection, UnitMap
    from rcpu_bench.statistics.activations import ActivationStats

hookspec = pluggy.HookspecMarker("rcpu_bench")
hookimpl = pluggy.HookimplMarker("rcpu_bench")

Kind = Literal["scorer", "selector", "compensator", "model-method", "allocation"]
Needs = Literal["moments", "output_cross", "cross", "gram"]
NEEDS: tuple[Needs, ...] = get_args(Needs)  # ordered as ``statistics.flops.NEEDS``: each reads more than the last


# --- what a plugin provides ------------------------------------------------------------------------

class Scorer(Protocol):
    """Column scores s (d_in,) of a module's weight W (d_out × d_in) from its input statistics; higher = keep."""

    def __call__(self, weight: Tensor, stats: ActivationStats, /) -> Tensor: ...


class Selector(Protocol):
    """Kept and pruned units (a ``Selection``) of a module: which ``n_prune`` of its units to remove, chosen jointly.

    ``units`` maps units to the weight's input columns (unit u: columns [u·unit_size, (u+1)·unit_size));
    under GQA's "query" rule (``units.group_size`` > 1) ``n_prune`` is split equally over the groups.
    """

    def __call__(self, weight: Tensor, stats: ActivationStats, units: UnitMap, n_prune: int, /) -> Selection: ...


class Allocation(Protocol):
    """Per-layer pruning ratios (n_layers values in [0, 1)) whose mean is the target ratio (parameter-matched), or a
    ``ModelAllocation`` that chooses them on the model itself."""

    def __call__(self, n_layers: int, ratio: float, /) -> Tensor | ModelAllocation: ...


class AllocationContext(Protocol):
    """What a ``ModelAllocation`` is handed: the dense model, the run's calibration windows (n × seqlen token ids),
    its options (a ``PruneConfig``) and resolved methods, the device, and three helpers: held-out windows disjoint
    from the calibration ones, each decoder layer with the statistics the run's scorer and compensator read, and one
    module of one layer pruned in place by the run's own methods (returning its diagnostics)."""

    model: nn.Module
    calib_ids: Tensor
    config: Any
    methods: Any
    device: device
    progress: bool

    @property
    def modules(self) -> list[str]: ...

    def holdout(self, n_windows: int, /) -> Tensor: ...

    def dense_layers(self) -> Iterator[tuple[int, Any, dict[str, ActivationStats]]]: ...

    def prune(self, view: Any, module: str, stats: ActivationStats, n_prune: int, /) -> dict[str, Any]: ...


class ModelAllocation(Protocol):
    """Units pruned per layer and module, chosen on the dense model before any layer is pruned.

    Called once with the run's ``AllocationContext``; returns ``(counts, report)``: per decoder layer, {module: units to
    prune} for each pruned module, and a strict-JSON report that the record keeps as ``method_report["allocation"]``.
    The model must be left as it was handed over (dense).

    It may also have ``check(model, config, seqlen) -> int``, which a run calls before the model loads, on a
    weightless (meta) model of the run's shapes and dtype, its ``PruneConfig`` and the calibration windows' length:
    it raises ValueError or OSError for what it would refuse (a cost above its bound, say) and returns how many
    held-out windows it will draw, which the run then checks its calibration source can give.
    """

    def __call__(self, task: AllocationContext, /) -> tuple[list[dict[str, int]], dict[str, Any]]: ...


class Compensator(Protocol):
    """New weight W̃_K (d_out × |K|) and optional bias for the kept columns K, after dropping the pruned ones."""

    def __call__(self, weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, /) -> Compensation: ...


class ModelMethod(Protocol):
    """Prunes a whole Hugging Face model in place from calibration token windows; returns a report dict."""

    def __call__(self, model: nn.Module, calib_ids: Tensor, /, *, ratio: float) -> dict[str, Any]: ...


class SaveModel(Protocol):
    """Writes a model pruned by a model method, with an ``rcpu_manifest.json`` naming the method."""

    def __call__(self, model: nn.Module, directory: Path, /, *, tokenizer: Any, report: dict[str, Any]) -> None: ...


class LoadModel(Protocol):
    """Reads back what the matching ``SaveModel`` wrote (returns a ``LoadedModel``)."""

    def __call__(self, directory: Path, /, *, dtype: dtype | str, device: Any) -> Any: ...


class CheckModel(Protocol):
    """Raises ValueError naming why a model method cannot prune ``model`` (a weightless skeleton) at ``ratio``."""

    def __call__(self, model: nn.Module, /, *, ratio: float) -> None: ...


class Register(Protocol):
    """The ``register`` callable each hook receives, bound to the calling plugin."""

    def __call__(self, name: str, fn: Scorer | Selector | Compensator | ModelMethod | Allocation, *,
                 needs: Needs = "moments", description: str | None = None, save: SaveModel | None = None,
                 load: LoadModel | None = None, check: CheckModel | None = None,
                 dof: Callable[[Tensor, ActivationStats, Tensor, Compensation], float] | None = None) -> None: ...


# --- what the harness looks up (registry entries) --------------------------------------------------

class Entry(Protocol):
    """A registered method: who provides it, what it reads, its parameters and their defaults."""

    @property
    def kind(self) -> Kind: ...
    @property
    def name(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def needs(self) -> Needs: ...
    @property
    def description(self) -> str: ...
    @property
    def params(self) -> Mapping[str, Any]: ...

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Raise ValueError naming unknown parameters and the allowed ones."""

    def validate(self, params: Mapping[str, Any], *, group_size: int = 1) -> None:
        """Check parameter names, then values by a trial run that builds only the declared statistics (a selector's
        trial units in groups of ``group_size``)."""


class ScorerEntry(Entry, Protocol):
    def __call__(self, weight: Tensor, stats: ActivationStats, /, **params: Any) -> Tensor: ...


class SelectorEntry(Entry, Protocol):
    def __call__(self, weight: Tensor, stats: ActivationStats, units: UnitMap, n_prune: int, /,
                 **params: Any) -> Selection: ...


class AllocationEntry(Entry, Protocol):
    def __call__(self, n_layers: int, ratio: float, /, **params: Any) -> Tensor | ModelAllocation: ...


class CompensatorEntry(Entry, Protocol):
    @property
    def dof(self) -> Callable[[Tensor, ActivationStats, Tensor, Compensation], float] | None: ...

    def __call__(self, weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor, /,
                 **params: Any) -> Compensation: ...


class ModelMethodEntry(Entry, Protocol):
    @property
    def save(self) -> SaveModel | None: ...
    @property
    def load(self) -> LoadModel | None: ...

    def __call__(self, model: nn.Module, calib_ids: Tensor, /, *, ratio: float, **params: Any) -> dict[str, Any]: ...


# --- the hooks -------------------------------------------------------------------------------------

@hookspec
def register_scorers(register: Register) -> None:
    """Register column scorers: ``register("name", fn, needs=..., description=...)``."""


@hookspec
def register_selectors(register: Register) -> None:
    """Register selectors, which choose a module's pruned units jointly: ``register("name", fn, needs=...)``."""


@hookspec
def register_allocations(register: Register) -> None:
    """Register allocations (the ``allocation`` option), per-layer ratio profiles or ``ModelAllocation`` builders:
    ``register("name", fn, description=...)``."""


@hookspec
def register_compensators(register: Register) -> None:
    """Register compensators: ``register("name", fn, needs=..., description=..., dof=...)``.

    ``dof(weight, stats, kept, compensation)`` (optional) is the compensator's degrees of freedom: how many numbers
    its update fits (ridge's effective d_out·Σσ²/(σ²+λ), a rotation's d_out(d_out−1)/2, ...), recorded beside the
    calibration and held-out errors of a run with ``holdout`` > 0 (None when not declared).
    """


@hookspec
def register_model_methods(register: Register) -> None:
    """Register whole-model methods (e.g. SliceGPT): ``register("name", fn, save=..., load=..., check=...)``.

    A model method changes the model's structure beyond what ``save_pruned`` describes, so it brings its
    own ``save(model, directory, *, tokenizer, report)``, which must also write an ``rcpu_manifest.json``
    with ``{"format": ..., "model_method": name}``, and ``load(directory, *, dtype, device)``.
    ``check(model, *, ratio)`` (optional) raises ValueError naming why the method cannot prune a model at the run's
    ratio: it is called on the model's weightless skeleton (meta device) before any weights load, so a model (or a
    ratio) the method does not handle is refused first.
    """
