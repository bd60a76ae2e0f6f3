"""Calibration data: shared-dir lookup, spec parsing, sources, the reference window sampling, the cache."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import STORIES, TINYSTORIES, WIKI_TEST
from transformers import AutoTokenizer

from rcpu_bench import corpora, data, paths
from rcpu_bench.data import CalibSpec, calibration_data, holdout_windows, parse_calib

needs_shared = pytest.mark.skipif(not STORIES.is_dir(), reason=f"shared fixtures not found (set {paths.SHARED_ENV})")
# The canonical WikiText-2 raw test file (shared/DATA.md).
WIKI_TEST_SHA = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"


@pytest.fixture(scope="module")
def tok():
    if not STORIES.is_dir():
        pytest.skip(f"shared fixtures not found (set {paths.SHARED_ENV})")
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(autouse=True)
def fresh_cache():
    data.clear_cache()
    yield
    data.clear_cache()


def reference_windows(ids: torch.Tensor, n_samples: int, seqlen: int, seed: int) -> torch.Tensor:
    """The SparseGPT/FLAP/RCPU loop, global ``random`` included (its state is restored afterwards)."""
    state = random.getstate()
    try:
        random.seed(seed)
        windows = []
        for _ in range(n_samples):
            i = random.randint(0, ids.shape[1] - seqlen - 1)
            windows.append(ids[:, i : i + seqlen])
        return torch.cat(windows)
    finally:
        random.setstate(state)


# ------------------------------------------------------------------------------------------------ paths


def test_shared_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.SHARED_ENV, str(tmp_path))
    monkeypatch.delenv(paths.DATA_ENV, raising=False)
    assert paths.shared_dir() == tmp_path
    assert paths.data_dir() == tmp_path / "data"
    monkeypatch.setenv(paths.DATA_ENV, str(tmp_path / "elsewhere"))
    assert paths.data_dir() == tmp_path / "elsewhere"


def test_shared_dir_env_pointing_nowhere_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.SHARED_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=f"{paths.SHARED_ENV}=.*missing"):
        paths.shared_dir()


def test_shared_dir_beside_the_repo(monkeypatch):
    monkeypatch.delenv(paths.SHARED_ENV, raising=False)
    repo_root = Path(paths.__file__).resolve().parent.parent
    if not (repo_root.parent / "shared").is_dir():
        pytest.skip("no shared/ beside this checkout")
    assert paths.shared_dir() == repo_root.parent / "shared"


def test_shared_dir_not_found_lists_places_and_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.SHARED_ENV, raising=False)
    monkeypatch.setattr(paths, "__file__", str(tmp_path / "repo" / "rcpu_bench" / "paths.py"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    with pytest.raises(FileNotFoundError) as err:
        paths.shared_dir()
    message = str(err.value)
    assert paths.SHARED_ENV in message
    for place in (tmp_path / "shared", tmp_path / "a" / "b" / "shared", tmp_path / "a" / "shared"):
        assert str(place) in message


# ------------------------------------------------------------------------------------------ spec parsing


@pytest.mark.parametrize("text, expected", [
    ("wikitext2:128x128", CalibSpec("wikitext2", 128, 128, 0)),
    ("wikitext2", CalibSpec("wikitext2", 128, 128, 0)),
    ("tinystories:64x256", CalibSpec("tinystories", 64, 256, 0)),
    ("tinystories[100:300]:8x32:seed=7", CalibSpec("tinystories[100:300]", 8, 32, 7)),
    ("wikitext2:seed=3", CalibSpec("wikitext2", 128, 128, 3)),
    ("file:/data/my:corpus.jsonl:16x512", CalibSpec("file:/data/my:corpus.jsonl", 16, 512, 0)),
    ("file:notes.txt", CalibSpec("file:notes.txt", 128, 128, 0)),
])
def test_parse_calib(text, expected):
    assert parse_calib(text) == expected


@pytest.mark.parametrize("text, words", [
    ("c4:128x128", ["'c4'", "wikitext2", "tinystories[START:STOP]", "file:PATH", "SOURCE[:NxSEQLEN]"]),
    ("wikitext2:0x128", ["n_samples", "0"]),
    ("wikitext2:128x0", ["seqlen", "0"]),
    ("wikitext2:128by128", ["'wikitext2:128by128'", "allowed"]),
    ("wikitext2[0:10]", ["'wikitext2[0:10]'"]),
    ("file:", ["'file:'"]),
    ("", ["empty"]),
])
def test_parse_calib_errors_name_the_bad_value_and_the_allowed_forms(text, words):
    with pytest.raises(ValueError) as err:
        parse_calib(text)
    for word in words:
        assert word in str(err.value)


@settings(max_examples=50, deadline=None)
@given(source=st.sampled_from(["wikitext2", "tinystories", "tinystories[3:9]", "file:/x/y.txt", "file:a:b.jsonl"]),
       n=st.integers(1, 1024), seqlen=st.integers(2, 2048), seed=st.integers(0, 2**32))  # within MAX_CALIB_TOKENS
def test_spec_string_round_trips(source, n, seqlen, seed):
    spec = CalibSpec(source, n, seqlen, seed)
    assert parse_calib(str(spec)) == spec


# --------------------------------------------------------------------------------------- window sampling


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2, 400), data_=st.data())
def test_window_offsets_match_the_reference_loop(length, data_):
    seqlen = data_.draw(st.integers(1, length - 1))
    n_samples = data_.draw(st.integers(1, 20))
    seed = data_.draw(st.integers(0, 2**32))
    ids = torch.arange(length)
    windows = data.sample_windows(ids, n_samples, seqlen, seed)
    assert torch.equal(windows, reference_windows(ids[None], n_samples, seqlen, seed))
    assert windows.shape == (n_samples, seqlen) and windows.dtype == torch.long


def test_sampling_leaves_the_global_random_state_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    data.sample_windows(torch.arange(100), 5, 10, 0)
    assert random.random() == expected


def test_calibration_windows_match_reference_on_a_text_file(tok, tmp_path):
    text = WIKI_TEST.read_text(encoding="utf-8")[:20_000]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    got = calibration_data(f"file:{corpus}:16x64:seed=5", tok)
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(got.tokens, reference_windows(ids, 16, 64, 5))
    assert got.provenance.as_dict() == {
        "source": f"file:{corpus}", "split": "file", "origin": str(corpus),
        "sha256": hashlib.sha256(text.encode()).hexdigest(), "n_tokens": ids.shape[1],
        "n_samples": 16, "seqlen": 64, "seed": 5}


def test_seqlen_longer_than_the_stream_is_an_error(tok, tmp_path):
    corpus = tmp_path / "short.txt"
    corpus.write_text("Once upon a time.", encoding="utf-8")
    n_tokens = len(tok("Once upon a time.").input_ids)
    with pytest.raises(ValueError, match=f"seqlen {n_tokens} needs .* at least {n_tokens + 1} .* gives {n_tokens};"
                       f" allowed: a seqlen of at most {n_tokens - 1}"):
        calibration_data(CalibSpec(f"file:{corpus}", 4, n_tokens), tok)
    assert calibration_data(CalibSpec(f"file:{corpus}", 4, n_tokens - 1), tok).tokens.shape == (4, n_tokens - 1)


def test_seqlen_beyond_the_model_context_fails_before_any_loading(tok, tmp_path):
    with pytest.raises(ValueError, match="seqlen 1024 exceeds the model's max_position_embeddings 512"):
        calibration_data(f"file:{tmp_path / 'does-not-exist.txt'}:4x1024", tok, max_positions=512)


# ------------------------------------------------------------------------------------------------ sources


def write_wikitext(data_dir: Path, split: str, lines: list[str]) -> Path:
    path = data_dir / "wikitext-2-raw-v1" / f"wiki.{split}.raw"
    path.parent.mkdir(parents=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_wikitext_rows_are_rebuilt_and_joined_as_the_reference(tmp_path):
    lines = [" \n", " = Title = \n", " \n", " Body text . \n"]
    train = write_wikitext(tmp_path, "train", lines)
    write_wikitext(tmp_path / "t", "test", lines)
    # datasets yields the rows "", " = Title = \n", "", " Body text . \n"
    assert corpora.wikitext2_text(tmp_path, "train").documents == ("  = Title = \n   Body text . \n",)
    assert corpora.wikitext2_text(tmp_path / "t", "test").documents == ("\n\n = Title = \n\n\n\n\n Body text . \n",)
    source = data.load_source("wikitext2", tmp_path)
    assert (source.source, source.split, source.origin) == ("wikitext2", "train", str(train))
    assert source.sha256 == hashlib.sha256(train.read_bytes()).hexdigest()


@needs_shared
def test_shared_wikitext_test_file_is_the_canonical_one():
    source = corpora.wikitext2_text(None, "test")
    assert source.sha256 == WIKI_TEST_SHA
    assert source.documents[0].startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is")


def test_wikitext_train_offline_error(tok, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("datasets was called offline"))
    with pytest.raises(FileNotFoundError) as err:
        calibration_data("wikitext2", tok, data_dir=tmp_path)
    message = str(err.value)
    for words in ("train split is not available offline", "tinystories", "file:PATH", "wiki.train.raw"):
        assert words in message


def test_wikitext_online_uses_datasets_rows(tmp_path, monkeypatch):
    import datasets

    rows = ["", " = Title = \n", "", " Body . \n"]
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or {"text": rows})
    source = corpora.wikitext2_text(tmp_path, "train")
    assert calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "train"})]
    assert source.documents == (" ".join(rows),)
    assert source.origin == "datasets:wikitext/wikitext-2-raw-v1/train"
    assert source.sha256 == hashlib.sha256(" ".join(rows).encode()).hexdigest()


@needs_shared
def test_tinystories_stream_is_bos_plus_story_per_story(tok):
    got = calibration_data("tinystories:8x128", tok)
    path = TINYSTORIES
    stories = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    expected = [tok.bos_token_id] + [t for s in stories[:500] for t in tok(s["text"]).input_ids][1:]
    assert [s["idx"] for s in stories[:500]] == list(range(500))
    stream = data.token_stream(data.load_source("tinystories"), tok)
    assert stream.tolist() == expected
    assert int((stream == tok.bos_token_id).sum()) == 500
    assert torch.equal(got.tokens, reference_windows(stream[None], 8, 128, 0))
    assert got.provenance.split == "validation[0:500]"
    assert got.provenance.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert got.provenance.n_tokens == len(expected)


@needs_shared
def test_tinystories_ranges():
    held_out = data.load_source("tinystories[500:1000]")
    assert held_out.split == "validation[500:1000]" and len(held_out.documents) == 500
    assert set(held_out.documents).isdisjoint(data.load_source("tinystories").documents)
    with pytest.raises(ValueError, match=r"\[900:1100\] asks for 200 stories .* has 100"):
        data.load_source("tinystories[900:1100]")
    with pytest.raises(ValueError, match=r"\[5:5\] is empty"):
        data.load_source("tinystories[5:5]")


def test_file_sources(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n', encoding="utf-8")
    assert data.load_source(f"file:{jsonl}").documents == ("one", "two")
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: no field.* text"):
        data.load_source(f"file:{tmp_path / 'bad.jsonl'}")
    with pytest.raises(ValueError, match=r"suffix '\.csv'; allowed: \.txt, \.jsonl"):
        data.load_source(f"file:{tmp_path / 'c.csv'}")


# -------------------------------------------------------------------------------------------------- cache


def test_cache_keys_separate_seeds_seqlens_tokenizers_and_file_contents(tok, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(WIKI_TEST.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    spec = CalibSpec(f"file:{corpus}", 8, 32, 0)
    base = calibration_data(spec, tok).tokens
    other_seed = calibration_data(CalibSpec(spec.source, 8, 32, 1), tok).tokens
    other_seqlen = calibration_data(CalibSpec(spec.source, 8, 16, 0), tok).tokens
    assert not torch.equal(base, other_seed) and other_seqlen.shape == (8, 16)
    assert len(data._DOCUMENT_TOKENS) == 1 and len(data._WINDOWS) == 3

    same_name = AutoTokenizer.from_pretrained(STORIES)
    same_name.add_tokens(["zzqq"])
    assert same_name.name_or_path == tok.name_or_path
    assert data.tokenizer_fingerprint(same_name) != data.tokenizer_fingerprint(tok)
    calibration_data(spec, same_name)
    assert len(data._DOCUMENT_TOKENS) == 2 and len(data._WINDOWS) == 4

    corpus.write_text("A completely different text. " * 200, encoding="utf-8")
    rewritten = calibration_data(spec, tok)
    expected = reference_windows(tok(corpus.read_text(encoding="utf-8"), return_tensors="pt").input_ids, 8, 32, 0)
    assert torch.equal(rewritten.tokens, expected)
    assert len(data._DOCUMENT_TOKENS) == 3 and len(data._WINDOWS) == 5


def test_cached_windows_are_reused_and_protected_from_callers(tok, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat. " * 50, encoding="utf-8")
    first = calibration_data(f"file:{corpus}:4x16", tok).tokens
    expected = first.clone()
    first.zero_()
    again = calibration_data(f"file:{corpus}:4x16", tok).tokens
    assert torch.equal(again, expected)
    assert len(data._DOCUMENT_TOKENS) == 1 and len(data._WINDOWS) == 1


def test_bos_windows_are_the_bos_and_seqlen_minus_one_stream_tokens(tok, tmp_path):
    text = WIKI_TEST.read_text(encoding="utf-8")[:20_000]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    got = calibration_data(f"file:{corpus}:16x64:seed=5:bos", tok)
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(got.tokens[:, 0], torch.full((16,), tok.bos_token_id))
    assert torch.equal(got.tokens[:, 1:], reference_windows(ids, 16, 63, 5))
    assert got.provenance.bos and got.provenance.seqlen == 64
    assert str(parse_calib(f"file:{corpus}:16x64:seed=5:bos")) == f"file:{corpus}:16x64:seed=5:bos"
    held = holdout_windows(f"file:{corpus}:16x64:seed=5:bos", tok, 3)
    assert held.shape == (3, 64) and torch.equal(held[:, 0], torch.full((3,), tok.bos_token_id))


@needs_shared
def test_wikitext2_valid_is_the_validation_file_joined_as_the_train_split(tok):
    path = paths.data_dir() / "wikitext-2-v1" / "wiki.valid.tokens"
    rows = [row if row.strip() else "" for row in path.read_text(encoding="utf-8").splitlines(keepends=True)]
    got = calibration_data("wikitext2-valid:6x32:seed=3", tok)
    ids = tok(" ".join(rows), return_tensors="pt").input_ids
    assert torch.equal(got.tokens, reference_windows(ids, 6, 32, 3))
    assert (got.provenance.source, got.provenance.split, got.provenance.n_tokens) == (
        "wikitext2-valid", "validation (v1 tokens)", ids.shape[1])
    assert got.provenance.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(FileNotFoundError, match="wiki.valid.tokens does not exist"):
        calibration_data("wikitext2-valid:6x32", tok, data_dir=path.parent.parent.parent)


@needs_shared
def test_the_cpython_source_is_the_calibration_file_and_disjoint_from_the_test_file(tok):
    directory = paths.data_dir() / "code" / "cpython-3.11-stdlib"
    calib, test = (directory / name for name in ("calib.txt", "test.txt"))
    got = calibration_data("cpython:5x48:seed=2", tok)
    ids = tok(calib.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    assert torch.equal(got.tokens, reference_windows(ids, 5, 48, 2))
    assert (got.provenance.source, got.provenance.sha256) == ("cpython", hashlib.sha256(calib.read_bytes()).hexdigest())
    listed = (directory / "FILES.txt").read_text().split("test.txt:")
    calib_modules, test_modules = (set(part.split()) - {"calib.txt:"} for part in listed)
    assert calib_modules and test_modules and not calib_modules & test_modules
    assert corpora.cpython_text(split="test").sha256 == hashlib.sha256(test.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="unknown CPython split 'train'; allowed: calib, test"):
        corpora.cpython_text(split="train")
    with pytest.raises(FileNotFoundError, match="calib.txt does not exist"):
        calibration_data("cpython:5x48", tok, data_dir=directory)
