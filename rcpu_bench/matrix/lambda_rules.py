"""Which stored run fills one place of a table or plot: repeats keep the last, a ridge λ grid gives one λ.

Two rules choose λ from a grid of runs that differ only in λ:

- ``paper``: λ_best = argmin_λ PPL_calib(λ), the perplexity on the calibration windows (the paper's rule,
  appendix sec:bestlam);
- ``holdout``: argmin_λ mean held-out reconstruction error ‖Y − W̃X‖²/‖Y‖² over layers and modules
  (``Record.generalisation["holdout_error_mean"]``, recorded by runs with ``--holdout N``).

Ties go to the smaller λ.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rcpu_bench.matrix.cells import NOT_HASHED
from rcpu_bench.matrix.store import StoredResult

LAMBDA_RULES = {
    "paper": "lowest calibration perplexity, the paper's rule",
    "holdout": "lowest held-out reconstruction error (--holdout)",
}
DEFAULT_LAMBDA_RULE = "paper"
# What is not the experiment: the fields the cell id leaves out, and what a cell was asked to evaluate (a run
# that also evaluated zero-shot is the same experiment as one that evaluated perplexity only).
NOT_EXPERIMENT = (*NOT_HASHED, "ppl_profiles", "eval")
_LAMBDA_FIELDS = ("prune.compensator_params.lam",)


@dataclass(frozen=True)
class Chosen:
    """The stored run chosen for one place, with its ridge λ (None for other methods) and how many λ runs it was
    chosen from (1: no grid, e.g. a fixed damping or a grid not yet run through)."""

    result: StoredResult
    lam: float | None
    compared: int = 1


def lambda_score(result: StoredResult, rule: str) -> float:
    """What ``rule`` minimises over a λ grid, for one run: its calibration perplexity (``paper``) or its mean
    held-out reconstruction error (``holdout``)."""
    if rule == "paper":
        value = result.record.calibration_ppl
        if value is None:
            raise ValueError(f"cell {result.cell_id} has no calibration_ppl in its record; lambda_rule paper needs it")
        return value
    if rule == "holdout":
        value = (result.record.generalisation or {}).get("holdout_error_mean")
        if value is None:
            raise ValueError(f"lambda_rule holdout needs records run with --holdout; cell {result.cell_id} "
                             "has no generalisation.holdout_error_mean")
        return value
    raise ValueError(f"unknown lambda rule {rule!r}; allowed: {', '.join(LAMBDA_RULES)}")


def resolve(results: Iterable[StoredResult], key: Callable[[StoredResult], Hashable | None],
            rule: str = DEFAULT_LAMBDA_RULE) -> dict[Any, Chosen]:
    """Group results by ``key`` (None leaves a result out) and choose one per group (:func:`choose`)."""
    groups: dict[Hashable, list[StoredResult]] = defaultdict(list)
    for result in results:
        group = key(result)
        if group is not None:
            groups[group].append(result)
    return {group: choose(group, members, rule) for group, members in groups.items()}


def choose(where: Hashable, results: Sequence[StoredResult], rule: str = DEFAULT_LAMBDA_RULE) -> Chosen:
    """One run for one place: repeats of the same experiment (a re-run, on any device, or the same cell in another
    matrix) keep the last; runs that differ only in the ridge λ give the λ ``rule`` chooses; anything else is an
    error naming the two cells and their differences."""
    latest = {_experiment(result): result for result in results}
    runs = list(latest.values())
    kinds = {_experiment(run, ignore=_LAMBDA_FIELDS): run for run in runs}
    if len(kinds) > 1:
        first, second = list(kinds.values())[:2]
        raise ValueError(f"two different experiments for the same place {where}: cells {first.cell_id} and "
                         f"{second.cell_id} differ in {', '.join(_differences(first, second))}")
    best = runs[0] if len(runs) == 1 else min(runs, key=lambda run: (lambda_score(run, rule), run.lam or 0.0))
    return Chosen(best, best.lam, compared=len(runs))


def _flat(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dictionaries as one level with dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _experiment(result: StoredResult, ignore: tuple[str, ...] = ()) -> str:
    """What a result's cell ran, as a comparable string."""
    cell = {k: v for k, v in _flat(result.cell.to_json()).items() if k not in NOT_EXPERIMENT + ignore}
    return json.dumps(cell, sort_keys=True, default=str)


def _differences(a: StoredResult, b: StoredResult) -> list[str]:
    """The experiment fields on which two results' cells differ, with both values."""
    flat_a, flat_b = _flat(a.cell.to_json()), _flat(b.cell.to_json())
    keys = sorted((flat_a.keys() | flat_b.keys()) - set(NOT_EXPERIMENT))
    return [f"{k} ({flat_a.get(k)!r} vs {flat_b.get(k)!r})" for k in keys if flat_a.get(k) != flat_b.get(k)]
