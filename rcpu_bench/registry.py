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
import math
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any

import pluggy

from rcpu_bench import hookspecs
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
from rcpu_bench.plugin_contract import CHECKS, trial_problem

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
    check: Callable[..., Any] | None = None  # model methods: check(skeleton, *, ratio) raises ValueError when it cannot
    dof: Callable[..., Any] | None = None  # compensators: dof(weight, stats, kept, compensation) -> degrees of freedom
    # Parameter sets whose trial run passed (repr of the sorted items): a matrix validates each set once, not per cell.
    _accepted: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def check_params(self, params: Mapping[str, Any]) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            allowed = ", ".join(self.params) or "none"
            raise ValueError(f"{self.kind} {self.name!r} has no parameter(s) {', '.join(unknown)}; allowed: {allowed}")
        for key, value in params.items():
            if _is_number(self.params[key]) and isinstance(value, str):
                number = _parses_as_number(value)
                hint = (f" (YAML 1.1 reads 1e-2 without a decimal point as text: write {float(value):.1e})"
                        if number and math.isfinite(float(value)) else "")
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
            self(*trial_problem(self.kind, self.needs, group_size), **params)
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
            self(*trial_problem(self.kind, "gram"), **params)
        except Exception:  # noqa: BLE001 (any failure of the trial means: not without G)
            return False
        return True

    def __call__(self, *args: Any, **params: Any) -> Any:
        """Run the method and check its result against the contract (shapes, finiteness, report type)."""
        self.check_params(params)
        result = self.fn(*args, **params)
        problem = CHECKS[self.kind](result, *args)
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


def _parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """Keyword-only parameters with their defaults."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


def _takes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``fn`` can be called with these arguments (its signature binds them)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def make_method(kind: Kind, name: str, fn: Callable[..., Any], provider: str, *, needs: str = "moments",
                description: str | None = None, save: Callable[..., Any] | None = None,
                load: Callable[..., Any] | None = None, check: Callable[..., Any] | None = None,
                dof: Callable[..., Any] | None = None) -> Method:
    """What ``register(name, fn, ...)`` declares, checked (needs; save, load and check only for model methods, dof
    only for compensators)."""
    if needs not in NEEDS:
        raise ValueError(f"{kind} {name!r} from {provider}: needs={needs!r}; allowed: {', '.join(NEEDS)}")
    if (save or load or check) and kind != "model-method":
        raise ValueError(f"{kind} {name!r} from {provider}: only model methods take save=, load= and check=")
    if dof is not None and kind != "compensator":
        raise ValueError(f"{kind} {name!r} from {provider}: only compensators take dof=")
    if check is not None and not _takes(check, None, ratio=0.0):
        raise ValueError(f"{kind} {name!r} from {provider}: check={getattr(check, '__name__', check)!r} does not take "
                         "(model, *, ratio); allowed: a function check(model, *, ratio) raising ValueError")
    summary = description or (inspect.getdoc(fn) or "").split("\n")[0]
    return Method(kind, name, fn, provider, needs, summary, _parameters(fn), save, load, check, dof)


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


def failed_method(error: BaseException) -> str | None:
    """One line naming the registered method whose call failed with ``error`` and the decoder layer being pruned
    (read from the traceback: the innermost method call, the layer ``prune_model`` or the layer walk is at), or None
    when no registered
    method was running: a plugin that fails on a real layer is named, in ``rcpu-bench prune`` and in a matrix's
    failed-cell line alike."""
    method, layer = None, None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "prune_model" and "step" in frame.f_locals:
            layer = frame.f_locals["step"].index  # a rcpu_bench.pruning.walk.LayerStep
        elif frame.f_code.co_name == "walk_layers":
            layer = frame.f_locals.get("index")
        if frame.f_code.co_name == "__call__" and isinstance(frame.f_locals.get("self"), Method):
            method = frame.f_locals["self"]
    where = "" if layer is None else f" on layer {layer}"
    if isinstance(error, PluginContractError):
        return f"{error}{where}"
    if method is None:
        return None
    return f"{method.kind} {method.name!r} from {method.provider} failed{where}: {type(error).__name__}: {error}"
