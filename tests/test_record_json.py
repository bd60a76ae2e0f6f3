"""The typed run record: every stored line reads back to the same JSON (plus its schema version), measurements
join as fields or extras, and a record without a required field or of an unknown version is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rcpu_bench.matrix.store import read_results
from rcpu_bench.records import SCHEMA_VERSION, Record, append_record, read_records

RESULTS = Path(__file__).resolve().parent.parent / "results"
STORES = sorted(RESULTS.glob("*/records.jsonl"))


def minimal() -> dict:
    return {"experiment": {"dtype": "float32"}, "parameters": {"before": 10, "after": 8, "removed_fraction": 0.2},
            "perplexity": [{"profile": "rcpu128", "ppl": 12.5}], "timing": {"total_seconds": 1.0},
            "peak_memory_bytes": 1024}


@pytest.mark.parametrize("store", STORES, ids=lambda path: path.parent.name)
def test_every_stored_record_reads_back_to_its_json(store):
    """Lines written before the schema version existed read as version 1, keys and values unchanged."""
    lines = [line["record"] for line in read_records(store) if line["status"] == "ok"]
    assert lines
    for line in lines:
        record = Record.from_json(line)
        assert record.to_json() == {**line, "schema_version": SCHEMA_VERSION}
        assert record.perplexity == line["perplexity"] and record.experiment == line["experiment"]
    assert len(read_results(store.parent).results) == len({e["cell_id"] for e in read_records(store)
                                                           if e["status"] == "ok"})


def test_unmeasured_fields_are_left_out_and_unknown_keys_kept(tmp_path):
    record = Record.from_json({**minimal(), "zeroshot": {"mean": 0.5}, "w": "digest"})
    assert record.zeroshot == {"mean": 0.5} and record.extra == {"w": "digest"} and record.inference is None
    record.add({"inference": {"decode_tokens_per_s": 3.0}, "other": 1})
    assert record.inference == {"decode_tokens_per_s": 3.0} and record.extra == {"w": "digest", "other": 1}
    append_record(tmp_path / "r.jsonl", record)
    (line,) = read_records(tmp_path / "r.jsonl")
    assert line == {**minimal(), "zeroshot": {"mean": 0.5}, "w": "digest", "other": 1,
                    "inference": {"decode_tokens_per_s": 3.0}, "schema_version": SCHEMA_VERSION}
    assert "generalisation" not in line and json.loads(json.dumps(line)) == line


def test_a_record_without_a_required_field_or_of_an_unknown_version_is_refused():
    broken = minimal()
    del broken["timing"], broken["parameters"]
    with pytest.raises(ValueError, match="parameters, timing"):
        Record.from_json(broken)
    with pytest.raises(ValueError, match="schema_version 99"):
        Record.from_json({**minimal(), "schema_version": 99})


def test_llama_cpp_speed_is_a_field_that_older_records_lack():
    assert Record.from_json(minimal()).inference_llama_cpp is None
    speed = {"prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 90.0, "gguf_dtype": "float16"}
    record = Record.from_json({**minimal(), "inference_llama_cpp": speed})
    assert record.inference_llama_cpp == speed and record.extra == {}
    assert record.to_json() == {**minimal(), "inference_llama_cpp": speed, "schema_version": SCHEMA_VERSION}
