"""``eval --output-path``: an unwritable place is refused before any work, and a write lm-eval swallowed is an
error, never a false "written" message."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import STORIES, needs_stories

from rcpu_bench.cli import main
from rcpu_bench.evaluation.zeroshot import check_output_path, save_lm_eval_outputs


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "plain-file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("below", ["", "sub", "sub/deeper", "results.json", "sub/results.json"])
def test_an_output_path_through_a_file_is_refused(a_file, below):
    with pytest.raises(NotADirectoryError, match=f"{a_file} is a file, so lm-eval cannot create"):
        check_output_path(a_file / below if below else a_file)


@pytest.mark.parametrize("below", ["out", "new/out", "out.json", "new/out.json"])
def test_an_output_path_in_a_writable_directory_passes(tmp_path, below):
    check_output_path(tmp_path / below)
    assert list(tmp_path.iterdir()) == []  # checking creates nothing


@needs_stories
def test_eval_refuses_an_unwritable_output_path_before_loading(a_file, tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    code = main(["eval", "--model", str(STORIES), "--source", "local", "--tasks", "piqa", "--limit", "1",
                 "--output-path", str(a_file / "lm-eval"), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "is a file, so lm-eval cannot create" in captured.err and "written" not in captured.out
    assert not out.exists()


class Tracker:
    """lm-eval's EvaluationTracker as far as save_lm_eval_outputs uses it; ``writes``: whether the write succeeds
    (lm-eval's own logs a failure as a warning and returns normally)."""

    def __init__(self, output_path: Path, writes: bool):
        self.output_path, self.writes = output_path, writes
        self.general_config_tracker = SimpleNamespace(model_name_sanitized="org__model")

    def save_results_aggregated(self, results, samples):
        self.date_id = "2026-01-01T00-00-00"
        if not self.writes:
            return
        if self.output_path.suffix == ".json":
            path = self.output_path.with_name(f"{self.output_path.stem}_{self.date_id}.json")
        else:
            path = self.output_path / "org__model" / f"results_{self.date_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")


@pytest.mark.parametrize("name", ["lm-eval", "lm-eval/results.json"])
def test_a_results_file_lm_eval_did_not_write_is_an_error(tmp_path, name):
    save_lm_eval_outputs(Tracker(tmp_path / name, writes=True), {}, None, tmp_path / name)
    swallowed = tmp_path / "other" / name
    with pytest.raises(OSError, match=f"lm-eval could not write its results under {swallowed} "):
        save_lm_eval_outputs(Tracker(swallowed, writes=False), {}, None, swallowed)
