"""Benchmark matrices: YAML files that expand into cells, one pruning experiment each.

A matrix names models, methods, pruning ratios, calibration sizes and what to evaluate. Its cells are
models × calibration sizes × methods × ratios, where a λ-grid method (ridge) counts once per λ and an
``ablation`` multiplies the methods by the modules compensated, plus one dense ``original`` cell per
model (ratio 0) when ``include_dense`` is set. The keys (shipped matrices live in ``matrices/``)::

    name: smoke                     # results go to results/<name> by default (default: the file's stem)
    models:                         # a local directory or a hub id; ${shared} is the shared fixtures dir
      - {model: ${shared}/models/stories260K-mha, label: stories260K-mha, revision: null}
    methods:
      - rcpu-rot                    # an alias of rcpu_bench.pruning.methods (the paper's names), except original
      - name: my-ridge              # a custom method: a name and PruneConfig fields (ratio comes from ratios)
        scorer: wanda-sp
        compensator: ridge
        compensator_params: {lam: 1.0}
      - scorers: [wanda-sp, variance]    # a product; `all` = every registered scorer / compensator;
        compensators: all                # combinations that are an alias get its key and label
    ratios: [0.1, 0.2, 0.3]
    calib: {source: tinystories, n_calib: [128], seqlen: 128, seed: 0}
    lambdas: [1.0e-2, 1.0, 1.0e+2]  # the λ grid (default compensators.LAMBDA_GRID)
    eval: [ppl]                     # ppl and/or zeroshot
    ppl_profiles: [rcpu128]
    include_dense: true
    dtype: float32
    device: cpu
    eval_batch_size: 8              # sequences per perplexity batch (does not change results)
    zeroshot_limit: null            # examples per zero-shot task, for quick runs (null: all)
    prune: {batch_size: 8}          # PruneConfig fields for every method (a method's own fields win)
    ablation: {compensate: [none, o_proj, down_proj, both]}

A method is run over the λ grid when it is the λ-grid alias (ls-best), or when its compensator takes
a ``lam`` parameter that the method does not fix. Each cell is identified by ``Cell.id``, a hash of
what it computes; the matrix name, labels and device do not enter it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from importlib import resources
from itertools import product
from pathlib import Path
from typing import Any

import yaml

from rcpu_bench import data
from rcpu_bench.evaluation import perplexity
from rcpu_bench.compensation.compensators import LAMBDA_GRID
from rcpu_bench.matrix.experiment import DEFAULT_CALIB, Experiment
from rcpu_bench.pruning.methods import ALIASES, get_alias, label_of
from rcpu_bench.model.loading import resolve_device, resolve_dtype
from rcpu_bench.paths import shared_dir
from rcpu_bench.pruning.pipeline import MODULES, PruneConfig
from rcpu_bench.registry import Registry

SHARED = "${shared}"
DENSE = "original"
CUSTOM = "custom"
ALL = "all"
EVALS = ("ppl", "zeroshot")
COMPENSATE_VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (), "o_proj": ("attention",), "down_proj": ("mlp",), "both": ("attention", "mlp")}
PRUNE_FIELDS = tuple(f.name for f in fields(PruneConfig) if f.name != "ratio")
_TUPLE_FIELDS = ("prune", "compensate")
TOP_KEYS = ("name", "models", "methods", "ratios", "calib", "lambdas", "eval", "ppl_profiles", "include_dense",
            "dtype", "device", "eval_batch_size", "zeroshot_limit", "prune", "ablation")
MODEL_KEYS = ("model", "label", "revision")
CALIB_KEYS = ("source", "n_calib", "seqlen", "seed")
CUSTOM_KEYS = ("name", *PRUNE_FIELDS)
PRODUCT_KEYS = ("scorers", "compensators")
ABLATION_KEYS = ("compensate",)
# What a cell computes is its configuration without these: renaming or moving a run keeps its cells.
NOT_HASHED = ("matrix", "model_label", "method", "method_label", "device", "eval_batch_size")
# Fields added after results were stored, with their unset value: hashed only when set, so the ids of
# stored cells stay valid.
HASHED_WHEN_SET = {"zeroshot_limit": None}
PRUNE_HASHED_WHEN_SET = {"model_method": None, "model_method_params": {}, "gram_precision": "mixed", "holdout": 0}


class MatrixError(ValueError):
    """A matrix (file or override) that does not validate; the message names the key or value and what is allowed."""


# ------------------------------------------------------------------------------------------ value checks


def error_message(error: Exception) -> str:
    """An exception's message (a KeyError's without the quotes str() adds)."""
    return error.args[0] if isinstance(error, KeyError) and error.args else str(error)


def _keys(where: str, mapping: Any, allowed: Sequence[str], required: Sequence[str] = ()) -> dict[str, Any]:
    """``mapping`` as a dict whose keys are all allowed and include the required ones."""
    if not isinstance(mapping, dict):
        raise MatrixError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {mapping!r}")
    for key in mapping:
        if key not in allowed:
            raise MatrixError(f"{where}: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
    for key in required:
        if key not in mapping:
            raise MatrixError(f"{where}: missing key {key!r} (required: {', '.join(required)})")
    return mapping


def _choice(where: str, value: Any, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise MatrixError(f"{where}: {value!r} is not allowed; allowed: {', '.join(allowed)}")
    return value


def _items(where: str, value: Any) -> list[Any]:
    """A non-empty list (a single value counts as a list of one)."""
    items = value if isinstance(value, list) else [value]
    if not items or None in items:
        raise MatrixError(f"{where}: expected a non-empty list, got {value!r}")
    return items


def _float(where: str, value: Any) -> float:
    """A number; numeric strings count too (YAML 1.1 reads 1e-2 without a dot as a string)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise MatrixError(f"{where}: {value!r} is not a number") from None


def _int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MatrixError(f"{where}: {value!r} is not an integer >= {minimum}")
    return value


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise MatrixError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _checked(where: str, check: Callable[[Any], Any], value: Any) -> Any:
    """``value`` after a library check (dtype, device, profile, calibration spec), its error given a location."""
    try:
        check(value)
    except (ValueError, KeyError, TypeError) as error:
        raise MatrixError(f"{where}: {error_message(error)}") from None
    return value


# ------------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelSpec:
    """A model of the matrix: a local directory (``${shared}`` allowed) or a hub id, its label and revision."""

    model: str
    label: str
    revision: str | None = None


def expand_shared(model: str) -> str:
    """``model`` with ``${shared}`` replaced by the shared fixtures directory."""
    return model.replace(SHARED, str(shared_dir())) if SHARED in model else model


def portable(model: str) -> str:
    """A local path inside the shared fixtures directory written as ``${shared}/...`` (so cell ids match)."""
    path = Path(model).expanduser()
    try:
        return f"{SHARED}/{path.resolve().relative_to(shared_dir().resolve()).as_posix()}" if path.exists() else model
    except (ValueError, FileNotFoundError):
        return model


def _model(where: str, entry: Any) -> ModelSpec:
    entry = {"model": entry} if isinstance(entry, str) else _keys(where, entry, MODEL_KEYS, required=("model",))
    model = portable(_text(f"{where}.model", entry["model"]))
    label = _text(f"{where}.label", entry.get("label", model.rstrip("/").rsplit("/", 1)[-1]))
    revision = entry.get("revision")
    return ModelSpec(model, label, None if revision is None else _text(f"{where}.revision", revision))


# ----------------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class MethodSpec:
    """A resolved method: its key (an alias or ``custom``), label, PruneConfig fields (no ratio), λ grid flag."""

    key: str
    label: str
    fields: dict[str, Any]
    lambda_grid: bool = False

    def with_fields(self, **changes: Any) -> MethodSpec:
        return replace(self, fields={**self.fields, **changes})


def _prune_fields(where: str, mapping: Any) -> dict[str, Any]:
    """PruneConfig fields (but the ratio) from YAML: known names, lists of modules as tuples, parameter mappings."""
    out = dict(_keys(where, mapping, PRUNE_FIELDS))
    for key in _TUPLE_FIELDS:
        if key in out:
            modules = out[key] if isinstance(out[key], list) else [out[key]]  # [] is allowed: compensate nothing
            out[key] = tuple(_choice(f"{where}.{key}", m, MODULES) for m in modules)
    for key in ("scorer_params", "compensator_params"):
        if not isinstance(out.get(key, {}), dict):
            raise MatrixError(f"{where}.{key}: expected a mapping of parameters, got {out[key]!r}")
    return out


def _lambda_grid(method_fields: dict[str, Any], registry: Registry) -> bool:
    """Whether a non-alias method runs over the λ grid: its compensator takes ``lam`` and the method leaves it free."""
    compensator = registry.compensator(method_fields["compensator"])
    return "lam" in compensator.params and "lam" not in method_fields.get("compensator_params", {})


@dataclass(frozen=True)
class AliasEntry:
    """A method of the paper by its alias key."""

    key: str

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        alias = get_alias(self.key)
        return [MethodSpec(alias.key, alias.label, dict(alias.prune), alias.lambda_grid)]


@dataclass(frozen=True)
class CustomEntry:
    """A named method given by its PruneConfig fields."""

    name: str
    fields: dict[str, Any]

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        return [MethodSpec(CUSTOM, self.name, dict(self.fields), _lambda_grid(self.fields, registry))]


def _alias_of(method_fields: dict[str, Any]) -> str | None:
    """The alias key whose configuration ``method_fields`` (with defaults elsewhere) is, if any."""
    label = label_of(PruneConfig(**method_fields).to_dict())
    return next((a.key for a in ALIASES.values() if a.label == label), None)


@dataclass(frozen=True)
class ProductEntry:
    """Every scorer × every compensator of two lists (``all``: every registered one)."""

    scorers: tuple[str, ...] | str
    compensators: tuple[str, ...] | str

    def resolve(self, registry: Registry) -> list[MethodSpec]:
        scorers = self._names(self.scorers, registry.scorer, registry.methods("scorer"))
        compensators = self._names(self.compensators, registry.compensator, registry.methods("compensator"))
        return [self._spec({"scorer": s, "compensator": c}, registry) for s, c in product(scorers, compensators)]

    @staticmethod
    def _names(names: tuple[str, ...] | str, lookup: Callable[[str], Any], registered: list[Any]) -> list[str]:
        if names == ALL:
            return [m.name for m in registered]
        return [lookup(name).name for name in names]

    @staticmethod
    def _spec(method_fields: dict[str, Any], registry: Registry) -> MethodSpec:
        key = _alias_of(method_fields)
        if key:
            return AliasEntry(key).resolve(registry)[0]
        name = f"{method_fields['scorer']}+{method_fields['compensator']}"
        return CustomEntry(name, method_fields).resolve(registry)[0]


MethodEntry = AliasEntry | CustomEntry | ProductEntry
_METHOD_FORMS = ("an alias key, a custom method {name, scorer, compensator, ...PruneConfig fields} or a product "
                 "{scorers, compensators}")


def _alias_entry(where: str, key: str) -> AliasEntry:
    if key == DENSE:
        raise MatrixError(f"{where}: {DENSE!r} is not a method to prune with; set include_dense: true")
    return AliasEntry(_choice(where, key, [k for k in ALIASES if k != DENSE]))


def _custom_entry(where: str, entry: dict[str, Any]) -> CustomEntry:
    _keys(where, entry, CUSTOM_KEYS, required=("name", "scorer", "compensator"))
    method_fields = _prune_fields(where, {k: v for k, v in entry.items() if k != "name"})
    return CustomEntry(_text(f"{where}.name", entry["name"]), method_fields)


def _names(where: str, value: Any) -> tuple[str, ...] | str:
    """``all`` or a list of method names."""
    return value if value == ALL else tuple(_text(where, name) for name in _items(where, value))


def _product_entry(where: str, entry: dict[str, Any]) -> ProductEntry:
    _keys(where, entry, PRODUCT_KEYS, required=PRODUCT_KEYS)
    return ProductEntry(_names(f"{where}.scorers", entry["scorers"]),
                        _names(f"{where}.compensators", entry["compensators"]))


def _method(where: str, entry: Any) -> MethodEntry:
    if isinstance(entry, str):
        return _alias_entry(where, entry)
    if isinstance(entry, dict) and "name" in entry:
        return _custom_entry(where, entry)
    if isinstance(entry, dict) and set(entry) & set(PRODUCT_KEYS):
        return _product_entry(where, entry)
    raise MatrixError(f"{where}: {entry!r} is not a method; expected {_METHOD_FORMS}")


# ------------------------------------------------------------------------------------------------ matrix


@dataclass(frozen=True)
class CalibGrid:
    """Calibration windows from ``source``: one setting per size in ``n_calib``."""

    source: str
    n_calib: tuple[int, ...]
    seqlen: int
    seed: int

    def spec(self, n_calib: int) -> str:
        return str(data.CalibSpec(self.source, n_calib, self.seqlen, self.seed))


def _calib(where: str, value: Any) -> CalibGrid:
    default = data.parse_calib(DEFAULT_CALIB)
    value = {"source": default.source, "n_calib": default.n_samples, "seqlen": default.seqlen, "seed": default.seed,
             **_keys(where, value, CALIB_KEYS)}
    sizes = tuple(_int(f"{where}.n_calib", n, 1) for n in _items(f"{where}.n_calib", value["n_calib"]))
    grid = CalibGrid(_text(f"{where}.source", value["source"]), sizes, _int(f"{where}.seqlen", value["seqlen"], 1),
                     _int(f"{where}.seed", value["seed"], 0))
    return _checked(where, lambda g: g.spec(g.n_calib[0]), grid)


def _ratio(where: str, value: Any) -> float:
    ratio = _float(where, value)
    if not 0.0 < ratio < 1.0:
        raise MatrixError(f"{where}: ratio {ratio} is outside (0, 1); the dense model is include_dense: true")
    return ratio


def _lambda(where: str, value: Any) -> float:
    lam = _float(where, value)
    if lam < 0:
        raise MatrixError(f"{where}: λ {lam} must be >= 0")
    return lam


@dataclass(frozen=True)
class Matrix:
    """A validated matrix; ``expand`` turns it into cells."""

    name: str
    models: tuple[ModelSpec, ...]
    methods: tuple[MethodEntry, ...]
    ratios: tuple[float, ...]
    calib: CalibGrid
    lambdas: tuple[float, ...] = LAMBDA_GRID
    eval: tuple[str, ...] = ("ppl",)
    ppl_profiles: tuple[str, ...] = ("rcpu128",)
    include_dense: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    eval_batch_size: int = 8  # sequences per perplexity batch; does not change the result
    zeroshot_limit: int | None = None  # examples per zero-shot task (None: all), for quick runs
    prune: dict[str, Any] = field(default_factory=dict)  # PruneConfig fields for every method
    compensate: tuple[str, ...] = ()  # ablation variants (COMPENSATE_VARIANTS keys); () = no ablation


def _listed(raw: dict[str, Any], key: str, check: Callable[[str, Any], Any], default: Any = None) -> tuple[Any, ...]:
    """``raw[key]`` (else ``default``) as a non-empty list, each item checked."""
    return tuple(check(f"{key}[{i}]", item) for i, item in enumerate(_items(key, raw.get(key, default))))


def _ablation(value: Any) -> tuple[str, ...]:
    ablation = _keys("ablation", value, ABLATION_KEYS)
    return _listed(ablation, "compensate", lambda where, v: _choice(f"ablation.{where}", v, COMPENSATE_VARIANTS)
                   ) if "compensate" in ablation else ()


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MatrixError(f"{where}: {value!r} is not allowed; allowed: true, false")
    return value


def parse_matrix(raw: Any, default_name: str = "matrix") -> Matrix:
    """Validate a matrix mapping (as read from YAML) into a Matrix; raise MatrixError naming what is wrong."""
    raw = _keys("matrix", raw, TOP_KEYS, required=("models", "methods", "ratios"))
    return Matrix(
        name=_text("name", raw.get("name", default_name)),
        models=_listed(raw, "models", _model),
        methods=_listed(raw, "methods", _method),
        ratios=_listed(raw, "ratios", _ratio),
        calib=_calib("calib", raw.get("calib", {})),
        lambdas=_listed(raw, "lambdas", _lambda, list(LAMBDA_GRID)),
        eval=_listed(raw, "eval", lambda where, v: _choice(where, v, EVALS), ["ppl"]),
        ppl_profiles=_listed(raw, "ppl_profiles", lambda where, v: _checked(where, perplexity.get_profile, v),
                             ["rcpu128"]),
        include_dense=_flag("include_dense", raw.get("include_dense", False)),
        dtype=_checked("dtype", resolve_dtype, raw.get("dtype", "float32")),
        device=_checked("device", resolve_device, raw.get("device", "cpu")),
        eval_batch_size=_int("eval_batch_size", raw.get("eval_batch_size", 8), 1),
        zeroshot_limit=None if raw.get("zeroshot_limit") is None else _int("zeroshot_limit", raw["zeroshot_limit"], 1),
        prune=_prune_fields("prune", raw.get("prune", {})),
        compensate=_ablation(raw.get("ablation", {})),
    )


# --------------------------------------------------------------------------------------------- loading


def shipped_matrices() -> list[str]:
    """Names of the matrices shipped with the package (``rcpu_bench/matrices/*.yaml``)."""
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("rcpu_bench").joinpath("matrices").iterdir()
                  if p.name.endswith(".yaml"))


def read_matrix(name_or_file: str) -> tuple[Any, str]:
    """The raw mapping of a matrix file or shipped matrix name, and the default name (the file's stem)."""
    path = Path(name_or_file)
    if path.is_file():
        text, stem = path.read_text(encoding="utf-8"), path.stem
    elif name_or_file in shipped_matrices():
        text = resources.files("rcpu_bench").joinpath("matrices", f"{name_or_file}.yaml").read_text(encoding="utf-8")
        stem = name_or_file
    else:
        shipped = ", ".join(shipped_matrices())
        raise MatrixError(f"no matrix file or shipped matrix {name_or_file!r}; shipped: {shipped}")
    try:
        return yaml.safe_load(text), stem
    except yaml.YAMLError as error:
        raise MatrixError(f"matrix {name_or_file}: not valid YAML: {error}") from None


def parse_set(text: str) -> tuple[str, Any]:
    """``dotted.key=value`` with the value parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise MatrixError(f"--set {text!r}: expected dotted.key=value")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise MatrixError(f"--set {text!r}: the value is not valid YAML: {error}") from None


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``raw[a][b]... = value`` for ``a.b...``; missing mappings are created, list items are chosen by index."""
    *path, last = dotted.split(".")
    node: Any = raw
    for key in path:
        node = node[_index(dotted, node, key)] if isinstance(node, list) else node.setdefault(key, {})
        if not isinstance(node, (dict, list)):
            raise MatrixError(f"--set {dotted}: {key!r} holds {node!r}, not a mapping or list")
    node[_index(dotted, node, last) if isinstance(node, list) else last] = value


def _index(dotted: str, items: list[Any], key: str) -> int:
    if not key.isdigit() or int(key) >= len(items):
        raise MatrixError(f"--set {dotted}: {key!r} is not an index of a list of {len(items)} items")
    return int(key)


def apply_overrides(raw: Any, *, model: str | None = None, ratios: str | None = None,
                    sets: Iterable[str] = ()) -> Any:
    """A copy of ``raw`` with the command line's --model (replaces the models), --ratios (a,b,...) and --set applied."""
    raw = copy.deepcopy(raw)
    if not isinstance(raw, dict):
        return raw  # parse_matrix reports it
    if model is not None:
        raw["models"] = [model]
    if ratios is not None:
        raw["ratios"] = [r.strip() for r in ratios.split(",")]
    for text in sets:
        set_dotted(raw, *parse_set(text))
    return raw


def load_matrix(name_or_file: str, *, model: str | None = None, ratios: str | None = None,
                sets: Iterable[str] = ()) -> Matrix:
    """Read, override and validate a matrix."""
    raw, stem = read_matrix(name_or_file)
    return parse_matrix(apply_overrides(raw, model=model, ratios=ratios, sets=sets), stem)


# ------------------------------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    """One experiment of a matrix, as recorded in the store's ``cell`` field."""

    matrix: str
    model: str
    model_label: str
    revision: str | None
    method: str
    method_label: str
    ratio: float
    n_calib: int
    seqlen: int
    calib: str
    lam: float | None
    prune: dict[str, Any]
    ppl_profiles: tuple[str, ...]
    eval: tuple[str, ...]
    dtype: str
    device: str
    eval_batch_size: int = 8
    zeroshot_limit: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The cell as JSON data (tuples as lists), as the store records it."""
        return json.loads(json.dumps(asdict(self)))

    @cached_property
    def id(self) -> str:
        """sha256 of the canonical JSON of what the cell computes (everything but NOT_HASHED), 16 hex digits."""
        config = _drop_unset({k: v for k, v in self.to_dict().items() if k not in NOT_HASHED}, HASHED_WHEN_SET)
        config["prune"] = _drop_unset(config["prune"], PRUNE_HASHED_WHEN_SET)
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def prune_config(self) -> PruneConfig:
        return PruneConfig(**{**self.prune, **{k: tuple(self.prune[k]) for k in _TUPLE_FIELDS}})

    def experiment(self) -> Experiment:
        return Experiment(model=expand_shared(self.model), prune=self.prune_config(), calib=self.calib,
                          ppl_profiles=self.ppl_profiles, revision=self.revision, dtype=self.dtype, device=self.device,
                          eval_batch_size=self.eval_batch_size)

    def method_name(self) -> str:
        """The method's label, with the compensated modules when not all of them (the ablation)."""
        compensate = tuple(self.prune["compensate"])
        if compensate == MODULES:
            return self.method_label
        return f"{self.method_label} [compensate: {','.join(compensate) or 'none'}]"

    def describe(self) -> str:
        """Model, method, ratio, N and λ in one line."""
        lam = f" λ={self.lam:g}" if self.lam is not None else ""
        return f"{self.model_label} | {self.method_name()} | ρ={self.ratio:g} N={self.n_calib}{lam}"


def _drop_unset(config: dict[str, Any], unset: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not (k in unset and v == unset[k])}


def method_specs(matrix: Matrix, registry: Registry) -> list[MethodSpec]:
    """The matrix's methods resolved: one per λ for λ-grid methods, times the ablation variants."""
    specs = []
    for i, entry in enumerate(matrix.methods):
        try:
            specs += entry.resolve(registry)
        except (KeyError, ValueError) as error:
            raise MatrixError(f"methods[{i}]: {error_message(error)}") from None
    specs = [grid for spec in specs for grid in _over_lambdas(spec, matrix.lambdas)]
    if matrix.compensate:
        specs = [spec.with_fields(compensate=COMPENSATE_VARIANTS[v]) for spec in specs for v in matrix.compensate]
    return specs


def _over_lambdas(spec: MethodSpec, lambdas: Sequence[float]) -> list[MethodSpec]:
    if not spec.lambda_grid:
        return [spec]
    params = spec.fields.get("compensator_params", {})
    return [spec.with_fields(compensator_params={**params, "lam": lam}) for lam in lambdas]


def _cell(matrix: Matrix, model: ModelSpec, spec: MethodSpec, ratio: float, n_calib: int) -> Cell:
    prune = PruneConfig(**{**matrix.prune, **spec.fields, "ratio": ratio}).to_dict()
    return Cell(matrix=matrix.name, model=model.model, model_label=model.label, revision=model.revision,
                method=spec.key, method_label=spec.label, ratio=ratio, n_calib=n_calib, seqlen=matrix.calib.seqlen,
                calib=matrix.calib.spec(n_calib), lam=prune["compensator_params"].get("lam"), prune=prune,
                ppl_profiles=matrix.ppl_profiles if "ppl" in matrix.eval else (), eval=matrix.eval,
                dtype=matrix.dtype, device=matrix.device, eval_batch_size=matrix.eval_batch_size,
                zeroshot_limit=matrix.zeroshot_limit if "zeroshot" in matrix.eval else None)


def _dense(matrix: Matrix, model: ModelSpec) -> Cell:
    alias = get_alias(DENSE)
    spec = MethodSpec(alias.key, alias.label, {k: v for k, v in alias.prune.items() if k != "ratio"})
    return _cell(matrix, model, spec, alias.prune["ratio"], matrix.calib.n_calib[0])


def expand(matrix: Matrix, registry: Registry) -> list[Cell]:
    """All cells, model by model (so each model is loaded once), every cell's PruneConfig validated."""
    specs = method_specs(matrix, registry)
    cells = []
    for model in matrix.models:
        cells += [_dense(matrix, model)] if matrix.include_dense else []
        cells += [_cell(matrix, model, spec, ratio, n) for n, spec, ratio in product(matrix.calib.n_calib, specs,
                                                                                     matrix.ratios)]
    _check_unique(cells)
    for cell in cells:
        try:
            cell.prune_config().validate(registry)
        except (KeyError, ValueError) as error:
            raise MatrixError(f"cell {cell.describe()}: {error_message(error)}") from None
    return cells


def _check_unique(cells: list[Cell]) -> None:
    seen: dict[str, Cell] = {}
    for cell in cells:
        if cell.id in seen:
            raise MatrixError(f"cells {seen[cell.id].describe()!r} and {cell.describe()!r} compute the same thing "
                              f"(cell id {cell.id}); list the method once")
        seen[cell.id] = cell
