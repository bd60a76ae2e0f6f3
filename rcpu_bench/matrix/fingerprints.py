"""What a stored cell was computed from, by content: the model's files, the calibration text and the evaluation data.

A cell id hashes the *names* of its model, calibration source and evaluation profiles, so a model directory
overwritten with other weights, an edited ``file:`` corpus or a replaced evaluation file keeps its ids. Every store
entry therefore keeps a fingerprint (``entry["fingerprint"] = {"model": ..., "calibration": ..., "evaluation":
...}``), and a resumed run skips a finished cell only when each still matches; a changed one is reported and run
again (cell ids are unchanged). An entry stored before a part was fingerprinted is not checked on that part.

- model: for a local directory, ``sha256:`` + sha256 over the sorted (file name, sha256 of its bytes) of every
  file in it (config, weights, tokenizer, manifest; not subdirectories): a content hash. Reading the weights
  costs about as long as loading them, once per model and run; sizes or safetensors headers alone would miss
  other weights of the same shapes. For a hub id, ``commit:`` + the resolved commit, which fixes the content.
- calibration: the sha256 of the calibration source's file (``record.calibration["sha256"]``).
- evaluation: ``sha256:`` + sha256 over the sorted (profile, sha256 of its source file) of the cell's perplexity
  profiles and, when the cell evaluates zero-shot accuracy, the (file, sha256) of the zero-shot tasks' data files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rcpu_bench import data
from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.evaluation import perplexity
from rcpu_bench.matrix.cells import Cell
from rcpu_bench.matrix.store import Entry
from rcpu_bench.model.loading import load_config, model_source


def model_fingerprint(name_or_path: str, revision: str | None = None) -> str:
    """``sha256:<hex>`` of a local model directory's files, or ``commit:<hash>`` for a hub id."""
    source = Path(model_source(name_or_path))
    if not source.is_dir():
        _, commit = load_config(name_or_path, revision)
        if commit is None:
            raise ValueError(f"model {name_or_path!r}: neither a local directory nor a hub commit to fingerprint")
        return f"commit:{commit}"
    digest = hashlib.sha256()
    for path in sorted(path for path in source.iterdir() if path.is_file()):
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def calibration_fingerprint(calib: str, data_dir: str | None = None) -> str:
    """The sha256 of the text a calibration spec draws from."""
    return data.load_source(data.parse_calib(calib).source, data_dir).sha256


def evaluation_fingerprint(profiles: tuple[str, ...], data_dir: str | None, zeroshot: bool) -> str:
    """``sha256:<hex>`` of the data a cell is evaluated on: its perplexity profiles' source files and, with
    ``zeroshot``, the zero-shot tasks' data files."""
    digest = hashlib.sha256()
    for profile in sorted(profiles):
        digest.update(f"{profile}\0{perplexity.profile_source(profile, data_dir).sha256}\n".encode())
    if zeroshot:
        from rcpu_bench.evaluation.zeroshot import plan_zeroshot  # lm-eval: imported only when asked for

        for name, sha256 in sorted(plan_zeroshot().data_files.items()):  # as a cell evaluates them
            digest.update(f"zeroshot:{name}\0{sha256}\n".encode())
    return f"sha256:{digest.hexdigest()}"


class Fingerprints:
    """Each cell's fingerprint, computed once per model, calibration source and evaluation setting in a run."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], str] = {}

    def _once(self, key: tuple[str, ...], compute: Any) -> str:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def of(self, cell: Cell) -> dict[str, str]:
        experiment = cell.experiment()
        model = self._once(("model", experiment.model, str(cell.revision)),
                           lambda: model_fingerprint(experiment.model, cell.revision))
        calib = self._once(("calibration", experiment.calib),
                           lambda: calibration_fingerprint(experiment.calib, experiment.data_dir))
        zeroshot = "zeroshot" in cell.eval
        evaluation = self._once(("evaluation", *experiment.ppl_profiles, str(experiment.data_dir), str(zeroshot)),
                                lambda: evaluation_fingerprint(experiment.ppl_profiles, experiment.data_dir, zeroshot))
        return {"model": model, "calibration": calib, "evaluation": evaluation}


def stored_fingerprint(entry: Entry) -> dict[str, str]:
    """What an entry records of its content: its fingerprint's parts (none, when its files could not be read as it
    was stored; the calibration alone, for an entry of an earlier release that ``rcpu-bench migrate`` converted)."""
    return dict(entry.fingerprint or {})


def changes(entry: Entry, current: dict[str, str]) -> list[str]:
    """What differs between the content ``entry`` was computed from and ``current``: e.g. ``["model"]``."""
    stored = stored_fingerprint(entry)
    return [key for key in current if key in stored and stored[key] != current[key]]
