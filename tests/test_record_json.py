"""The typed run record: every stored line reads back to the same JSON, its parts (perplexity with per-window values,
timing, parameters) typed; measurements join as fields or extras; a record of an earlier release, without a required
field or of an unknown version is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rcpu_bench.matrix.store import read_results
from rcpu_bench.records import (
    SCHEMA_VERSION,
    LayerTiming,
    Parameters,
    Perplexity,
    Record,
    Timing,
    append_record,
    read_records,
)

RESULTS = Path(__file__).resolve().parent.parent / "results"
STORES = sorted(RESULTS.glob("**/records.jsonl"))
PPL = {"profile": "rcpu128", "dataset": "wikitext2/test", "seqlen": 128, "n_windows": 2, "n_tokens": 254,
       "ppl": 12.5, "nll_mean": 2.5257, "dataset_sha256": "ab" * 32, "batch_size": 8}


def minimal() -> dict:
    return {"experiment": {"dtype": "float32"}, "parameters": {"before": 10, "after": 8, "removed_fraction": 0.2},
            "perplexity": [PPL], "timing": {"total_seconds": 1.0, "prune_seconds": {"solve": 0.5}, "layers": []},
            "peak_memory_bytes": 1024, "schema_version": SCHEMA_VERSION}


@pytest.mark.parametrize("store", STORES, ids=lambda path: path.parent.name)
def test_every_stored_record_reads_back_to_its_json(store):
    lines = [line["record"] for line in read_records(store) if line["status"] == "ok"]
    assert lines
    for line in lines:
        record = Record.from_json(line)
        assert record.to_json() == line
        assert [p.to_json() for p in record.perplexity] == line["perplexity"]
        assert record.timing.to_json() == line["timing"] and record.parameters.to_json() == line["parameters"]
        for part, entry in zip(record.perplexity, line["perplexity"], strict=True):
            assert part.ppl == entry["ppl"] and list(part.window_nll or []) == entry.get("window_nll", [])
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
                    "inference": {"decode_tokens_per_s": 3.0}}
    assert "generalisation" not in line and json.loads(json.dumps(line)) == line


def test_the_parts_are_typed_and_a_profiles_perplexity_is_looked_up_by_name():
    windows = {"window_nll": [300.0, 341.5], "window_targets": [127, 127]}
    record = Record.from_json({**minimal(), "perplexity": [PPL, {**PPL, "profile": "tinystories", "ppl": 3.0,
                                                                 **windows}],
                               "timing": {"total_seconds": 9.0, "prune_seconds": {"statistics": 1.0},
                                          "layers": [{"layer": 0, "statistics": 1.0}]}})
    assert record.parameters == Parameters(10, 8, 0.2)
    assert record.timing == Timing(9.0, {"statistics": 1.0}, (LayerTiming(0, {"statistics": 1.0}),))
    assert (record.ppl("rcpu128"), record.ppl("tinystories"), record.ppl("c4")) == (12.5, 3.0, None)
    stories = record.perplexity[1]
    assert stories.window_nll == (300.0, 341.5) and stories.window_targets == (127, 127)
    assert stories.summary().to_json() == {**PPL, "profile": "tinystories", "ppl": 3.0}


def test_a_record_of_an_earlier_release_without_a_required_field_or_of_an_unknown_version_is_refused():
    broken = minimal()
    del broken["timing"], broken["parameters"]
    with pytest.raises(ValueError, match="parameters, timing"):
        Record.from_json(broken)
    with pytest.raises(ValueError, match="schema_version 99"):
        Record.from_json({**minimal(), "schema_version": 99})
    earlier = minimal()
    del earlier["schema_version"]
    with pytest.raises(ValueError, match="earlier rcpu-bench: convert its store with `rcpu-bench migrate"):
        Record.from_json(earlier)
    with pytest.raises(ValueError, match="lacks n_tokens and has unknown tokens"):
        Perplexity.from_json({**{k: v for k, v in PPL.items() if k != "n_tokens"}, "tokens": 254})


def test_llama_cpp_speed_is_a_field_that_older_records_lack():
    assert Record.from_json(minimal()).inference_llama_cpp is None
    speed = {"prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 90.0, "gguf_dtype": "float16"}
    record = Record.from_json({**minimal(), "inference_llama_cpp": speed})
    assert record.inference_llama_cpp == speed and record.extra == {}
    assert record.to_json() == {**minimal(), "inference_llama_cpp": speed}


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
counts = st.integers(0, 10**9)
perplexities = st.fixed_dictionaries(
    {"profile": st.text(min_size=1), "dataset": st.text(), "seqlen": counts, "n_windows": counts, "n_tokens": counts,
     "ppl": finite, "nll_mean": finite, "dataset_sha256": st.text(), "batch_size": counts},
    optional={"window_nll": st.lists(finite), "window_targets": st.lists(counts)})
timings = st.fixed_dictionaries(
    {"total_seconds": finite, "prune_seconds": st.dictionaries(st.sampled_from(["capture", "solve"]), finite),
     "layers": st.lists(st.builds(lambda i, s: {"layer": i, **s}, counts,
                                  st.dictionaries(st.sampled_from(["statistics", "forward"]), finite)))})


@given(perplexities, timings, st.builds(lambda b, a, f: {"before": b, "after": a, "removed_fraction": f},
                                        counts, counts, finite))
def test_each_typed_part_reads_and_writes_its_json_unchanged(ppl, timing, parameters):
    assert Perplexity.from_json(ppl).to_json() == ppl
    assert Timing.from_json(timing).to_json() == timing
    assert Parameters.from_json(parameters).to_json() == parameters
