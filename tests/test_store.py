"""The result store: entry format, newest entry per cell, torn lines from killed writers, one writer at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tables import entry as table_entry
from tiny_matrices import tiny_matrix

from rcpu_bench.matrix.cells import Cell, cell_id
from rcpu_bench.matrix.phases import phase1_entries
from rcpu_bench.matrix.spec import expand, load_matrix
from rcpu_bench.matrix.store import (
    FAILED,
    OK,
    Entry,
    Store,
    StoreBusyError,
    StoredResult,
    error_info,
    make_entry,
    newest_entries,
    read_results,
)
from rcpu_bench.plugins import default_registry
from rcpu_bench.records import Record, read_records

ENTRY_KEYS = {"cell_id", "status", "error", "cell", "record", "finished_at", "seconds"}
CELL_KEYS = {"matrix", "model", "model_label", "method", "method_label", "n_calib", "seqlen", "calib", "prune",
             "ppl_profiles", "eval"}


def entry(cell_id: str, status: str = OK) -> Entry:
    """An entry of the tiny matrix's cell under ``cell_id`` (ok entries with a record)."""
    return Entry(cell_id, status, CELL, Record.from_json(table_entry("rcpu-rot", 0.2, 14.0)["record"])
                 if status == OK else None)


(CELL,) = expand(tiny_matrix(["rcpu-rot"]), default_registry())


def fail() -> None:
    raise RuntimeError("boom")


def test_entries_carry_the_cell_and_either_a_record_or_an_error_with_its_traceback():
    cell = CELL
    record = Record.from_json(table_entry("rcpu-rot", 0.2, 14.0)["record"])
    ok = make_entry(cell, seconds=1.5, record=record)
    assert ok.record == record and ok.cell == cell
    assert set(ok.to_json()) == ENTRY_KEYS and set(ok.to_json()["cell"]) >= CELL_KEYS
    assert (ok.cell_id, ok.status, ok.error, ok.seconds) == (cell.id, OK, None, 1.5)
    assert ok.finished_at.endswith("+00:00") and ok.cell.method_label == "RCPU (Rot.)"
    assert Entry.from_json(json.loads(json.dumps(ok.to_json()))) == ok
    try:
        fail()
    except RuntimeError as raised:
        failed = make_entry(cell, seconds=0.1, error=error_info(raised))
    assert failed.status == FAILED and failed.record is None
    assert failed.error["type"] == "RuntimeError" and failed.error["message"] == "boom"
    assert "in fail" in failed.error["traceback"]
    assert Entry.from_json(json.loads(json.dumps(failed.to_json()))) == failed


def test_an_entry_keeps_its_format_optional_keys_only_when_set_and_unknown_keys_as_they_were():
    stored = table_entry("rcpu-rot", 0.2, 14.0)
    line = {"cell_id": "a", "status": OK, "error": None, "cell": stored["cell"], "record": stored["record"],
            "finished_at": "t", "seconds": 2.0, "phase": "ppl", "future_key": [1, 2]}
    entry = Entry.from_json(line)
    assert (entry.phase, entry.fingerprint, entry.extra) == ("ppl", None, {"future_key": [1, 2]})
    assert entry.to_json() == line


def test_the_newest_entry_of_a_cell_wins(tmp_path):
    store = Store(tmp_path)
    assert store.entries() == [] and store.finished() == set()
    with store.writing() as append:
        for item in (entry("a"), entry("b", FAILED), entry("c", FAILED), entry("b"), entry("a", FAILED)):
            append(item)
    assert len(store.entries()) == 5
    assert {k: e.status for k, e in store.latest().items()} == {"a": FAILED, "b": OK, "c": FAILED}
    assert store.finished() == {"b"}


def test_a_torn_last_line_is_skipped_and_cut_before_the_next_append(tmp_path):
    store = Store(tmp_path)
    with store.writing() as append:
        append(entry("a"))
    with open(store.path, "a", encoding="utf-8") as handle:
        handle.write('{"cell_id": "b", "sta')  # a writer killed in the middle of a line
    assert [e.cell_id for e in store.entries()] == ["a"]
    with store.writing() as append:
        append(entry("c"))
    assert [e.cell_id for e in store.entries()] == ["a", "c"]
    assert store.path.read_text(encoding="utf-8").count("\n") == 2


def test_a_second_writer_is_refused(tmp_path):
    store = Store(tmp_path)
    with store.writing(), pytest.raises(StoreBusyError, match="being written by another run"):
        with Store(tmp_path).writing():
            pass
    with Store(tmp_path).writing() as append:  # released again
        append(entry("a"))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from([OK, FAILED])), max_size=12),
       st.text(alphabet='{"abc:, ', max_size=8))
def test_latest_and_finished_follow_the_last_complete_entry_of_each_cell(tmp_path_factory, appended, torn):
    store = Store(tmp_path_factory.mktemp("store"))
    with store.writing() as append:
        for cell_id, status in appended:
            append(entry(cell_id, status))
    with open(store.path, "a", encoding="utf-8") as handle:
        handle.write(torn.replace("\n", ""))
    expected = dict(appended)  # the last status of each cell
    assert {k: e.status for k, e in store.latest().items()} == expected
    assert store.finished() == {k for k, status in expected.items() if status == OK}


# ------------------------------------------------------------------------------------------- the one reader

def test_read_results_skips_failed_and_a_torn_last_line(tmp_path):
    retried = table_entry("rcpu-rot", 0.3, 18.35)
    entries = [{**retried, "status": "failed", "record": None}, table_entry("rcpu-rot", 0.1, 13.55),
               table_entry("rcpu-rot", 0.2, status="failed"), retried]  # a cell's newest entry counts
    lines = [json.dumps(e) for e in entries]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n" + lines[1][:40], encoding="utf-8")
    stored = read_results(tmp_path)
    assert [r.ratio for r in stored.results] == [0.1, 0.3] and stored.failed == 1
    assert stored.results[1] == StoredResult(retried["cell_id"], Cell.from_json(retried["cell"]),
                                             Record.from_json(retried["record"]), retried["seconds"])


def test_read_results_names_a_missing_store(tmp_path):
    with pytest.raises(FileNotFoundError, match="records.jsonl"):
        read_results(tmp_path)


def test_read_results_names_an_entry_without_the_fields_tables_read(tmp_path):
    broken = table_entry("rcpu-rot", 0.1, 13.55)
    del broken["record"]["timing"], broken["record"]["parameters"]
    lines = [json.dumps(table_entry("rcpu-rot", 0.2, 14.4)), json.dumps(broken)]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"records.jsonl:2: entry {broken['cell_id']}: a record needs the "
                                         r"field\(s\) parameters, timing"):
        read_results(tmp_path)


def test_read_results_of_a_directory_without_a_store_is_empty_when_allowed(tmp_path):
    assert read_results(tmp_path, missing_ok=True) == read_results(tmp_path, missing_ok=True)
    assert read_results(tmp_path, missing_ok=True).results == () and read_results(tmp_path, missing_ok=True).failed == 0


@pytest.mark.parametrize("junk", ["{}", "[]", '"text"', "7", '{"cell_id": "abc"}', '{"cell_id": "", "status": "ok"}',
                                  '{"cell_id": "abc", "status": "maybe"}'])
def test_a_line_that_is_not_an_entry_is_skipped_with_a_warning_not_counted_failed(tmp_path, caplog, junk):
    lines = [json.dumps(table_entry("rcpu-rot", 0.1, 13.55)), junk, json.dumps(table_entry("rcpu-rot", 0.2, 14.4))]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    stored = read_results(tmp_path)
    assert [r.ratio for r in stored.results] == [0.1, 0.2] and stored.failed == 0
    assert "records.jsonl:2 is not a cell entry" in caplog.text
    assert len(Store(tmp_path).latest()) == 2 and len(phase1_entries(Store(tmp_path).entries())) == 2


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 9)), max_size=12))
def test_newest_entries_is_each_cells_last_entry_in_order_of_last_writes(pairs):
    entries = [{"cell_id": cell, "n": n} for cell, n in pairs]
    last = {cell: max(i for i, (c, _) in enumerate(pairs) if c == cell) for cell, _ in pairs}
    expected = [entries[i] for i in sorted(last.values())]
    by_id = newest_entries(entries, cell_id=lambda e: e["cell_id"])
    assert list(by_id.values()) == expected and list(by_id) == [e["cell_id"] for e in expected]


# ------------------------------------------------------------------------- ρ and λ stored once, in prune

RESULTS = Path(__file__).resolve().parent.parent / "results"
COMMITTED = sorted(RESULTS.glob("**/records.jsonl"))


def test_a_new_cell_stores_ratio_and_lambda_once_in_prune_with_the_id_of_the_old_duplicated_form():
    cells = expand(tiny_matrix(["rcpu-rot", "ls-best"]), default_registry())
    ridge = next(cell for cell in cells if cell.lam is not None)
    for cell in cells:
        stored = cell.to_json()
        assert "ratio" not in stored and "lam" not in stored
        assert (cell.ratio, cell.lam) == (stored["prune"]["ratio"], stored["prune"]["compensator_params"].get("lam"))
        old = {**stored, "ratio": cell.ratio, "lam": cell.lam}  # as stores of earlier releases kept them
        assert cell_id(stored) == cell_id(old) == cell.id
        assert Cell.from_json(stored) == cell
    assert ridge.lam == ridge.prune["compensator_params"]["lam"]


@pytest.mark.parametrize("store", COMMITTED, ids=lambda path: path.parent.name)
def test_every_committed_store_reads_back_to_its_json_and_its_ids_recompute_equal(store):
    """Every line of every committed store is today's format: typed and written back, it is the same JSON."""
    lines = read_records(store)
    assert lines
    for line in lines:
        assert Entry.from_json(line).to_json() == line
        assert cell_id(line["cell"]) == line["cell_id"]
    results = read_results(store.parent).results
    assert results and all(r.ratio == r.cell.prune["ratio"] for r in results)


@pytest.mark.parametrize("name", ["leaderboard", "zeroshot"])
def test_a_committed_matrix_has_nothing_new_to_run_against_its_store(name):
    cells = expand(load_matrix(str(RESULTS / name / "matrix.yaml")), default_registry())
    assert {cell.id for cell in cells} <= Store(RESULTS / name).finished()
