"""Resume checks content, not paths: a finished cell whose model files or calibration text changed is reported and
run again; its id stays the same."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from safetensors.torch import load_file, save_file
from tiny_matrices import tiny_raw
from tiny_models import STORIES_MHA, TINYSTORIES, needs_stories

from rcpu_bench.matrix.fingerprints import calibration_fingerprint, model_fingerprint
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import parse_matrix
from rcpu_bench.matrix.store import Store


def directory_hash(directory) -> str:
    """An independent computation of the documented model fingerprint."""
    lines = "".join(f"{p.name}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n"
                    for p in sorted(directory.iterdir()) if p.is_file())
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


@needs_stories
def test_the_model_fingerprint_is_a_content_hash_of_the_directory(tmp_path):
    model = shutil.copytree(STORIES_MHA, tmp_path / "m")
    assert model_fingerprint(str(model)) == directory_hash(model) == model_fingerprint(str(STORIES_MHA))
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2  # same shapes, same header
    (model / "model.safetensors").chmod(0o644)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(str(model)) == directory_hash(model) != model_fingerprint(str(STORIES_MHA))


def test_the_calibration_fingerprint_is_the_sha256_of_the_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    assert calibration_fingerprint(f"file:{corpus}:2x8") == hashlib.sha256(b"some text\n").hexdigest()


def _stories_corpus(path, first: int) -> None:
    """A file: calibration corpus: ``first`` TinyStories validation stories (one JSON line each) as text."""
    import json

    lines = TINYSTORIES.read_text(encoding="utf-8").splitlines()[:first]
    path.write_text("\n\n".join(json.loads(line)["text"] for line in lines), encoding="utf-8")


@pytest.mark.slow
@needs_stories
def test_a_rerun_reports_and_reruns_cells_whose_model_or_calibration_changed(tmp_path, caplog):
    model = shutil.copytree(STORIES_MHA, tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    _stories_corpus(corpus, 40)
    raw = tiny_raw(["wanda-sp"], models=[{"model": str(model), "label": "mha"}],
                   calib={"source": f"file:{corpus}", "n_calib": [4], "seqlen": 32})
    results = tmp_path / "results"
    assert run_matrix(parse_matrix(raw), results, progress=False).ok == 1
    (first,) = Store(results).entries()
    assert {key: first.fingerprint[key] for key in ("model", "calibration")} == {
        "model": directory_hash(model), "calibration": hashlib.sha256(corpus.read_bytes()).hexdigest()}
    assert run_matrix(parse_matrix(raw), results, progress=False).skipped == 1  # nothing changed

    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    (model / "model.safetensors").chmod(0o644)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    again = run_matrix(parse_matrix(raw), results, progress=False)
    assert (again.ok, again.skipped) == (1, 0)
    assert f"cell {first.cell_id} (mha | " in caplog.text and "its model changed" in caplog.text
    second = Store(results).entries()[-1]
    assert second.cell_id == first.cell_id and second.fingerprint["model"] == directory_hash(model)
    assert second.record.perplexity != first.record.perplexity

    caplog.clear()
    _stories_corpus(corpus, 60)
    third = run_matrix(parse_matrix(raw), results, progress=False)
    assert (third.ok, third.skipped) == (1, 0) and "its calibration changed" in caplog.text
    assert [e.cell_id for e in Store(results).entries()] == [first.cell_id] * 3


@pytest.mark.slow
@needs_stories
def test_an_entry_stored_before_fingerprints_is_reused_with_a_warning(tmp_path, caplog):
    import json

    raw = tiny_raw(["wanda-sp"])
    results = tmp_path / "results"
    run_matrix(parse_matrix(raw), results, progress=False)
    store = results / "records.jsonl"
    (entry,) = [json.loads(line) for line in store.read_text().splitlines()]
    del entry["fingerprint"]
    store.write_text(json.dumps(entry) + "\n")
    assert run_matrix(parse_matrix(raw), results, progress=False).skipped == 1
    assert "1 finished cells were stored without a model fingerprint" in caplog.text
