"""The texts a run draws tokens from, each with where it came from and the sha256 of the file read: WikiText-2 (raw
test and train, the tokenized validation release), TinyStories, Python code (the CPython standard library) and a
user's file. ``rcpu_bench.data`` cuts calibration windows from them, ``rcpu_bench.evaluation.perplexity`` its
evaluation sequences.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rcpu_bench import paths

TINYSTORIES_CALIB = (0, 500)  # calibration stories; 500-999 are held out for evaluation
TINYSTORIES_FILE = Path("tinystories") / "validation_first1000.jsonl"
WIKITEXT_DATASET = ("wikitext", "wikitext-2-raw-v1")
WIKITEXT_VALID_FILE = Path("wikitext-2-v1") / "wiki.valid.tokens"
# The CPython 3.11 standard library's top-level modules, split by name: a–m to calibrate on, n–z to score.
CPYTHON_DIR = Path("code") / "cpython-3.11-stdlib"
CPYTHON_SPLITS = {"calib": "calib.txt", "test": "test.txt"}
# How the reference code joins the dataset rows of each split.
WIKITEXT_JOIN = {"train": " ", "test": "\n\n"}
MAX_CORPUS_BYTES = 1 << 30


@dataclass(frozen=True)
class SourceText:
    """The documents of a source, with where they came from."""

    source: str
    split: str
    origin: str
    sha256: str
    documents: tuple[str, ...]


def sha256_file(path: Path) -> str:
    """The file's sha256, hashed once per process while its size and modification time stay the same."""
    stat = Path(path).stat()
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _data_dir(data_dir: Path | str | None) -> Path:
    return Path(data_dir) if data_dir is not None else paths.data_dir()


def _offline() -> bool:
    return any(os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def wikitext2_text(data_dir: Path | str | None = None, split: str = "train") -> SourceText:
    """WikiText-2-raw ``split`` as one document, its rows joined as the reference does (train " ", test "\\n\\n").

    The local file ``<data_dir>/wikitext-2-raw-v1/wiki.{split}.raw`` (the original release, one row per
    line) is read first, its rows rebuilt as ``datasets`` yields them: a blank line is the row "", any
    other line keeps its "\\n". Without it, the split is loaded with ``datasets`` unless offline.
    """
    if split not in WIKITEXT_JOIN:
        raise ValueError(f"unknown WikiText-2 split {split!r}; allowed: {', '.join(WIKITEXT_JOIN)}")
    path = _data_dir(data_dir) / WIKITEXT_DATASET[1] / f"wiki.{split}.raw"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            rows = [row if row.strip() else "" for row in f]
        return SourceText("wikitext2", split, str(path), sha256_file(path), (WIKITEXT_JOIN[split].join(rows),))
    return _wikitext2_online(split, path)


def _wikitext2_online(split: str, missing: Path) -> SourceText:
    hint = "use --calib tinystories or --calib file:PATH" if split == "train" else "use the tinystories profile"
    unavailable = (f"the WikiText-2-raw {split} split is not available offline: {missing} does not exist "
                   f"and the Hugging Face hub cannot be used; {hint}, or put the split's file there")
    if _offline():
        raise FileNotFoundError(unavailable + " (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)")
    import datasets

    try:
        rows = datasets.load_dataset(*WIKITEXT_DATASET, split=split)["text"]
    except Exception as err:
        raise FileNotFoundError(f"{unavailable} ({type(err).__name__}: {err})") from err
    text = WIKITEXT_JOIN[split].join(rows)
    origin = f"datasets:{'/'.join(WIKITEXT_DATASET)}/{split}"
    return SourceText("wikitext2", split, origin, hashlib.sha256(text.encode()).hexdigest(), (text,))


def wikitext2_valid_text(data_dir: Path | str | None = None) -> SourceText:
    """WikiText-2 v1 validation (``<data_dir>/wikitext-2-v1/wiki.valid.tokens``) as one document, its rows joined as
    the reference joins the train split (" "): an in-domain stand-in for the train split where only the shared
    files exist. It is the tokenized release (``<unk>`` for rare words, " @-@ " for hyphens), not the raw text."""
    path = _data_dir(data_dir) / WIKITEXT_VALID_FILE
    if not path.is_file():
        raise FileNotFoundError(f"WikiText-2 validation file {path} does not exist; allowed: a data directory "
                                f"with {WIKITEXT_VALID_FILE} (--data-dir or ${paths.DATA_ENV})")
    with open(path, encoding="utf-8") as f:
        rows = [row if row.strip() else "" for row in f]
    return SourceText("wikitext2-valid", "validation (v1 tokens)", str(path), sha256_file(path),
                      (WIKITEXT_JOIN["train"].join(rows),))


def cpython_text(data_dir: Path | str | None = None, split: str = "calib") -> SourceText:
    """Python source: the CPython 3.11 standard library's top-level modules as one document, the ``calib`` split
    (modules a–m) or the disjoint ``test`` split (n–z), each file's text joined with "\n\n" in sorted order
    (``<data_dir>/code/cpython-3.11-stdlib/``)."""
    if split not in CPYTHON_SPLITS:
        raise ValueError(f"unknown CPython split {split!r}; allowed: {', '.join(CPYTHON_SPLITS)}")
    path = _data_dir(data_dir) / CPYTHON_DIR / CPYTHON_SPLITS[split]
    if not path.is_file():
        raise FileNotFoundError(f"CPython source file {path} does not exist; allowed: a data directory with "
                                f"{CPYTHON_DIR / CPYTHON_SPLITS[split]} (--data-dir or ${paths.DATA_ENV})")
    return SourceText("cpython", f"{split} (modules {'a-m' if split == 'calib' else 'n-z'})", str(path),
                      sha256_file(path), (path.read_text(encoding="utf-8"),))


def tinystories_text(data_dir: Path | str | None = None, stories: tuple[int, int] = TINYSTORIES_CALIB) -> SourceText:
    """The TinyStories validation stories with ``start <= idx < stop``, one document each."""
    start, stop = stories
    if not 0 <= start < stop:
        raise ValueError(f"TinyStories range [{start}:{stop}] is empty or negative; expected 0 <= START < STOP")
    path = _data_dir(data_dir) / TINYSTORIES_FILE
    rows = _read_jsonl(path, ("idx", "text"))
    documents = tuple(row["text"] for row in rows if start <= row["idx"] < stop)
    if len(documents) != stop - start:
        raise ValueError(f"TinyStories range [{start}:{stop}] asks for {stop - start} stories but {path} has "
                         f"{len(documents)} of them ({len(rows)} stories in all)")
    return SourceText("tinystories", f"validation[{start}:{stop}]", str(path), sha256_file(path), documents)


def file_text(path: Path | str) -> SourceText:
    """A user corpus: a ``.txt`` file is one document; a ``.jsonl`` file has one per line, in its "text" field.

    It must be a regular file (a link to a device such as /dev/zero would be read without end) of at most
    ``MAX_CORPUS_BYTES``."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"calibration file {path} is not a regular file; allowed: a .txt or .jsonl file")
    if path.is_file() and path.stat().st_size > MAX_CORPUS_BYTES:
        raise ValueError(f"calibration file {path} has {path.stat().st_size:,} bytes; allowed: at most "
                         f"{MAX_CORPUS_BYTES:,} bytes")
    if path.suffix == ".txt":
        documents = (path.read_text(encoding="utf-8"),)
    elif path.suffix == ".jsonl":
        documents = tuple(row["text"] for row in _read_jsonl(path, ("text",)))
    else:
        raise ValueError(f"calibration file {path} has suffix {path.suffix!r}; allowed: .txt, .jsonl")
    return SourceText(f"file:{path}", "file", str(path), sha256_file(path), documents)


def _read_jsonl(path: Path, fields: tuple[str, ...]) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                missing = [name for name in fields if name not in row]
                if missing:
                    raise ValueError(f"{path}, line {number}: no field(s) {', '.join(missing)}; "
                                     f"each line needs {', '.join(fields)}")
                rows.append(row)
    return rows
