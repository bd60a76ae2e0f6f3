"""What a matrix lists: its models, its method entries and its calibration grid, each a dataclass whose fields declare
its keys (:func:`rcpu_bench.declaration.key`, :func:`rcpu_bench.declaration.reused`).

A *method entry* (see the glossary of :mod:`rcpu_bench.pruning.methods`) is a recipe key, a named custom
configuration or a scorers × compensators product; each resolves to :class:`MethodSpec` s, the option
values of one method without the ratio. The cell's key and label come later, from its final configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from rcpu_bench import data
from rcpu_bench.declaration import Option, declared, key, reused
from rcpu_bench.experiment import BY_NAME as EXPERIMENT
from rcpu_bench.experiment import DEFAULT_CALIB
from rcpu_bench.matrix.cells import SHARED, portable
from rcpu_bench.matrix.schema import (
    REQUIRED,
    MatrixError,
    Reader,
    checked,
    error_message,
    flag,
    integer,
    items,
    listed,
    matrix_key,
    option_key,
    optional,
    read_keys,
    text,
)
from rcpu_bench.pruning import options
from rcpu_bench.pruning.methods import RECIPES
from rcpu_bench.registry import Registry

DENSE = "original"
ALL = "all"

# ------------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelSpec:
    """A model of the matrix: a local directory (``${shared}`` allowed) or a hub id, its label and revision."""

    model: str = key(lambda where, value: portable(text(where, value)),
                     f"a local directory or a hub id; {SHARED} is the shared fixtures directory")
    label: str = key(text, "the name the tables show (default: the last part of the path)", None)
    revision: str | None = reused(EXPERIMENT["revision"])


MODEL_KEYS = declared(ModelSpec)


def read_model(where: str, entry: Any) -> ModelSpec:
    """A ``models`` item: a path or hub id, or a mapping of MODEL_KEYS."""
    entry = read_keys(where, {"model": entry} if isinstance(entry, str) else entry, MODEL_KEYS)
    return ModelSpec(**{**entry, "label": entry["label"] or entry["model"].rstrip("/").rsplit("/", 1)[-1]})


# ----------------------------------------------------------------------------------------------- methods


def _typed(option: Option) -> Reader:
    """A reader of a YAML value into the option's field type (lists of modules as tuples); the option checks it."""
    return lambda where, value: options.as_field_type(option, value)


PRUNE_KEYS = tuple(option_key(o, _typed(o)) for o in options.OPTIONS if o.name != "ratio")


def read_prune(where: str, mapping: Any) -> dict[str, Any]:
    """Options but the ratio (which comes from ``ratios``), as given (defaults are not filled in)."""
    given = read_keys(where, mapping, PRUNE_KEYS)
    return {name: value for name, value in given.items() if name in mapping}


@dataclass(frozen=True)
class MethodSpec:
    """A resolved method entry: the option values it sets (no ratio), the name a custom entry gave it."""

    fields: dict[str, Any]
    name: str | None = None

    def with_fields(self, **changes: Any) -> MethodSpec:
        return replace(self, fields={**self.fields, **changes})


@dataclass(frozen=True)
class RecipeEntry:
    """A recipe of the paper by its key."""

    key: str

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        return [MethodSpec({k: v for k, v in RECIPES[self.key].prune.items() if k != "ratio"})]


@dataclass(frozen=True)
class CustomEntry:
    """A named method given by its options."""

    name: str
    fields: dict[str, Any]

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        return [MethodSpec(dict(self.fields), self.name)]


def _names(where: str, value: Any) -> tuple[str, ...] | str:
    """``all`` or a list of registered names."""
    return value if value == ALL else tuple(text(f"{where}[{i}]", name) for i, name in enumerate(items(where, value)))


@dataclass(frozen=True)
class ProductEntry:
    """Every scorer (or selector) × every compensator [× every allocation] of the lists (``all``: every registered
    one); without ``allocations`` the allocation is the matrix's."""

    scorers: tuple[str, ...] | str = key(_names, f"registered scorers or selectors, or {ALL}")
    compensators: tuple[str, ...] | str = key(_names, f"registered compensators, or {ALL}")
    allocations: tuple[str, ...] | str | None = key(optional(_names), f"registered allocations or al-am, or {ALL} "
                                                    "(default: the matrix's allocation)", None)

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        scorers = self._names(self.scorers, registry.selection,
                              [*registry.methods("scorer"), *registry.methods("selector")])
        compensators = self._names(self.compensators, registry.compensator, registry.methods("compensator"))
        if self.allocations is None:
            return [MethodSpec({"scorer": s, "compensator": c}) for s, c in product(scorers, compensators)]
        allocations = self._allocations(self.allocations, registry)
        return [MethodSpec({"scorer": s, "compensator": c, "allocation": a})
                for s, c, a in product(scorers, compensators, allocations)]

    @staticmethod
    def _allocations(names: tuple[str, ...] | str, registry: Registry) -> list[str]:
        """Registered allocations, or al-am (which the pipeline computes from the data)."""
        if names == ALL:
            return [options.AL_AM, *(m.name for m in registry.methods("allocation"))]
        return [name if name == options.AL_AM else registry.allocation(name).name for name in names]

    @staticmethod
    def _names(names: tuple[str, ...] | str, lookup: Callable[[str], Any], registered: list[Any]) -> list[str]:
        if names == ALL:
            return [m.name for m in registered]
        return [lookup(name).name for name in names]


PRODUCT_KEYS = declared(ProductEntry)
MethodEntry = RecipeEntry | CustomEntry | ProductEntry
_METHOD_FORMS = ("a recipe key, a custom method {name, scorer, compensator, ...options} or a product "
                 "{scorers, compensators}")


CUSTOM_KEYS = (matrix_key("name", text, "the label of the method's cells"),
               *(replace(option, default=REQUIRED if option.name in ("scorer", "compensator") else option.default)
                 for option in PRUNE_KEYS))


def read_method(where: str, entry: Any) -> MethodEntry:
    """A ``methods`` item in one of its three forms."""
    if isinstance(entry, str):
        if entry == DENSE:
            raise MatrixError(f"{where}: {DENSE!r} is not a method to prune with; set include_dense: true")
        allowed = [key for key in RECIPES if key != DENSE]
        if entry not in allowed:
            raise MatrixError(f"{where}: {entry!r} is not allowed; allowed: {', '.join(allowed)}")
        return RecipeEntry(entry)
    if isinstance(entry, dict) and "name" in entry:
        given = read_keys(where, entry, CUSTOM_KEYS)
        return CustomEntry(given["name"], {name: given[name] for name in entry if name != "name"})
    if isinstance(entry, dict) and set(entry) & {key.name for key in PRODUCT_KEYS}:
        return ProductEntry(**read_keys(where, entry, PRODUCT_KEYS))
    raise MatrixError(f"{where}: {entry!r} is not a method; expected {_METHOD_FORMS}")


def lambda_grid(config: dict[str, Any], registry: Registry) -> bool:
    """Whether a method runs over the λ grid: its compensator takes ``lam`` and the method leaves it free."""
    if config.get("model_method") is not None:
        return False
    compensator = registry.compensator(config.get("compensator", options.BY_NAME["compensator"].default))
    return "lam" in compensator.params and "lam" not in config.get("compensator_params", {})


def resolve(entry: MethodEntry, where: str, registry: Registry) -> list[MethodSpec]:
    """An entry's specs; a registry lookup that fails names the entry."""
    try:
        return entry.resolve(registry)
    except (KeyError, ValueError) as error:
        raise MatrixError(f"{where}: {error_message(error)}") from None


# ------------------------------------------------------------------------------------------- calibration


_DEFAULT = data.parse_calib(DEFAULT_CALIB)


@dataclass(frozen=True)
class CalibGrid:
    """Calibration windows from ``source``: one setting per size in ``n_calib``."""

    source: str = key(text, "wikitext2, tinystories, tinystories[A:B] or file:PATH", _DEFAULT.source)
    n_calib: tuple[int, ...] = key(listed(integer(1)), "calibration sequences; a list runs each size",
                                   (_DEFAULT.n_samples,))
    seqlen: int = key(integer(1), "tokens per calibration sequence", _DEFAULT.seqlen)
    seed: int = key(integer(0), "the sampling seed", _DEFAULT.seed)
    bos: bool = key(flag, "each window begins with the tokenizer's BOS (when it adds one)", False)

    def spec(self, n_calib: int) -> str:
        return str(data.CalibSpec(self.source, n_calib, self.seqlen, self.seed, self.bos))


CALIB_KEYS = declared(CalibGrid)


def read_calib(where: str, value: Any) -> CalibGrid:
    grid = CalibGrid(**read_keys(where, value, CALIB_KEYS))
    return checked(lambda g: g.spec(g.n_calib[0]), lambda _, g: g)(where, grid)

