"""A matrix cell (one experiment) and its id; the role of each of its fields is declared once.

Roles: ``run`` fields define what a run computes (two stored cells with equal run fields are the same
experiment, whatever they were asked to evaluate: :data:`RUN_FIELDS`, :func:`run_of`); ``request`` fields
say what is evaluated; ``label`` fields only name things; ``execution`` fields say where and how it runs,
which does not change the result. A cell id hashes the run and request fields (:attr:`Cell.id`).

The ratio ρ and the ridge λ are stored once, inside ``prune`` (``prune.ratio``, ``prune.compensator_params.lam``):
:attr:`Cell.ratio` and :attr:`Cell.lam` are derived (:data:`DERIVED`), and the id hashes them as the top-level
``ratio`` and ``lam`` that stores written by earlier releases kept beside ``prune`` (so ids are unchanged;
``rcpu-bench migrate`` drops those copies, :mod:`rcpu_bench.matrix.migrate`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from rcpu_bench.experiment import BY_NAME as EXPERIMENT
from rcpu_bench.experiment import Experiment
from rcpu_bench.paths import shared_dir
from rcpu_bench.pruning import options
from rcpu_bench.pruning.options import MODULES, PruneConfig

SHARED = "${shared}"
MIGRATE = "written by an earlier rcpu-bench: convert its store with `rcpu-bench migrate RESULTS_DIR`"
Role = Literal["run", "request", "label", "execution"]


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


def _role(role: Role, *, unset: Any = ..., **default: Any) -> Any:
    """A Cell field with its role; ``unset``: a field added after cells were stored is hashed only when set."""
    return field(**default, metadata={"role": role, **({} if unset is ... else {"unset": unset})})


@dataclass(frozen=True)
class Cell:
    """One experiment of a matrix, as recorded in the store's ``cell`` field."""

    matrix: str = _role("label")
    model: str = _role("run")
    model_label: str = _role("label")
    revision: str | None = _role("run")
    method: str = _role("label")  # the recipe key, or "custom"
    method_label: str = _role("label")  # rcpu_bench.pruning.methods.method_label of the final configuration
    n_calib: int = _role("run")
    seqlen: int = _role("run")
    calib: str = _role("run")
    prune: dict[str, Any] = _role("run")
    ppl_profiles: tuple[str, ...] = _role("request")
    eval: tuple[str, ...] = _role("request")
    dtype: str = _role("run")
    device: str = _role("execution")
    eval_batch_size: int = _role("execution", default=EXPERIMENT["eval_batch_size"].default)
    zeroshot_limit: int | None = _role("run", unset=None, default=None)
    skip: tuple[str, ...] = _role("request", unset=[], default=())  # measurements left out (Experiment.skip)

    @property
    def ratio(self) -> float:
        return derived(self.prune, "ratio")

    @property
    def lam(self) -> float | None:
        """The ridge λ of the compensator, None for a method without one."""
        return derived(self.prune, "lam")

    def to_json(self) -> dict[str, Any]:
        """The cell as JSON data (tuples as lists), as the store records it."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cell:
        """A stored cell (JSON data) in today's format: every field and every pruning option given, nothing else
        (ValueError naming what differs; a cell of an earlier release names ``rcpu-bench migrate``)."""
        names = [f.name for f in fields(cls)]
        missing, unknown = [n for n in names if n not in data], sorted(set(data) - set(names))
        if missing or unknown:
            what = "; ".join(f"{label} {', '.join(keys)}" for label, keys in
                             (("no field", missing), ("the field(s)", unknown)) if keys)
            raise ValueError(f"stored cell {data.get('model_label')!r} {data.get('method_label')!r} has {what}: "
                             f"{MIGRATE}")
        check_options(data["prune"], "its cell's prune")
        values: dict[str, Any] = {name: tuple(data[name]) if isinstance(data[name], list) else data[name]
                                  for name in names}
        return cls(**values)

    @cached_property
    def id(self) -> str:
        """sha256 of the canonical JSON of what the cell computes (its run and request fields), 16 hex digits."""
        return cell_id(self.to_json())

    def prune_config(self) -> PruneConfig:
        return options.from_dict(self.prune)

    def experiment(self) -> Experiment:
        """The cell's experiment: the fields the two share by name, with the model's ``${shared}`` expanded and the
        prune options as a PruneConfig."""
        names = {f.name for f in fields(self)}
        shared = {f.name: getattr(self, f.name) for f in fields(Experiment) if f.name in names}
        return Experiment(**{**shared, "model": expand_shared(self.model), "prune": self.prune_config(),
                             "skip": tuple(self.skip)})

    def method_name(self) -> str:
        """The method's label, with the compensated modules when not all of them (the ablation)."""
        compensate = tuple(self.prune["compensate"])
        if compensate == MODULES:
            return self.method_label
        return f"{self.method_label} [compensate: {','.join(compensate) or 'none'}]"

    def describe(self) -> str:
        """Model, method, ratio, N and λ in one line."""
        number = isinstance(self.lam, (int, float))  # a bad λ (text) is shown as given, in the error that names it
        lam = "" if self.lam is None else f" λ={self.lam:g}" if number else f" λ={self.lam!r}"
        return f"{self.model_label} | {self.method_name()} | ρ={self.ratio:g} N={self.n_calib}{lam}"


def check_options(prune: Mapping[str, Any], where: str) -> None:
    """ValueError unless a stored pruning configuration has every option (``rcpu_bench.pruning.options``) and no
    other key; one of an earlier release names ``rcpu-bench migrate``."""
    missing, unknown = [n for n in options.BY_NAME if n not in prune], sorted(set(prune) - set(options.BY_NAME))
    if missing:
        raise ValueError(f"{where} has no option {', '.join(missing)}: {MIGRATE}")
    if unknown:
        raise ValueError(f"{where} has the unknown option(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(options.BY_NAME)}")


# The cell values stored once, inside ``prune`` (name: dotted path in ``prune``); each is a run field hashed
# under its own name.
DERIVED: dict[str, str] = {"ratio": "ratio", "lam": "compensator_params.lam"}


def derived(prune: Mapping[str, Any], name: str) -> Any:
    """The value of the derived cell field ``name`` (:data:`DERIVED`) in a cell's ``prune``; None when unset."""
    *outer, last = DERIVED[name].split(".")
    for key in outer:
        prune = prune[key]
    return prune.get(last)


ROLES: dict[str, Role] = {**{f.name: f.metadata["role"] for f in fields(Cell)}, **dict.fromkeys(DERIVED, "run")}
RUN_FIELDS: tuple[str, ...] = tuple(name for name, role in ROLES.items() if role == "run")
HASHED: tuple[str, ...] = tuple(name for name, role in ROLES.items() if role in ("run", "request"))
NOT_HASHED: tuple[str, ...] = tuple(name for name in ROLES if name not in HASHED)
HASHED_WHEN_SET: dict[str, Any] = {f.name: f.metadata["unset"] for f in fields(Cell) if "unset" in f.metadata}


def run_of(cell: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a (stored) cell that define what its run computes."""
    return {name: value for name, value in cell.items() if name in RUN_FIELDS}


def _drop_unset(config: Mapping[str, Any], unset: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not (k in unset and v == unset[k])}


def cell_id(cell: Mapping[str, Any]) -> str:
    """The id of a cell given as its stored JSON data: sha256 of the canonical JSON of its hashed fields, the derived
    ρ and λ among them, with the fields (and options) added after cells were first stored left out while they hold
    their unset value."""
    hashed = {**cell, **{name: derived(cell["prune"], name) for name in DERIVED}}
    config = _drop_unset({k: v for k, v in hashed.items() if k in HASHED}, HASHED_WHEN_SET)
    config["prune"] = _drop_unset(config["prune"], options.HASHED_WHEN_SET)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
