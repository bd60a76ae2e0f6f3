"""The command line: clear errors before any work, a durable record, a reloadable saved model."""

from __future__ import annotations

import json

import pytest
from tiny_models import STORIES_MHA, needs_stories

from rcpu_bench.cli import main
from rcpu_bench.evaluation.perplexity import perplexity
from rcpu_bench.model.persistence import load_pruned
from rcpu_bench.records import read_records

QUICK = ["--model", str(STORIES_MHA), "--calib", "tinystories:8x64", "--ppl", "tinystories[900:930]", "--quiet"]


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--ratio", "1.0"], "ratio 1.0"),
    (["--scorer", "nope"], "unknown scorer 'nope'; registered scorers: flap-wifv, magnitude"),
    (["--compensator-param", "alpha=1"], "allowed: dtype"),
    (["--compensator", "ridge", "--compensator-param", "lam=-1"], "lam=-1"),
    (["--scorer", "wanda-sp", "--scorer-param", "variant='l1'"], "allowed: 'flap', 'rcpu-code', 'paper'"),
    (["--compensator", "ridge", "--compensator-param", "dtype='float16'"], "float16"),
    (["--calib", "c4:128x128"], "c4"),
    (["--calib", "tinystories:8x9999"], "9999"),
    (["--ppl", "wikitext103"], "wikitext103"),
    (["--dtype", "int8"], "int8"),
    (["--device", "gpu"], "gpu"),
])
@needs_stories
def test_bad_input_is_reported_before_work(capsys, tmp_path, args, message):
    out = tmp_path / "r.jsonl"
    code = main(["prune", *QUICK, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "rcpu-bench prune: error:" in err and message in err
    assert not out.exists()


@needs_stories
def test_missing_data_directory_is_reported(capsys, tmp_path):
    assert main(["prune", *QUICK, "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.slow
@needs_stories
def test_prune_writes_a_record_and_a_reloadable_model(capsys, tmp_path):
    out, saved = tmp_path / "results" / "r.jsonl", tmp_path / "pruned"
    code = main(["prune", *QUICK, "--ratio", "0.25", "--out", str(out), "--save", str(saved)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ppl[tinystories[900:930]]" in printed and "removed" in printed
    (record,) = read_records(out)
    assert record["experiment"]["prune"]["compensator"] == "procrustes"
    assert record["calibration"]["n_samples"] == 8 and record["calibration"]["sha256"]
    assert record["versions"]["torch"] and record["versions"]["transformers"]
    assert record["parameters"]["after"] < record["parameters"]["before"]
    assert len(record["timing"]["layers"]) == 5 and record["peak_memory_bytes"] > 0
    ppl = record["perplexity"][0]
    assert ppl["profile"] == "tinystories[900:930]" and ppl["n_windows"] == 30
    loaded = load_pruned(saved)
    again = perplexity(loaded.model, loaded.tokenizer, "tinystories[900:930]")
    assert again["ppl"] == pytest.approx(ppl["ppl"], rel=1e-6)
    manifest = json.loads((saved / "rcpu_manifest.json").read_text())
    assert manifest["parameter_count"] == record["parameters"]["after"]


@needs_stories
def test_save_refuses_a_non_empty_directory(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    assert main(["prune", *QUICK, "--save", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_plugins_lists_the_built_ins(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("variance", "wanda-sp", "procrustes", "scaled-procrustes", "ridge", "flap-bias"):
        assert name in out
