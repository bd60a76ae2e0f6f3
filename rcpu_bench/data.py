"""Calibration data: token windows drawn from one token stream (the RCPU / SparseGPT / FLAP protocol).

The official code (``lib/data.py``) tokenizes the source once and draws windows at uniform offsets::

    ids = tokenizer(text).input_ids
    random.seed(seed)
    for _ in range(n_samples):
        i = random.randint(0, len(ids) - seqlen - 1)
        window = ids[i : i + seqlen]

A source is a list of documents, each tokenized with the tokenizer's own special tokens and the
results concatenated into the stream. A one-document source (WikiText-2 train joined with a single
space, a ``.txt`` file) is therefore tokenized exactly as the reference does, with the one BOS the
tokenizer adds. A many-document source (TinyStories, a ``.jsonl`` file) gets a BOS before every
document, as llama2.c laid out the stories stories260K was trained on; windows may span a document
boundary, BOS included.

Token streams and windows are cached in memory only, keyed by everything that changes them: the
tokenizer (name and a hash of its vocabulary and special-token behaviour), the source, its split or
range and the sha256 of the file read (the official code keyed its cached inputs by model name only
and silently reused stale ones).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from rcpu_bench import corpora
from rcpu_bench.corpora import SourceText

DEFAULT_N_SAMPLES = 128
DEFAULT_SEQLEN = 128
DEFAULT_SEED = 0
SPEC_FORM = "SOURCE[:NxSEQLEN][:seed=S][:bos], e.g. wikitext2:128x128"
# The bound on what a calibration spec may ask for: the paper's largest is 512 x 128 tokens, 32x less.
MAX_CALIB_TOKENS = 1 << 21
_PROBE = "Hello world"


@dataclass(frozen=True)
class CalibSpec:
    """What to calibrate on: ``n_samples`` windows of ``seqlen`` tokens from ``source``, drawn with ``seed``;
    ``bos``: each window is the tokenizer's BOS and ``seqlen`` − 1 stream tokens (when the tokenizer adds a BOS
    to every text: models trained always to see it first, as Gemma, see it in calibration too)."""

    source: str = "wikitext2"
    n_samples: int = DEFAULT_N_SAMPLES
    seqlen: int = DEFAULT_SEQLEN
    seed: int = DEFAULT_SEED
    bos: bool = False

    def __post_init__(self) -> None:
        _match_source(self.source)
        if self.n_samples < 1:
            raise ValueError(f"calibration n_samples must be at least 1, got {self.n_samples}")
        if self.seqlen < 2:
            raise ValueError(f"calibration seqlen {self.seqlen}: a window needs a token after the first to predict "
                             "(its calibration perplexity has no target otherwise); allowed: a seqlen of at least 2")
        if self.n_samples * self.seqlen > MAX_CALIB_TOKENS:
            raise ValueError(f"calibration {self.n_samples} x {self.seqlen} = {self.n_samples * self.seqlen:,} "
                             f"tokens; allowed: at most {MAX_CALIB_TOKENS:,} tokens in all (e.g. "
                             f"{MAX_CALIB_TOKENS // self.seqlen:,} windows of {self.seqlen})")

    def __str__(self) -> str:
        return f"{self.source}:{self.n_samples}x{self.seqlen}:seed={self.seed}" + (":bos" if self.bos else "")


@dataclass(frozen=True)
class Provenance:
    """Where calibration windows came from, to be stored with every result."""

    source: str
    split: str
    origin: str
    sha256: str
    n_tokens: int
    n_samples: int
    seqlen: int
    seed: int
    bos: bool = False  # each window begins with the tokenizer's BOS (CalibSpec.bos and a tokenizer that adds one)

    def as_dict(self) -> dict[str, str | int | bool]:
        """The fields, ``bos`` only when set (records of windows without a BOS keep their earlier form)."""
        fields = asdict(self)
        if not self.bos:
            del fields["bos"]
        return fields


@dataclass(frozen=True)
class CalibData:
    """Calibration windows, a LongTensor (n_samples, seqlen), and their provenance."""

    tokens: Tensor
    provenance: Provenance


# --------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Source:
    form: str
    pattern: re.Pattern[str]
    load: Callable[[re.Match[str], Path | str | None], SourceText]


SOURCES: dict[str, _Source] = {
    "wikitext2": _Source("wikitext2 (WikiText-2-raw train)", re.compile(r"wikitext2"),
                         lambda m, data_dir: corpora.wikitext2_text(data_dir, "train")),
    "wikitext2-valid": _Source("wikitext2-valid (WikiText-2 v1 validation, tokenized release: a stand-in for the "
                               "train split offline)", re.compile(r"wikitext2-valid"),
                               lambda m, data_dir: corpora.wikitext2_valid_text(data_dir)),
    "tinystories": _Source(
        "tinystories[START:STOP] (TinyStories validation stories START..STOP-1; default [0:500])",
        re.compile(r"tinystories(?:\[(\d+):(\d+)\])?"),
        lambda m, data_dir: corpora.tinystories_text(data_dir, (int(m[1]), int(m[2])) if m[1]
                                                     else corpora.TINYSTORIES_CALIB)),
    "cpython": _Source("cpython (Python code: the CPython 3.11 standard library's modules a-m; the cpython128 "
                       "perplexity profile scores n-z)", re.compile(r"cpython"),
                       lambda m, data_dir: corpora.cpython_text(data_dir, "calib")),
    "file": _Source("file:PATH (a .txt or .jsonl corpus)", re.compile(r"file:(.+)"),
                    lambda m, data_dir: corpora.file_text(m[1])),
}


def _match_source(source: str) -> tuple[_Source, re.Match[str]]:
    for entry in SOURCES.values():
        if match := entry.pattern.fullmatch(source):
            return entry, match
    allowed = "; ".join(entry.form for entry in SOURCES.values())
    raise ValueError(f"unknown calibration source {source!r}; allowed: {allowed}")


def load_source(source: str, data_dir: Path | str | None = None) -> SourceText:
    """The documents of a source named as in a spec: ``wikitext2``, ``tinystories[0:500]``, ``file:PATH``."""
    entry, match = _match_source(source)
    return entry.load(match, data_dir)


_SPEC = re.compile(r"(?P<source>.+?)(?::(?P<n>\d+)x(?P<seqlen>\d+))?(?::seed=(?P<seed>\d+))?(?P<bos>:bos)?")


def parse_calib(text: str) -> CalibSpec:
    """``SOURCE[:NxSEQLEN][:seed=S][:bos]`` → CalibSpec; omitted parts take the defaults (128 × 128, seed 0)."""
    match = _SPEC.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"empty calibration spec {text!r}; expected {SPEC_FORM}")

    def number(name: str, default: int) -> int:
        return int(match[name]) if match[name] is not None else default

    try:
        return CalibSpec(match["source"], number("n", DEFAULT_N_SAMPLES), number("seqlen", DEFAULT_SEQLEN),
                         number("seed", DEFAULT_SEED), bos=match["bos"] is not None)
    except ValueError as err:
        raise ValueError(f"bad calibration spec {text!r}: {err}; expected {SPEC_FORM}") from None


# ------------------------------------------------------------------------------------ tokens and windows

_DOCUMENT_TOKENS: dict[tuple, tuple[Tensor, ...]] = {}
_WINDOWS: dict[tuple, Tensor] = {}


def clear_cache() -> None:
    """Forget every cached token stream and window tensor."""
    _DOCUMENT_TOKENS.clear()
    _WINDOWS.clear()


def tokenizer_fingerprint(tokenizer) -> tuple[str, str]:
    """(name_or_path, sha256 of the vocabulary and of the ids of a probe text: it changes with BOS/EOS settings)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    probe = json.dumps(tokenizer(_PROBE)["input_ids"])
    return tokenizer.name_or_path, hashlib.sha256((vocab + probe).encode()).hexdigest()


def _stream_key(source: SourceText, tokenizer) -> tuple:
    return (tokenizer_fingerprint(tokenizer), source.source, source.split, source.sha256)


def _tokenize(key: tuple, source: SourceText, tokenizer) -> tuple[Tensor, ...]:
    if key not in _DOCUMENT_TOKENS:
        ids = tokenizer(list(source.documents), verbose=False)["input_ids"]
        _DOCUMENT_TOKENS[key] = tuple(torch.tensor(doc, dtype=torch.long) for doc in ids)
    return _DOCUMENT_TOKENS[key]


def tokenize_documents(source: SourceText, tokenizer) -> tuple[Tensor, ...]:
    """Each document's token ids, special tokens included (cached; treat the tensors as read-only)."""
    return _tokenize(_stream_key(source, tokenizer), source, tokenizer)


def token_stream(source: SourceText, tokenizer) -> Tensor:
    """The source's documents tokenized and concatenated into one stream of ids."""
    return torch.cat(tokenize_documents(source, tokenizer))


def added_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before every text it encodes (Llama, Gemma), or None (GPT-2, SmolLM)."""
    ids = tokenizer(_PROBE)["input_ids"]
    bos = tokenizer.bos_token_id
    return bos if bos is not None and ids[:1] == [bos] else None


def sample_windows(ids: Tensor, n_samples: int, seqlen: int, seed: int) -> Tensor:
    """``n_samples`` windows ``ids[i:i+seqlen]``, ``i = randint(0, len(ids) - seqlen - 1)`` after seeding with ``seed``.

    A private ``random.Random(seed)`` draws the same offsets as the reference's ``random.seed(seed)``.
    """
    if len(ids) < seqlen + 1:
        raise ValueError(f"calibration seqlen {seqlen} needs a token stream of at least {seqlen + 1} tokens but the "
                         f"source gives {len(ids)}; allowed: a seqlen of at most {len(ids) - 1} or a longer source")
    rng = random.Random(seed)
    starts = [rng.randint(0, len(ids) - seqlen - 1) for _ in range(n_samples)]
    return torch.stack([ids[i : i + seqlen] for i in starts])


def with_bos(windows: Tensor, bos: int) -> Tensor:
    """``windows`` (n, T) with the token ``bos`` put before each: (n, T + 1)."""
    return torch.cat([torch.full((len(windows), 1), bos, dtype=windows.dtype), windows], dim=1)


def calibration_data(spec: CalibSpec | str, tokenizer, *, data_dir: Path | str | None = None,
                     max_positions: int | None = None) -> CalibData:
    """Calibration windows for ``spec`` (a CalibSpec or a spec string), checked against the model's context.

    ``max_positions`` is the model's ``config.max_position_embeddings``: a longer seqlen is an error.
    """
    spec = parse_calib(spec) if isinstance(spec, str) else spec
    if max_positions is not None and spec.seqlen > max_positions:
        raise ValueError(f"calibration seqlen {spec.seqlen} exceeds the model's max_position_embeddings "
                         f"{max_positions}; use a seqlen of at most {max_positions}")
    source = load_source(spec.source, data_dir)
    key = _stream_key(source, tokenizer)
    stream = torch.cat(_tokenize(key, source, tokenizer))
    bos = added_bos(tokenizer) if spec.bos else None
    window_key = (key, spec.n_samples, spec.seqlen, spec.seed, bos)
    if window_key not in _WINDOWS:
        _WINDOWS[window_key] = (sample_windows(stream, spec.n_samples, spec.seqlen, spec.seed) if bos is None
                                else with_bos(sample_windows(stream, spec.n_samples, spec.seqlen - 1, spec.seed), bos))
    provenance = Provenance(spec.source, source.split, source.origin, source.sha256, len(stream),
                            spec.n_samples, spec.seqlen, spec.seed, bos=bos is not None)
    return CalibData(_WINDOWS[window_key].clone(), provenance)


def holdout_windows(spec: CalibSpec | str, tokenizer, n_windows: int, *, data_dir: Path | str | None = None,
                    asked: str | None = None) -> Tensor:
    """``n_windows`` windows of ``spec``'s source that share no token position with any calibration window.

    The offsets continue the calibration's random stream (``random.Random(seed)`` after its ``n_samples``
    draws), rejecting every window that overlaps a calibration window; held-out windows may overlap each
    other, as calibration windows do. More than :func:`holdout_capacity` of them is refused up front (they would
    only repeat tokens), and so is a stream too short to find them. With ``spec.bos`` (and a tokenizer that adds a
    BOS) each window is BOS and ``seqlen`` − 1 stream tokens, as the calibration windows are. ``asked`` says who
    asks for them in the refusal (default: ``holdout=<n_windows>``).
    """
    if n_windows < 1:
        raise ValueError(f"held-out windows: n_windows={n_windows} must be at least 1")
    spec = parse_calib(spec) if isinstance(spec, str) else spec
    stream = token_stream(load_source(spec.source, data_dir), tokenizer)
    bos = added_bos(tokenizer) if spec.bos else None
    length = spec.seqlen - (bos is not None)  # stream tokens per window
    last = len(stream) - length - 1
    rng = random.Random(spec.seed)
    calib = [rng.randint(0, last) for _ in range(spec.n_samples)]
    capacity = holdout_capacity(calib, last + length, length)
    if n_windows > capacity:
        limit = f"holdout <= {capacity}" if asked is None else f"at most {capacity:,} held-out windows in all"
        raise ValueError(f"{asked or f'holdout={n_windows}'} asks for more held-out windows than {spec} can give: "
                         f"{capacity:,} disjoint windows of {length} tokens fit outside its calibration windows; "
                         f"allowed: {limit}, or fewer calibration windows or a longer source")
    starts: list[int] = []
    for _ in range(1000 * n_windows):
        start = rng.randint(0, last)
        if all(abs(start - c) >= length for c in calib):
            starts.append(start)
        if len(starts) == n_windows:
            windows = torch.stack([stream[i : i + length] for i in starts])
            return windows if bos is None else with_bos(windows, bos)
    raise ValueError(f"found only {len(starts)} of {n_windows} held-out windows disjoint from the {spec} calibration "
                     "windows; use fewer held-out or calibration windows or a longer source")


def holdout_capacity(calib_starts: list[int], n_positions: int, seqlen: int) -> int:
    """How many pairwise-disjoint ``seqlen``-token windows fit in the ``n_positions`` stream positions outside the
    calibration windows [c, c + seqlen): Σ over the uncovered runs of ⌊run length / seqlen⌋. More held-out windows
    than that would only repeat tokens, so ``holdout_windows`` refuses them (a difference array marks the cover)."""
    cover = torch.zeros(n_positions + 1, dtype=torch.long)
    for c in calib_starts:
        cover[c] += 1
        cover[min(c + seqlen, n_positions)] -= 1
    free = torch.cat([cover.cumsum(0)[:n_positions] == 0, torch.tensor([False])])
    edges = torch.diff(free.long(), prepend=torch.tensor([0])).nonzero().flatten()  # run starts, run ends alternate
    runs = edges[1::2] - edges[0::2]
    return int((runs // seqlen).sum())
