"""The method registry: every scorer and compensator, built-in or third-party, found through pluggy.

Plugins are loaded from the ``rcpu_bench`` entry-point group (the built-ins included), and each
hook implementation is called with a ``register`` bound to its provider, so duplicate names can be
reported with both providers.
"""

from __future__ import annotations

import inspect
from importlib import metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import pluggy
import torch

from rcpu_bench import hookspecs
from rcpu_bench.compensation.rotation import tolerance as orthogonality_tolerance
from rcpu_bench.statistics.activations import ActivationStats

Kind = Literal["scorer", "compensator", "model-method"]
NEEDS = ("moments", "gram")
_HOOKS: dict[Kind, str] = {"scorer": "register_scorers", "compensator": "register_compensators",
                           "model-method": "register_model_methods"}


class PluginContractError(RuntimeError):
    """A plugin's method returned something that breaks the harness's contract."""


@dataclass(frozen=True)
class Method:
    """A registered scorer or compensator with its one-line description and parameters."""

    kind: Kind
    name: str
    fn: Callable[..., Any]
    provider: str
    needs: str = "moments"
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    save: Callable[..., Any] | None = None  # model methods: save(model, directory, *, tokenizer, report)
    load: Callable[..., Any] | None = None  # model methods: load(directory, *, dtype, device) -> LoadedModel

    def check_params(self, params: dict[str, Any]) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            allowed = ", ".join(self.params) or "none"
            raise ValueError(f"{self.kind} {self.name!r} has no parameter(s) {', '.join(unknown)}; allowed: {allowed}")

    def validate(self, params: dict[str, Any]) -> None:
        """Check parameter names, then values by a trial run on a tiny synthetic problem (before real work)."""
        self.check_params(params)
        if self.kind == "model-method":  # no cheap trial problem: a whole model is needed
            return
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(3, 4, generator=generator)
        stats = ActivationStats.from_activations(torch.randn(32, 4, generator=generator, dtype=torch.float64))
        indices = (torch.tensor([0, 2]), torch.tensor([1, 3])) if self.kind == "compensator" else ()
        try:
            self(weight, stats, *indices, **params)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{self.kind} {self.name!r} rejects parameters {params}: {error}") from error

    def __call__(self, *args: Any, **params: Any):
        """Run the method and check its result against the contract (shapes, finiteness, report type)."""
        self.check_params(params)
        result = self.fn(*args, **params)
        problem = _CHECKS[self.kind](result, *args)
        if problem:
            raise PluginContractError(f"{self.kind} {self.name!r} from {self.provider} {problem}")
        return result


def _check_scores(scores: Any, weight: torch.Tensor, *_: Any) -> str | None:
    if not isinstance(scores, torch.Tensor) or scores.shape != (weight.shape[1],):
        return f"returned {_describe(scores)}, expected a tensor of shape ({weight.shape[1]},)"
    if not torch.isfinite(scores).all():
        return "returned NaN or infinite scores"
    return None


def _check_compensation(result: Any, weight: torch.Tensor, _stats: Any, kept: torch.Tensor, *_: Any) -> str | None:
    expected = (weight.shape[0], len(kept))
    if not hasattr(result, "weight") or not isinstance(result.weight, torch.Tensor):
        return f"returned {_describe(result)}, expected a Compensation"
    if tuple(result.weight.shape) != expected:
        return f"returned a weight of shape {tuple(result.weight.shape)}, expected {expected}"
    if result.bias is not None and tuple(result.bias.shape) != (weight.shape[0],):
        return f"returned a bias of shape {tuple(result.bias.shape)}, expected ({weight.shape[0]},)"
    if not torch.isfinite(result.weight).all() or (result.bias is not None and not torch.isfinite(result.bias).all()):
        return "returned NaN or infinite weights"
    return _check_orthogonality(getattr(result, "info", {}), weight.shape[0], result.weight.dtype)


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
    return None if isinstance(report, dict) else f"returned {_describe(report)}, expected a report dict"


_CHECKS: dict[str, Callable[..., str | None]] = {"scorer": _check_scores, "compensator": _check_compensation,
                                                 "model-method": _check_report}


def _describe(obj: Any) -> str:
    return f"a tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__


def _parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """Keyword-only parameters with their defaults."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


class Registry:
    """Lookup of registered methods by kind and name."""

    def __init__(self) -> None:
        self._methods: dict[Kind, dict[str, Method]] = {kind: {} for kind in _HOOKS}
        self.broken: dict[str, str] = {}  # provider -> why it could not be loaded or registered

    def add(self, kind: Kind, name: str, fn: Callable[..., Any], provider: str, *, needs: str = "moments",
            description: str | None = None, save: Callable[..., Any] | None = None,
            load: Callable[..., Any] | None = None) -> None:
        if needs not in NEEDS:
            raise ValueError(f"{kind} {name!r} from {provider}: needs={needs!r}; allowed: {', '.join(NEEDS)}")
        existing = self._methods[kind].get(name)
        if existing:
            raise ValueError(f"duplicate {kind} name {name!r}: registered by {existing.provider} and by {provider}")
        summary = description or (inspect.getdoc(fn) or "").split("\n")[0]
        if (save or load) and kind != "model-method":
            raise ValueError(f"{kind} {name!r} from {provider}: only model methods take save= and load=")
        self._methods[kind][name] = Method(kind, name, fn, provider, needs, summary, _parameters(fn), save, load)

    def registrar(self, kind: Kind, provider: str) -> Callable[..., None]:
        """The ``register`` callable handed to one plugin's hook."""
        def register(name: str, fn: Callable[..., Any], *, needs: str = "moments", description: str | None = None,
                     save: Callable[..., Any] | None = None, load: Callable[..., Any] | None = None):
            self.add(kind, name, fn, provider, needs=needs, description=description, save=save, load=load)
        return register

    def get(self, kind: Kind, name: str) -> Method:
        if kind not in self._methods:
            raise ValueError(f"unknown method kind {kind!r}; allowed: {', '.join(self._methods)}")
        try:
            return self._methods[kind][name]
        except KeyError:
            known = ", ".join(sorted(self._methods[kind])) or "none"
            broken = "".join(f"; plugin {p} failed to load: {why}" for p, why in self.broken.items())
            raise KeyError(f"unknown {kind} {name!r}; registered {kind}s: {known}{broken}") from None

    def scorer(self, name: str) -> Method:
        return self.get("scorer", name)

    def compensator(self, name: str) -> Method:
        return self.get("compensator", name)

    def methods(self, kind: Kind) -> list[Method]:
        return sorted(self._methods[kind].values(), key=lambda m: m.name)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with our hook specs, each plugin's provider name and the plugins that failed to load."""

    def __init__(self) -> None:
        super().__init__("rcpu_bench")
        self.add_hookspecs(hookspecs)
        self.providers: dict[str, str] = {}
        self.broken: dict[str, str] = {}

    def load_entry_points(self) -> None:
        """Register every ``rcpu_bench`` entry point; one that fails to import or validate is recorded, not fatal."""
        for entry in metadata.entry_points(group="rcpu_bench"):
            provider = f"{entry.name} ({entry.dist.name} {entry.dist.version})" if entry.dist else entry.name
            try:
                self.register(entry.load(), name=entry.name)
            except Exception as error:  # noqa: BLE001 - a broken plugin must not take the others down
                self.broken[provider] = f"{type(error).__name__}: {error}"
            else:
                self.providers[entry.name] = provider


def plugin_manager(extra_plugins: Iterable[tuple[str, object]] = (), *, entry_points: bool = True) -> PluginManager:
    """A plugin manager with the entry-point plugins (the built-ins included) and any extra (name, plugin)."""
    pm = PluginManager()
    if entry_points:
        pm.load_entry_points()
    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
    return pm


def build_registry(pm: PluginManager) -> Registry:
    """Call every plugin's hooks with a ``register`` bound to that plugin's name.

    A plugin whose hook raises is recorded in ``registry.broken`` (with its provider and error) and skipped.
    """
    registry = Registry()
    registry.broken.update(pm.broken)
    for kind, hook_name in _HOOKS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            provider = pm.providers.get(impl.plugin_name, impl.plugin_name)
            try:
                impl.function(register=registry.registrar(kind, provider))
            except ValueError:
                raise  # duplicate names and bad declarations are the user's to fix
            except Exception as error:  # noqa: BLE001
                registry.broken[provider] = f"{hook_name} raised {type(error).__name__}: {error}"
    if not registry.methods("scorer") or not registry.methods("compensator"):
        raise RuntimeError("no scorers or compensators are registered: the 'rcpu_bench' entry points were not "
                           "found. Install the package (pip install -e .) so its built-in plugin is registered.")
    return registry


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of all installed plugins (built once per process)."""
    return build_registry(plugin_manager())
