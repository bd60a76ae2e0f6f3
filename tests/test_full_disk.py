"""Writes whose size is known are refused when the file system lacks the room, before anything is written (saves,
GGUF exports; the conversion's and the search's are in test_real_model_cache.py and test_search_cost.py), and a full
disk met anyway is one line that says only what is true: what was left where, and no 0-byte file left behind."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from tiny_models import STORIES, STORIES_MHA, needs_stories, tiny_config, tiny_model

from rcpu_bench import atomic_file, records
from rcpu_bench.cli import main
from rcpu_bench.model.persistence import save_pruned, saved_bytes, unique_tensors

QUICK = ["--calib", "tinystories:8x32", "--ppl", "tinystories[900:902]", "--quiet"]


def free(monkeypatch, under: Path, n_bytes: int) -> None:
    """The file system of ``under`` has ``n_bytes`` free (others keep theirs)."""
    usage = shutil.disk_usage

    def disk_usage(path):
        if Path(path).resolve().is_relative_to(under.resolve()):
            return shutil._ntuple_diskusage(10**12, 10**12 - n_bytes, n_bytes)
        return usage(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err
    return line


def test_the_save_estimate_bounds_the_bytes_a_save_writes(tmp_path):
    from transformers import AutoTokenizer

    model, tokenizer = tiny_model(tiny_config(vocab=512)), AutoTokenizer.from_pretrained(STORIES)
    save_pruned(model, tmp_path / "m", tokenizer=tokenizer)
    written = sum(p.stat().st_size for p in (tmp_path / "m").iterdir())
    estimate = saved_bytes(unique_tensors(model), tokenizer)
    assert written <= estimate <= written + len(tokenizer) * 256 + 2**20


def test_a_save_without_the_room_is_refused_before_writing(tmp_path, monkeypatch):
    model = tiny_model(tiny_config())
    free(monkeypatch, tmp_path, 1000)
    with pytest.raises(OSError, match=f"saving the model to {tmp_path / 'm'} would need about .* and {tmp_path} has "
                                      "1 KiB free; allowed: a directory on a file system with that much free space"):
        save_pruned(model, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


@needs_stories
def test_a_gguf_export_without_the_room_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    free(monkeypatch, tmp_path, 2**20)
    assert main(["export", "--format", "gguf", str(STORIES), str(tmp_path / "m.gguf")]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"the GGUF file {tmp_path / 'm.gguf'} would need about " in line
    assert f"and {tmp_path} has 1.0 MiB free; allowed: a path on a file system with that much free space" in line
    assert list(tmp_path.iterdir()) == []


@needs_stories
def test_a_short_write_of_a_gguf_file_is_named_as_one_not_as_byte_counts(tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")

    def short(*args, **kwargs):
        raise OSError("32768 requested and 25600 written")  # numpy's tofile on a full disk: no errno

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    assert main(["export", "--format", "gguf", str(STORIES), str(tmp_path / "m.gguf")]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"rcpu-bench export: error: cannot write {tmp_path / 'm.gguf'}: wrote less than asked (32768 requested and "
        "25600 written): the file system is full or failed; it is left as it was and no partial file remains")
    assert list(tmp_path.iterdir()) == []


@needs_stories
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_an_export_onto_a_directory_says_a_file_is_wanted(tmp_path, capsys, overwrite):
    pytest.importorskip("gguf")
    (tmp_path / "dir").mkdir()
    assert main(["export", "--format", "gguf", *overwrite, str(STORIES), str(tmp_path / "dir")]) == 2
    assert error_line(capsys.readouterr().err) == (f"rcpu-bench export: error: GGUF file {tmp_path / 'dir'} is a "
                                                   "directory; allowed: a file (a new path or an existing regular "
                                                   "file)")


@needs_stories
def test_prune_export_gguf_onto_an_existing_file_offers_no_flag_prune_lacks(tmp_path, capsys):
    pytest.importorskip("gguf")
    (tmp_path / "m.gguf").write_text("x")
    assert main(["prune", "--model", str(STORIES_MHA), *QUICK, "--save", str(tmp_path / "s"), "--export-gguf",
                 str(tmp_path / "m.gguf")]) == 2
    assert error_line(capsys.readouterr().err).endswith(f"GGUF file {tmp_path / 'm.gguf'} already exists; allowed: a "
                                                        "new path")


def test_a_record_that_cannot_be_written_leaves_no_new_empty_file(tmp_path, monkeypatch):
    def full(descriptor, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(records.os, "write", full)
    path = tmp_path / "r.jsonl"
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device; it is left as it was"):
        records.append_record(path, {"a": 1})
    assert list(tmp_path.iterdir()) == []
    path.write_text("")  # an empty file the user made stays
    with pytest.raises(OSError):
        records.append_record(path, {"a": 1})
    assert path.read_text() == ""


def test_sizes_are_written_for_people():
    assert [atomic_file.byte_size(n) for n in (1, 2**10, 5 * 2**20 + 1, 517 * 2**20, 3 * 2**30 // 2)] == [
        "1 KiB", "1 KiB", "5.0 MiB", "517 MiB", "1.5 GiB"]
