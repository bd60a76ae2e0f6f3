"""The method registry: every scorer, compensator and whole-model method, built-in or third-party.

Which plugins make the default registry (the built-ins, then the ``rcpu_bench`` entry-point group) is decided
one floor up, in ``rcpu_bench.plugins``: this module names no plugin. Each plugin's hooks are called with a
``register`` bound to it, and a plugin is admitted whole or not at all: if a hook raises, a name clashes with an
earlier plugin's, or a method fails its trial run, the plugin is recorded in ``Registry.broken`` with the reason
and its names answer with that reason; the built-ins and every other plugin keep working. ``Registry.resolve``
looks a run's names up once, before any layer is touched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any

import pluggy
import torch

from rcpu_bench import hookspecs, strict_json
from rcpu_bench.compensation.rotation import tolerance as orthogonality_tolerance
from rcpu_bench.finite import count_non_finite
from rcpu_bench.hookspecs import (
    NEEDS,
    AllocationEntry,
    CompensatorEntry,
    Kind,
    ModelMethodEntry,
    Needs,
    ScorerEntry,
    SelectorEntry,
)
from rcpu_bench.selection.select import UnitMap
from rcpu_bench.statistics.activations import ActivationStats

KINDS: tuple[Kind, ...] = ("scorer", "selector", "compensator", "model-method", "allocation")
_HOOKS: dict[Kind, str] = {"scorer": "register_scorers", "selector": "register_selectors",
                           "compensator": "register_compensators", "model-method": "register_model_methods",
                           "allocation": "register_allocations"}
SELECTION_KINDS: tuple[Kind, ...] = ("scorer", "selector")  # one namespace: the ``scorer`` option names either


class PluginContractError(RuntimeError):
    """A plugin's method returned something, or read something, that breaks the harness's contract."""


class UnknownMethodError(KeyError, ValueError):
    """A name that is not registered (or whose plugin is broken); the message lists what exists."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Method:
    """A registered method with its provider, declared statistics, description and parameters (with defaults).

    Satisfies the ``hookspecs`` entry of its ``kind`` (``ScorerEntry``, ``SelectorEntry``, ...).
    """

    kind: Kind
    name: str
    fn: Callable[..., Any]
    provider: str
    needs: Needs = "moments"
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    save: Callable[..., Any] | None = None  # model methods: save(model, directory, *, tokenizer, report)
    load: Callable[..., Any] | None = None  # model methods: load(directory, *, dtype, device) -> LoadedModel
    check: Callable[..., Any] | None = None  # model methods: check(skeleton) raises ValueError when it cannot prune it
    # Parameter sets whose trial run passed (repr of the sorted items): a matrix validates each set once, not per cell.
    _accepted: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def check_params(self, params: Mapping[str, Any]) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            allowed = ", ".join(self.params) or "none"
            raise ValueError(f"{self.kind} {self.name!r} has no parameter(s) {', '.join(unknown)}; allowed: {allowed}")
        for key, value in params.items():
            if _is_number(self.params[key]) and isinstance(value, str):
                hint = (f" (YAML 1.1 reads 1e-2 without a decimal point as text: write {float(value):.1e})"
                        if _parses_as_number(value) else "")
                raise ValueError(f"{self.kind} {self.name!r} parameter {key}={value!r} is text, not a number{hint}; "
                                 f"allowed: a number (default {self.params[key]!r})")

    def validate(self, params: Mapping[str, Any], *, group_size: int = 1) -> None:
        """Check parameter names, then values by a trial run on a tiny synthetic problem (before real work).

        The trial builds only the statistics the method declares in ``needs``; a selector's trial units come in
        groups of ``group_size`` (the query rule's query heads of one key/value group). If a method declaring
        "moments" fails there but succeeds once G is supplied, it reads G without saying so: that is a
        ``PluginContractError`` naming the plugin and the declared need. A parameter set that passed is not
        tried again.
        """
        self.check_params(params)
        key = repr((sorted(params.items()), group_size))
        if self.kind == "model-method" or key in self._accepted:  # model methods: no cheap trial problem exists
            return
        try:
            self(*_trial_problem(self.kind, self.needs, group_size), **params)
        except PluginContractError:
            raise
        except Exception as error:
            if self.needs != "gram" and self._succeeds_with_gram(params):
                raise PluginContractError(
                    f"{self.kind} {self.name!r} from {self.provider} declares needs={self.needs!r} but reads the "
                    f"Gram matrix G = Σ x xᵀ: without G its trial run fails ({type(error).__name__}: {error}); "
                    "register it with needs='gram'") from error
            if isinstance(error, (ValueError, KeyError, TypeError)):
                what = f"units in groups of {group_size}" if group_size > 1 else f"parameters {dict(params)}"
                raise ValueError(f"{self.kind} {self.name!r} rejects {what}: {error}") from error
            raise
        self._accepted.add(key)

    def _succeeds_with_gram(self, params: Mapping[str, Any]) -> bool:
        try:
            self(*_trial_problem(self.kind, "gram"), **params)
        except Exception:  # noqa: BLE001 (any failure of the trial means: not without G)
            return False
        return True

    def __call__(self, *args: Any, **params: Any) -> Any:
        """Run the method and check its result against the contract (shapes, finiteness, report type)."""
        self.check_params(params)
        result = self.fn(*args, **params)
        problem = _CHECKS[self.kind](result, *args)
        if problem:
            raise PluginContractError(f"{self.kind} {self.name!r} from {self.provider} {problem}")
        return result


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _trial_problem(kind: Kind, needs: Needs, group_size: int = 1) -> tuple[Any, ...]:
    """W (3 × 4) and the statistics of 32 random tokens; compensators also get K = {0, 2}, pruned {1, 3}, selectors
    units of 2 columns (in groups of ``group_size``) and one to prune; allocations get 4 layers and ratio 0.2.

    The statistics are the least that the declared need allows: moments and ‖Y‖², plus S and C_D over the
    pruned columns for "output_cross", C alone for "cross", G alone for "gram"."""
    if kind == "allocation":
        return (4, 0.2)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, generator=generator)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    kept, pruned = torch.tensor([0, 2]), torch.tensor([1, 3])
    stats = ActivationStats.from_activations(x, with_gram=needs == "gram", outputs=x @ weight.double().T,
                                             with_cross=needs == "cross",
                                             dropped=pruned if needs == "output_cross" else None)
    extra = {"compensator": (kept, pruned), "selector": (UnitMap(2, group_size=group_size), 1)}
    return (weight, stats, *extra.get(kind, ()))


def _check_scores(scores: Any, weight: torch.Tensor, *_: Any) -> str | None:
    if not isinstance(scores, torch.Tensor) or scores.shape != (weight.shape[1],):
        return f"returned {_describe(scores)}, expected a tensor of shape ({weight.shape[1]},)"
    if not torch.isfinite(scores).all():
        return "returned NaN or infinite scores"
    return None


def _check_selection(selection: Any, weight: torch.Tensor, _stats: Any, units: UnitMap, n_prune: int) -> str | None:
    if not (isinstance(getattr(selection, "kept", None), torch.Tensor)
            and isinstance(getattr(selection, "pruned", None), torch.Tensor)):
        return f"returned {_describe(selection)}, expected a Selection"
    n_units = weight.shape[1] // units.unit_size
    together = torch.cat([selection.kept, selection.pruned]).cpu().sort().values
    if len(selection.pruned) != n_prune or not torch.equal(together, torch.arange(n_units)):
        return (f"returned kept {selection.kept.tolist()} and pruned {selection.pruned.tolist()}; expected {n_prune} "
                f"pruned and the rest kept, a partition of the {n_units} units")
    return None


def _check_allocation(ratios: Any, n_layers: int, ratio: float) -> str | None:
    if callable(ratios):  # a hookspecs.ModelAllocation: the pipeline checks what it returns
        return None
    if not isinstance(ratios, torch.Tensor) or ratios.shape != (n_layers,):
        return f"returned {_describe(ratios)}, expected a tensor of shape ({n_layers},)"
    if not (torch.isfinite(ratios).all() and (ratios >= 0).all() and (ratios < 1).all()):
        return f"returned ratios {ratios.tolist()} outside [0, 1)"
    if abs(float(ratios.double().mean()) - ratio) > 1e-9:
        return f"returned ratios of mean {float(ratios.double().mean())!r}, expected the target {ratio!r}"
    return None


def _check_compensation(result: Any, weight: torch.Tensor, _stats: Any, kept: torch.Tensor, *_: Any) -> str | None:
    expected = (weight.shape[0], len(kept))
    if not hasattr(result, "weight") or not isinstance(result.weight, torch.Tensor):
        return f"returned {_describe(result)}, expected a Compensation"
    if tuple(result.weight.shape) != expected:
        return f"returned a weight of shape {tuple(result.weight.shape)}, expected {expected}"
    if result.bias is not None and tuple(result.bias.shape) != (weight.shape[0],):
        return f"returned a bias of shape {tuple(result.bias.shape)}, expected ({weight.shape[0]},)"
    if count_non_finite(result.weight) or (result.bias is not None and count_non_finite(result.bias)):
        return "returned NaN or infinite weights"
    info = getattr(result, "info", {})
    if not isinstance(info, dict) or (bad := strict_json.problem(info, "info")):
        return f"returned {'info' if isinstance(info, dict) else _describe(info)} that cannot be recorded: " + (
            bad if isinstance(info, dict) else f"expected a dict of {strict_json.ALLOWED}")
    return _check_orthogonality(info, weight.shape[0], result.weight.dtype)


def _check_orthogonality(info: dict[str, Any], d_out: int, weight_dtype: torch.dtype) -> str | None:
    """A reported info["orthogonality_error"] declares Q (d_out × d_out) orthogonal: it must be within
    ``rcpu_bench.compensation.rotation.tolerance(d_out, dtype)``, dtype = info["compute_dtype"] or the weight's, unless
    info["orthogonality_unchecked"] states why not (an explicit opt-out, kept in the record)."""
    error = info.get("orthogonality_error")
    if error is None:
        return None
    unchecked = info.get("orthogonality_unchecked")
    if unchecked is not None:
        return None if isinstance(unchecked, str) and unchecked else (
            f"set orthogonality_unchecked={unchecked!r}; it must be a non-empty string saying why")
    name = info.get("compute_dtype")
    dtype = weight_dtype if name is None else getattr(torch, name, None) if isinstance(name, str) else None
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return f"declared compute_dtype={name!r}; expected a floating torch dtype name such as 'float32'"
    tol = orthogonality_tolerance(d_out, dtype)
    if not error <= tol:
        return f"declared an orthogonal update but ‖QᵀQ − I‖_F = {error:.3g} > {tol:.3g} (n={d_out}, {dtype})"
    return None


def _check_report(report: Any, model: torch.nn.Module, *_: Any) -> str | None:
    if not isinstance(report, dict):
        return f"returned {_describe(report)}, expected a report dict"
    bad = strict_json.problem(report, "report")
    return None if bad is None else f"returned a report that cannot be recorded: {bad}"


_CHECKS: dict[str, Callable[..., str | None]] = {"scorer": _check_scores, "selector": _check_selection,
                                                 "compensator": _check_compensation, "model-method": _check_report,
                                                 "allocation": _check_allocation}


def _describe(obj: Any) -> str:
    return f"a tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__


def _parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """Keyword-only parameters with their defaults."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


def make_method(kind: Kind, name: str, fn: Callable[..., Any], provider: str, *, needs: str = "moments",
                description: str | None = None, save: Callable[..., Any] | None = None,
                load: Callable[..., Any] | None = None, check: Callable[..., Any] | None = None) -> Method:
    """What ``register(name, fn, ...)`` declares, checked (needs; save, load and check only for model methods)."""
    if needs not in NEEDS:
        raise ValueError(f"{kind} {name!r} from {provider}: needs={needs!r}; allowed: {', '.join(NEEDS)}")
    if (save or load or check) and kind != "model-method":
        raise ValueError(f"{kind} {name!r} from {provider}: only model methods take save=, load= and check=")
    summary = description or (inspect.getdoc(fn) or "").split("\n")[0]
    return Method(kind, name, fn, provider, needs, summary, _parameters(fn), save, load, check)


@dataclass(frozen=True)
class Resolved:
    """A run's methods, looked up once before any layer is touched; ``selection`` is a scorer or a selector."""

    selection: ScorerEntry | SelectorEntry
    compensator: CompensatorEntry
    uncompensated: CompensatorEntry  # "none": for modules outside ``compensate`` (W̃_K = W_K)
    model_method: ModelMethodEntry | None = None
    allocation: AllocationEntry | None = None

    def compensator_for(self, compensated: bool) -> CompensatorEntry:
        return self.compensator if compensated else self.uncompensated

    def needs(self, compensated: bool) -> Needs:
        """The statistics a module's selection and compensator read together: the stronger of their ``needs``."""
        return max(self.selection.needs, self.compensator_for(compensated).needs, key=NEEDS.index)


class Registry:
    """Registered methods by kind and name, and the plugins that could not be admitted (with why)."""

    def __init__(self) -> None:
        self._methods: dict[Kind, dict[str, Method]] = {kind: {} for kind in KINDS}
        self.broken: dict[str, str] = {}  # provider -> why it could not be loaded or admitted
        self._unavailable: dict[tuple[Kind, str], str] = {}  # (kind, name) -> provider of the broken plugin

    @property
    def scorers(self) -> Mapping[str, ScorerEntry]:
        return MappingProxyType(self._methods["scorer"])

    @property
    def selectors(self) -> Mapping[str, SelectorEntry]:
        return MappingProxyType(self._methods["selector"])

    @property
    def allocations(self) -> Mapping[str, AllocationEntry]:
        return MappingProxyType(self._methods["allocation"])

    @property
    def compensators(self) -> Mapping[str, CompensatorEntry]:
        return MappingProxyType(self._methods["compensator"])

    @property
    def model_methods(self) -> Mapping[str, ModelMethodEntry]:
        return MappingProxyType(self._methods["model-method"])

    def admit(self, provider: str, methods: list[Method]) -> None:
        """Add one plugin's methods, all or none: names must be new, and each method passes its trial run
        with default parameters. On failure the plugin is recorded as broken and its names point to why."""
        try:
            seen: dict[tuple[Kind, str], str] = {}
            for method in methods:
                key = (method.kind, method.name)
                kinds = SELECTION_KINDS if method.kind in SELECTION_KINDS else (method.kind,)
                existing = next((self._methods[k][method.name] for k in kinds if method.name in self._methods[k]),
                                None)
                first = existing.provider if existing else next((seen[(k, method.name)] for k in kinds
                                                                 if (k, method.name) in seen), None)
                if first:
                    raise ValueError(f"duplicate {method.kind} name {method.name!r}: registered by {first} "
                                     f"and by {provider}")
                seen[key] = provider
            for method in methods:
                try:
                    method.validate({})
                except Exception as error:
                    raise PluginContractError(f"trial run of {method.kind} {method.name!r} failed: "
                                                 f"{type(error).__name__}: {error}") from error
        except Exception as error:  # noqa: BLE001 (a failing plugin is isolated, whatever it raised)
            self.isolate(provider, [(m.kind, m.name) for m in methods], str(error))
            return
        for method in methods:
            self._methods[method.kind][method.name] = method

    def isolate(self, provider: str, names: Iterable[tuple[Kind, str]], why: str) -> None:
        """Record a broken plugin; the names it registered (and no one else holds) answer with ``why``."""
        self.broken[provider] = why
        for kind, name in names:
            if name not in self._methods[kind]:
                self._unavailable[(kind, name)] = provider

    def get(self, kind: Kind, name: str) -> Method:
        if kind not in self._methods:
            raise ValueError(f"unknown method kind {kind!r}; allowed: {', '.join(self._methods)}")
        method = self._methods[kind].get(name)
        if method is not None:
            return method
        provider = self._unavailable.get((kind, name))
        if provider is not None:
            raise UnknownMethodError(f"{kind} {name!r} is unavailable: its plugin {provider} failed to load: "
                                     f"{self.broken[provider]}")
        known = ", ".join(sorted(self._methods[kind])) or "none"
        broken = "".join(f"; plugin {p} failed to load: {why}" for p, why in self.broken.items())
        raise UnknownMethodError(f"unknown {kind} {name!r}; registered {kind}s: {known}{broken}")

    def scorer(self, name: str) -> ScorerEntry:
        return self.get("scorer", name)

    def selection(self, name: str) -> ScorerEntry | SelectorEntry:
        """The scorer or selector ``name`` (one namespace): what the ``scorer`` option of a run names."""
        if name in self._methods["selector"]:
            return self._methods["selector"][name]
        try:
            return self.scorer(name)
        except UnknownMethodError as error:
            selectors = ", ".join(sorted(self._methods["selector"])) or "none"
            raise UnknownMethodError(f"{error}; registered selectors: {selectors}") from None

    def allocation(self, name: str) -> AllocationEntry:
        return self.get("allocation", name)

    def compensator(self, name: str) -> CompensatorEntry:
        return self.get("compensator", name)

    def model_method(self, name: str) -> ModelMethodEntry:
        return self.get("model-method", name)

    def methods(self, kind: Kind) -> list[Method]:
        return sorted(self._methods[kind].values(), key=lambda m: m.name)

    def resolve(self, *, scorer: str, compensator: str, model_method: str | None = None,
                allocation: str | None = None) -> Resolved:
        """A run's names to their entries, once (lookup errors list what exists); ``scorer`` names a scorer or a
        selector."""
        return Resolved(self.selection(scorer), self.compensator(compensator), self.compensator("none"),
                        None if model_method is None else self.model_method(model_method),
                        None if allocation is None else self.allocation(allocation))


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with our hook specs, each plugin's provider name and the plugins that failed to load."""

    def __init__(self) -> None:
        super().__init__("rcpu_bench")
        self.add_hookspecs(hookspecs)
        self.providers: dict[str, str] = {}
        self.broken: dict[str, str] = {}

    def load_entry_points(self) -> None:
        """Register every ``rcpu_bench`` entry point, by name; one that fails to import is recorded, not fatal.

        An entry point whose object is already registered (an older install's ``builtin`` entry point,
        which loads ``rcpu_bench.builtin``) is skipped, so nothing is registered twice.
        """
        for entry in sorted(metadata.entry_points(group="rcpu_bench"), key=lambda e: e.name):
            provider = f"{entry.name} ({entry.dist.name} {entry.dist.version})" if entry.dist else entry.name
            try:
                plugin = entry.load()
                if self.is_registered(plugin):
                    continue
                self.register(plugin, name=entry.name)
            except Exception as error:  # noqa: BLE001 (a broken plugin must not take the others down)
                self.broken[provider] = f"{type(error).__name__}: {error}"
            else:
                self.providers[entry.name] = provider


def build_registry(pm: PluginManager) -> Registry:
    """Call each plugin's hooks with a ``register`` bound to it and admit its methods (see ``Registry.admit``).

    Plugins are admitted in registration order (built-ins first), so a name clash breaks the later plugin.
    """
    registry = Registry()
    registry.broken.update(pm.broken)
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # a name blocked with pm.set_blocked
            continue
        provider = pm.providers.get(name, name)
        declared: list[Method] = []
        try:
            for kind, hook_name in _HOOKS.items():
                for impl in getattr(pm.hook, hook_name).get_hookimpls():
                    if impl.plugin is plugin:
                        _call_hook(impl.function, hook_name, kind, provider, declared)
        except _HookFailed as failure:
            registry.isolate(provider, [(m.kind, m.name) for m in declared], str(failure))
            continue
        registry.admit(provider, declared)
    return registry


class _HookFailed(Exception):
    """A plugin's hook raised (its message says which hook and what)."""


def _call_hook(hook: Callable[..., None], hook_name: str, kind: Kind, provider: str, declared: list[Method]) -> None:
    def register(name: str, fn: Callable[..., Any], **declaration: Any) -> None:
        declared.append(make_method(kind, name, fn, provider, **declaration))

    try:
        hook(register=register)
    except Exception as error:
        raise _HookFailed(f"{hook_name} raised {type(error).__name__}: {error}") from error
