"""Two phases for λ-grid cells that ask for zero-shot accuracy: zero-shot only at λ_best.

The paper reports zero-shot accuracy only at λ_best, the ridge λ with the lowest perplexity on the
calibration windows (appendix sec:bestlam). A λ group is the cells of a matrix that differ only in λ
(same model, method, scorer, ratio, N_calib, ...). When a group has more than one λ and its cells ask
for zero-shot:

* phase 1 prunes every cell and measures its perplexity; the group's cells skip zero-shot (their
  entries say ``"phase": "ppl"``). Every other cell runs everything, as before, in phase 1.
* phase 2, once every cell of a group has an ok phase-1 entry, chooses λ_best by the paper's rule and
  runs that cell again with zero-shot: the cell is re-pruned from the dense model (pruning is
  deterministic, so the weights are bit-identical to phase 1's; ``reproduced`` records the check on the
  calibration perplexity, and the evaluation perplexities phase 1 measured are not measured again). Its new
  entry (same cell id) keeps the phase-1 record and adds ``zeroshot``, and says ``"phase": "lambda_best"``,
  ``"lambda_rule": "paper"``, ``"chosen_from": [cell ids]``.

Re-pruning costs one more pruning + calibration-perplexity pass per group (under 1/|grid| of the group's
phase-1 work); keeping every pruned grid model until its group is decided would need |grid| pruned models per group
on disk (13 × 13 GB for one Llama-7B group) or in memory, which is not an option on a GPU worker.

Cell ids do not change: a group's cells keep their ids (their ``eval`` still names zero-shot). A
store's state tells the phase: phase 1 of a cell is done when its newest entry, failed phase-2 entries
left out, is ok; phase 2 of a group is done when the chosen cell's newest entry is ok and has zero-shot
(an entry from before the phases, which ran zero-shot for every λ, counts). So a crash between phases
loses nothing, and the rerun goes straight to phase 2. Matrices without such groups run as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from rcpu_bench.matrix.lambda_rules import choose
from rcpu_bench.matrix.spec import Cell
from rcpu_bench.matrix.store import Entry, StoredResult, newest_entries

ZEROSHOT = "zeroshot"
PHASE_PPL = "ppl"  # a λ-grid cell's entry of phase 1: pruning and perplexity, zero-shot deferred
PHASE_LAMBDA_BEST = "lambda_best"  # the λ_best cell's entry of phase 2, with its zero-shot accuracy
LAMBDA_RULE = "paper"  # lowest perplexity on the calibration windows


def lambda_group(cell: Cell) -> str:
    """The cell's λ group: its configuration without the matrix name and the ridge λ, as canonical JSON."""
    config = {k: v for k, v in cell.to_json().items() if k != "matrix"}
    config["prune"] = {**config["prune"],
                       "compensator_params": {k: v for k, v in config["prune"]["compensator_params"].items()
                                              if k != "lam"}}
    return json.dumps(config, sort_keys=True)


def phase1_entries(entries: Iterable[Entry]) -> dict[str, Entry]:
    """Per cell id, the entry that stands for its phase 1 when it is ok: its newest entry, failed phase-2 entries
    left out (a zero-shot run at λ_best that failed does not undo the pruning and perplexity before it)."""
    kept = newest_entries(e for e in entries if not (e.phase == PHASE_LAMBDA_BEST and not e.ok))
    return {cell_id: entry for cell_id, entry in kept.items() if entry.ok}


@dataclass(frozen=True)
class LambdaBest:
    """Phase 2 of one λ group: the chosen cell, its phase-1 entry, and the ids of the group's cells (λ order)."""

    cell: Cell
    phase1: Entry
    chosen_from: tuple[str, ...]


@dataclass(frozen=True)
class Phase2:
    """What phase 2 has to do now: the groups to run, how many are done, the groups that wait for phase-1 cells."""

    todo: tuple[LambdaBest, ...]
    done: int
    waiting: tuple[tuple[Cell, ...], ...]


@dataclass(frozen=True)
class PhasePlan:
    """The cells of a matrix and their λ groups whose zero-shot evaluation waits for λ_best."""

    cells: tuple[Cell, ...]
    groups: tuple[tuple[Cell, ...], ...]

    @property
    def deferred(self) -> frozenset[str]:
        """Ids of the cells that skip zero-shot in phase 1."""
        return frozenset(cell.id for group in self.groups for cell in group)

    def phase1_cell(self, cell: Cell) -> Cell:
        """What phase 1 runs for ``cell``: the cell itself, or, when deferred, the cell without zero-shot."""
        if cell.id not in self.deferred:
            return cell
        return replace(cell, eval=tuple(e for e in cell.eval if e != ZEROSHOT), zeroshot_limit=None)

    def phase1_entry(self, entry: Entry, cell: Cell) -> Entry:
        """The store entry of ``cell`` from the entry of its phase-1 run (which carries the run cell's id)."""
        if cell.id not in self.deferred:
            return entry
        return replace(entry, cell_id=cell.id, cell=cell, phase=PHASE_PPL)

    def phase2(self, entries: Sequence[Entry]) -> Phase2:
        """The groups whose λ_best is decided (every cell has an ok phase-1 entry) and has no zero-shot result yet."""
        phase1, newest = phase1_entries(entries), newest_entries(entries)
        todo, done, waiting = [], 0, []
        for group in self.groups:
            if any(cell.id not in phase1 for cell in group):
                waiting.append(group)
                continue
            results = [StoredResult.from_entry(phase1[cell.id]) for cell in group]
            best = phase1[choose(lambda_group(group[0]), results).result.cell_id]
            latest = newest[best.cell_id]
            if latest.ok and latest.record is not None and latest.record.zeroshot is not None:
                done += 1
                continue
            cell = next(cell for cell in group if cell.id == best.cell_id)
            todo.append(LambdaBest(cell, best, tuple(c.id for c in group)))
        return Phase2(tuple(todo), done, tuple(waiting))

    def counts(self) -> dict[str, int]:
        """Cells, zero-shot evaluations (in phase 1, in phase 2, and if every cell ran it) and re-prunings."""
        asking = sum(ZEROSHOT in cell.eval for cell in self.cells)
        phase1_zeroshot = asking - len(self.deferred)
        return {"cells": len(self.cells), "groups": len(self.groups), "deferred": len(self.deferred),
                "phase1_zeroshot": phase1_zeroshot, "phase2_zeroshot": len(self.groups),
                "zeroshot": phase1_zeroshot + len(self.groups), "zeroshot_every_cell": asking,
                "reprunes": len(self.groups)}

    def describe(self) -> list[str]:
        """The phases and their cell counts, for the plan and ``--dry-run`` (nothing when there is one phase)."""
        if not self.groups:
            return []
        n = self.counts()
        sizes = "/".join(str(s) for s in sorted({len(g) for g in self.groups}))
        saved = n["zeroshot_every_cell"] - n["zeroshot"]
        return [f"phase 1: {n['cells']} cells prune and measure perplexity; {n['phase1_zeroshot']} of them (not on a "
                f"λ grid) also run zero-shot, the {n['deferred']} λ-grid cells do not",
                f"phase 2: zero-shot at λ_best (rule {LAMBDA_RULE}: lowest calibration perplexity) for each of "
                f"{n['groups']} λ groups of {sizes} λ, re-pruning the chosen cell: {n['phase2_zeroshot']} runs",
                f"zero-shot evaluations: {n['zeroshot']} instead of {n['zeroshot_every_cell']} ({saved} saved), "
                f"for {n['reprunes']} extra prunings"]


def plan_phases(cells: Sequence[Cell]) -> PhasePlan:
    """Group the cells that ask for zero-shot by λ; groups of two or more λ wait for λ_best (cells keep their order)."""
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        if ZEROSHOT in cell.eval and cell.lam is not None:
            groups.setdefault(lambda_group(cell), []).append(cell)
    return PhasePlan(tuple(cells), tuple(tuple(g) for g in groups.values() if len(g) > 1))


def phase2_cell(best: LambdaBest) -> Cell:
    """What phase 2 runs for the chosen cell: the cell without its evaluation perplexities, which phase 1 measured
    on the same weights (the calibration perplexity, which chose λ, is measured again as the check)."""
    return replace(best.cell, ppl_profiles=())


def lambda_best_entry(run: Entry, best: LambdaBest) -> Entry:
    """The phase-2 store entry from the re-run ``run`` of :func:`phase2_cell`: the chosen cell's phase-1 record with
    the re-run's zero-shot accuracy, how λ was chosen, and whether the re-pruned model reproduced phase 1's
    calibration perplexity."""
    entry = replace(run, cell_id=best.cell.id, cell=best.cell, phase=PHASE_LAMBDA_BEST,
                    lambda_rule=LAMBDA_RULE, chosen_from=list(best.chosen_from))
    if not run.ok:
        return entry
    first, again = best.phase1.record, run.record
    assert first is not None and again is not None  # ok entries have records
    entry.record = replace(first, zeroshot=again.zeroshot)
    entry.reproduced = {"identical": first.calibration_ppl == again.calibration_ppl,
                        "calibration_ppl": [first.calibration_ppl, again.calibration_ppl]}
    return entry
