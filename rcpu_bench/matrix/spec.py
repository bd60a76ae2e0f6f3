"""Benchmark matrices: YAML files that expand into cells, one pruning experiment each.

A matrix names models, methods, pruning ratios, calibration sizes and what to evaluate. Its cells are
models × calibration sizes × methods × ratios, where a λ-grid method (ridge) counts once per λ and an
``ablation`` multiplies the methods by the modules compensated, plus one dense ``original`` cell per
model (ratio 0) when ``include_dense`` is set. Every key in an example (their meanings and defaults:
:data:`TOP_KEYS`; shipped matrices live in ``matrix/shipped/``)::

    name: smoke                     # results go to results/<name> by default (default: the file's stem)
    models:                         # a local directory or a hub id; ${shared} is the shared fixtures dir
      - {model: ${shared}/models/stories260K-mha, label: stories260K-mha, revision: null}
    methods:
      - rcpu-rot                    # a recipe key of rcpu_bench.pruning.methods (the paper's names), but original
      - name: my-ridge              # a custom method: a name and options (rcpu_bench.pruning.options; no ratio)
        scorer: wanda-sp
        compensator: ridge
        compensator_params: {lam: 1.0}
      - scorers: [wanda-sp, variance]    # a product; `all` = every registered scorer / compensator;
        compensators: all                # combinations that are a recipe get its key and label
    ratios: [0.1, 0.2, 0.3]
    calib: {source: tinystories, n_calib: [128], seqlen: 128, seed: 0}
    lambdas: [1.0e-2, 1.0, 1.0e+2]  # the λ grid (default compensators.LAMBDA_GRID)
    eval: [ppl]                     # ppl, zeroshot and/or speed-llama-cpp
    ppl_profiles: [rcpu128]
    include_dense: true
    dtype: float32
    device: cpu
    eval_batch_size: 8              # sequences per perplexity batch (does not change results)
    zeroshot_limit: null            # examples per zero-shot task, for quick runs (null: all)
    zeroshot_ratios: null           # the ratios evaluated zero-shot (null: all; the dense model always is)
    skip: [speed, sample]           # measurements left out: calibration-ppl (λ-grid cells keep it), speed, sample
    prune: {batch_size: 8}          # options for every method (a method's own options win)
    ablation: {compensate: [none, o_proj, down_proj, both]}
    report_to: [mlflow]             # experiment trackers logging each cell: mlflow, wandb (default: none)

Every key is declared once, with its reader, default and help (:data:`TOP_KEYS` here, the nested ones in
:mod:`rcpu_bench.matrix.entries`, generic readers in :mod:`rcpu_bench.matrix.schema`). A method runs over
the λ grid when its compensator takes a ``lam`` parameter that the method does not fix (ridge, so the
recipe ls-best). A cell's key and label come from its final configuration
(:func:`rcpu_bench.pruning.methods.method_label`): ``methods: [rcpu-rot]`` with ``prune: {statistics:
one-shot}`` is not RCPU (Rot.). Each cell is identified by ``Cell.id``, a hash of what it computes
(:mod:`rcpu_bench.matrix.cells`); the matrix name, labels and device do not enter it.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from importlib import resources
from itertools import product
from pathlib import Path
from typing import Any

import yaml

from rcpu_bench.compensation.compensators import LAMBDA_GRID
from rcpu_bench.declaration import declared, key, option, reused
from rcpu_bench.evaluation import perplexity
from rcpu_bench.experiment import BY_NAME as EXPERIMENT
from rcpu_bench.experiment import DEFAULT_PPL_PROFILES, SKIPPABLE
from rcpu_bench.matrix.cells import SHARED, Cell, derived
from rcpu_bench.matrix.entries import (
    DENSE,
    CalibGrid,
    MethodEntry,
    MethodSpec,
    ModelSpec,
    lambda_grid,
    read_calib,
    read_method,
    read_model,
    read_prune,
    resolve,
)
from rcpu_bench.matrix.schema import (
    MatrixError,
    checked,
    choice,
    error_message,
    flag,
    listed,
    markdown_table,
    matrix_key,
    number,
    optional,
    read_keys,
    subset,
    text,
)
from rcpu_bench.pruning.methods import CUSTOM, RECIPES, method_label, recipe_of
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.registry import Registry
from rcpu_bench.tracking import TRACKERS

# Cell, MatrixError and error_message are defined in matrix.cells and matrix.schema; importers may take them from here.
__all__ = ["SHARED", "Cell", "Matrix", "MatrixError", "apply_overrides", "error_message", "expand", "load_matrix",
           "parse_matrix", "read_matrix", "shipped_matrices"]

EVALS = ("ppl", "zeroshot", "speed-llama-cpp")
COMPENSATE_VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (), "o_proj": ("attention",), "down_proj": ("mlp",), "both": ("attention", "mlp")}


def _ratio(where: str, value: Any) -> float:
    ratio = number(where, value)
    if not 0.0 < ratio < 1.0:
        raise MatrixError(f"{where}: ratio {ratio} is outside (0, 1); the dense model is include_dense: true")
    return ratio


def _lambda(where: str, value: Any) -> float:
    lam = number(where, value)
    if lam < 0:
        raise MatrixError(f"{where}: λ {lam} must be >= 0")
    return lam


def _matrix_name(where: str, value: Any) -> str:
    """A matrix name: one path component, so that results/<name> stays inside results/."""
    name = text(where, value)
    if "/" in name or "\\" in name or ".." in name or name == ".":
        raise MatrixError(f"{where}: {name!r} must be a plain name (no '/', '\\' or '..'): results go to "
                          "results/<name>")
    return name


ABLATION_KEYS = (matrix_key("compensate", listed(choice(COMPENSATE_VARIANTS)),
                            "the modules compensated, one variant each: " + ", ".join(COMPENSATE_VARIANTS), ()),)


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """A validated matrix; ``expand`` turns it into cells. Each field declares the key of the same name (what it
    means, how it is read, its default): :data:`TOP_KEYS` derives from them."""

    name: str = key(_matrix_name, "results go to results/<name> by default (no path separators, no ..)", None,
                    "the file's stem")
    models: tuple[ModelSpec, ...] = key(listed(read_model), f"local directories or hub ids ({SHARED}: the shared "
                                        "fixtures), or mappings {model, label, revision}")
    methods: tuple[MethodEntry, ...] = key(listed(read_method), "recipe keys, custom methods {name, ...options} or "
                                           "products {scorers, compensators}")
    ratios: tuple[float, ...] = key(listed(_ratio), "pruning ratios in (0, 1)")
    calib: CalibGrid = key(read_calib, "calibration: {source, n_calib, seqlen, seed}", read_calib("calib", {}),
                           "see below")
    lambdas: tuple[float, ...] = key(listed(_lambda), "the λ grid of λ-grid methods", LAMBDA_GRID)
    eval: tuple[str, ...] = key(listed(choice(EVALS)), "what to evaluate: ppl, zeroshot (lm-eval), speed-llama-cpp "
                                "(llama.cpp tokens/s of a temporary GGUF export, CPU, batch 1)", ("ppl",))
    ppl_profiles: tuple[str, ...] = key(listed(checked(perplexity.get_profile)), "perplexity profiles",
                                        DEFAULT_PPL_PROFILES)
    include_dense: bool = key(flag, "add one dense (original) cell per model", False)
    dtype: str = reused(EXPERIMENT["dtype"])
    device: str = reused(EXPERIMENT["device"])
    eval_batch_size: int = reused(EXPERIMENT["eval_batch_size"])
    zeroshot_limit: int | None = option("count", None, "examples per zero-shot task, for quick runs (null: all)")
    zeroshot_ratios: tuple[float, ...] | None = key(optional(listed(_ratio)), "the ratios whose cells run the "
                                                    "zero-shot evaluation (null: every ratio; the dense model always "
                                                    "runs it)", None)
    skip: tuple[str, ...] = key(listed(choice(SKIPPABLE)), "measurements the cells leave out of their records: "
                                "calibration-ppl (λ-grid cells keep it: the λ rule reads it), speed, sample", ())
    prune: dict[str, Any] = key(read_prune, "options for every method (a method's own options win)", {})
    ablation: tuple[str, ...] = key(lambda where, value: read_keys(where, value, ABLATION_KEYS)["compensate"],
                                    "{compensate: [...]}: multiply the methods by the modules compensated", (),
                                    "none")
    report_to: tuple[str, ...] = option("subset", (), "experiment trackers that log each run (transformers' "
                                        f"report_to): {', '.join(TRACKERS)} (a comma list) or none; run "
                                        "--report-to replaces a matrix's report_to", choices=TRACKERS,
                                        shown="none", read=subset)


TOP_KEYS = declared(Matrix)
BY_KEY = {declared_key.name: declared_key for declared_key in TOP_KEYS}


def key_table() -> str:
    """The reference table of a matrix's top-level keys."""
    return markdown_table(TOP_KEYS)


def parse_matrix(raw: Any, default_name: str = "matrix") -> Matrix:
    """Validate a matrix mapping (as read from YAML) into a Matrix; raise MatrixError naming what is wrong."""
    given = read_keys("", raw, TOP_KEYS)
    given["name"] = given["name"] or default_name
    return Matrix(**given)


# --------------------------------------------------------------------------------------------- loading


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping holds the same key twice."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping holding the same key twice (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}  # key → its 1-based line
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error names an unhashable key
            line = key_node.start_mark.line + 1
            if key in lines:
                raise DuplicateKeyError(f"the key {key!r} is given twice in one mapping, on lines {lines[key]} "
                                        f"and {line}; give each key once")
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


SHIPPED = resources.files("rcpu_bench.matrix").joinpath("shipped")  # the matrices shipped with the package


def shipped_matrices() -> list[str]:
    """Names of the matrices shipped with the package (``rcpu_bench/matrix/shipped/*.yaml``)."""
    return sorted(p.name.removesuffix(".yaml") for p in SHIPPED.iterdir() if p.name.endswith(".yaml"))


def read_matrix(name_or_file: str) -> tuple[Any, str]:
    """The raw mapping of a matrix file or shipped matrix name, and the default name (the file's stem)."""
    path = Path(name_or_file)
    if path.is_file():
        text, stem = path.read_text(encoding="utf-8"), path.stem
    elif name_or_file in shipped_matrices():
        text = SHIPPED.joinpath(f"{name_or_file}.yaml").read_text(encoding="utf-8")
        stem = name_or_file
    else:
        shipped = ", ".join(shipped_matrices())
        raise MatrixError(f"no matrix file or shipped matrix {name_or_file!r}; shipped: {shipped}")
    try:
        return yaml.load(text, Loader=UniqueKeyLoader), stem
    except yaml.YAMLError as error:
        raise MatrixError(f"matrix {name_or_file}: not valid YAML: {yaml_problem(error)}") from None


def parse_set(text: str) -> tuple[str, Any]:
    """``dotted.key=value`` with the value parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise MatrixError(f"--set {text!r}: expected dotted.key=value")
    try:
        return key, yaml.load(value, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise MatrixError(f"--set {text!r}: the value is not valid YAML: {yaml_problem(error)}") from None


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column), without the excerpt PyYAML draws."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{error.problem}{where}"
    return " ".join(str(error).split())


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``raw[a][b]... = value`` for ``a.b...``; missing mappings are created, list items are chosen by index."""
    *path, last = dotted.split(".")
    node: Any = raw
    for part in path:
        node = node[_index(dotted, node, part)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise MatrixError(f"--set {dotted}: {part!r} holds {node!r}, not a mapping or list")
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
    for setting in sets:
        set_dotted(raw, *parse_set(setting))
    return raw


def load_matrix(name_or_file: str, *, model: str | None = None, ratios: str | None = None,
                sets: Iterable[str] = ()) -> Matrix:
    """Read, override and validate a matrix."""
    raw, stem = read_matrix(name_or_file)
    return parse_matrix(apply_overrides(raw, model=model, ratios=ratios, sets=sets), stem)


# ------------------------------------------------------------------------------------------------- cells


def method_specs(matrix: Matrix, registry: Registry) -> list[MethodSpec]:
    """The matrix's methods resolved: one per λ for λ-grid methods, times the ablation variants."""
    specs = []
    for i, entry in enumerate(matrix.methods):
        for spec in resolve(entry, f"methods[{i}]", registry):
            specs += _over_lambdas(spec, matrix, f"methods[{i}]", registry)
    if matrix.ablation:
        specs = [spec.with_fields(compensate=COMPENSATE_VARIANTS[v]) for spec in specs for v in matrix.ablation]
    return specs


def _over_lambdas(spec: MethodSpec, matrix: Matrix, where: str, registry: Registry) -> list[MethodSpec]:
    """One spec per λ of the grid when the method's final configuration leaves a ``lam`` free, else the spec."""
    try:
        grid = lambda_grid({**matrix.prune, **spec.fields}, registry)
    except (KeyError, ValueError) as error:
        raise MatrixError(f"{where}: {error_message(error)}") from None
    if not grid:
        return [spec]
    params = spec.fields.get("compensator_params", {})
    return [spec.with_fields(compensator_params={**params, "lam": lam}) for lam in matrix.lambdas]


def _cell(matrix: Matrix, model: ModelSpec, spec: MethodSpec, ratio: float, n_calib: int) -> Cell:
    prune = PruneConfig(**{**matrix.prune, **spec.fields, "ratio": ratio}).to_json()
    recipe = recipe_of(prune)
    evals = matrix.eval if _zeroshot_at(matrix, ratio) else tuple(e for e in matrix.eval if e != "zeroshot")
    return Cell(matrix=matrix.name, model=model.model, model_label=model.label, revision=model.revision,
                method=recipe.key if recipe and spec.name is None else CUSTOM,
                method_label=method_label(prune, spec.name), n_calib=n_calib,
                seqlen=matrix.calib.seqlen, calib=matrix.calib.spec(n_calib),
                prune=prune,
                ppl_profiles=matrix.ppl_profiles if "ppl" in evals else (), eval=evals,
                dtype=matrix.dtype, device=matrix.device, eval_batch_size=matrix.eval_batch_size,
                zeroshot_limit=matrix.zeroshot_limit if "zeroshot" in evals else None,
                skip=_skipped(matrix.skip, prune))


def _zeroshot_at(matrix: Matrix, ratio: float) -> bool:
    """Whether the cells at ``ratio`` run the matrix's zero-shot evaluation: every ratio unless ``zeroshot_ratios``
    names some, and the dense model always (the reference of every ratio)."""
    return matrix.zeroshot_ratios is None or ratio == 0 or ratio in matrix.zeroshot_ratios


def _skipped(skip: tuple[str, ...], prune: dict[str, Any]) -> tuple[str, ...]:
    """The measurements a cell leaves out: the matrix's, but a λ-grid cell keeps its calibration perplexity."""
    lam = derived(prune, "lam")
    return tuple(item for item in skip if not (item == "calibration-ppl" and lam is not None))


def _dense(matrix: Matrix, model: ModelSpec) -> Cell:
    recipe = RECIPES[DENSE]
    spec = MethodSpec({k: v for k, v in recipe.prune.items() if k != "ratio"})
    return _cell(matrix, model, spec, recipe.prune["ratio"], matrix.calib.n_calib[0])


def expand(matrix: Matrix, registry: Registry) -> list[Cell]:
    """All cells, model by model (so each model is loaded once), each cell's options checked
    (``Experiment.check_options``: its inputs and budgets are checked by ``runner.preflight``)."""
    specs = method_specs(matrix, registry)
    cells = []
    for model in matrix.models:
        cells += [_dense(matrix, model)] if matrix.include_dense else []
        cells += [_cell(matrix, model, spec, ratio, n) for n, spec, ratio in product(matrix.calib.n_calib, specs,
                                                                                     matrix.ratios)]
    _check_unique(cells)
    for cell in cells:
        try:
            cell.experiment().check_options(registry)
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
