"""The tokenizer of a model as llama.cpp's GGUF vocabulary: token texts, scores or merges, types and special ids.

Two kinds of Hugging Face tokenizers are written, each as the llama.cpp tokenizer that splits and merges a text
the same way:

- sentencepiece-style (a byte-fallback BPE with a ``Metaspace`` pre-tokenizer: Llama 1/2, the stories fixtures) as
  llama.cpp's ``llama`` tokenizer (its sentencepiece-BPE port). That one starts from the UTF-8 characters of the
  text (with ``▁`` for spaces and a leading ``▁`` when ``add_space_prefix``) and repeatedly merges the adjacent
  pair whose concatenation is a token of highest *score*; unknown characters fall back to ``<0xXX>`` byte tokens.
  The Hugging Face tokenizer instead merges the pair of lowest *rank* in its merge list, a list the converter
  ordered by the sentencepiece scores. So the score written for a token is minus the rank of the first merge
  producing it (0 for the tokens no merge produces), which makes both tokenizers merge in the same order.
- byte-level BPE with GPT-2's own split (a ``ByteLevel`` pre-tokenizer applying its regex, no normalizer, no other
  pre-tokenizer: GPT-2, SmolLM) as llama.cpp's ``gpt2`` tokenizer with the ``gpt-2`` pre-tokenizer, which splits
  with the same regex; tokens are written in their byte-level form with the merge list itself.
- byte-level BPE whose split is a known regex of llama.cpp's (a ``Split`` on that regex, then ``ByteLevel`` without
  its own regex: Qwen2 / Qwen2.5's ``qwen2``) as the ``gpt2`` tokenizer with that pre-tokenizer name
  (``SPLIT_PRE_TOKENIZERS``). Their NFC normalizer is left out, as llama.cpp's own converter leaves it out: a text
  already in NFC (ASCII and code always are) is tokenized alike, a decomposed one differently.

Other tokenizers (other split regexes as in Llama 3, WordPiece, Unigram, ...) are refused: llama.cpp reads them
through pre-tokenizer names whose splits this exporter does not check.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# gguf.TokenType's values (the GGUF format's token types), named here so this module needs no gguf import.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Split regexes of byte-level BPE tokenizers and the name under which llama.cpp applies the same split.
SPLIT_PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
}


@dataclass(frozen=True)
class Vocab:
    """A GGUF tokenizer (``model`` ``llama`` or ``gpt2``): token i is ``tokens[i]`` of type ``types[i]``, with
    ``scores[i]`` (``llama``); ``gpt2`` carries its ``merges`` ("a b") and its pre-tokenizer name ``pre``."""

    model: str
    tokens: list[str]
    scores: list[float] | None
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    merges: list[str] | None = None
    pre: str | None = None


def tokenizer_spec(tokenizer: Any) -> dict:
    """The tokenizers-library JSON of a Hugging Face fast tokenizer (what ``tokenizer.json`` holds)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no tokenizers backend (tokenizer.json); "
                         "GGUF export reads the vocabulary and merges from it")
    return json.loads(backend.to_str())


def sentencepiece_problem(spec: dict) -> str | None:
    """Why ``spec`` is not a sentencepiece-style tokenizer (byte-fallback BPE + Metaspace), or None."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return f"model {model.get('type')!r} (byte_fallback={model.get('byte_fallback')!r}), not a byte-fallback BPE"
    if pre.get("type") != "Metaspace":
        return f"pre-tokenizer {pre.get('type')!r}, not Metaspace"
    if spec.get("normalizer") is not None:
        return f"normalizer {spec['normalizer'].get('type')!r} (llama.cpp's llama tokenizer applies none)"
    return None


def byte_level_problem(spec: dict) -> str | None:
    """Why ``spec`` is not a byte-level BPE splitting as one of llama.cpp's pre-tokenizers does, or None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return f"model {model.get('type')!r} (byte_fallback={model.get('byte_fallback')!r}), not a byte-level BPE"
    if byte_level_pre(spec.get("pre_tokenizer") or {}) is None:
        known = ", ".join(["a ByteLevel split with GPT-2's regex", *(f"{name}'s split regex"
                                                                    for name in SPLIT_PRE_TOKENIZERS.values())])
        return f"pre-tokenizer {spec.get('pre_tokenizer')}, none of the splits llama.cpp applies ({known})"
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer is not None and not (normalizer == "NFC" and byte_level_pre(spec["pre_tokenizer"]) != "gpt-2"):
        return f"normalizer {normalizer!r} (llama.cpp's gpt2 tokenizer applies none)"
    return None


def byte_level_pre(pre: dict) -> str | None:
    """llama.cpp's pre-tokenizer name for a byte-level BPE's pre-tokenizer (no prefix space added): ``gpt-2`` for a
    ``ByteLevel`` applying GPT-2's regex, the ``SPLIT_PRE_TOKENIZERS`` name for a ``Split`` on a known regex
    (isolating its matches) followed by a ``ByteLevel`` without a regex of its own; else None."""
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    return SPLIT_PRE_TOKENIZERS.get(regex)


def merge_scores(merges: list) -> dict[str, float]:
    """Score of each merged token: minus the rank of the first merge that produces it (merges as "a b" or [a, b])."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores.setdefault(left + right, -float(rank))
    return scores


def _special_flags(tokenizer: Any) -> tuple[bool, bool]:
    """Whether the tokenizer adds BOS / EOS to an encoded text, as it behaves (transformers 5 misreports the
    ``add_bos_token`` attribute of converted Llama tokenizers)."""
    ids = tokenizer("a")["input_ids"]
    return (tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id],
            tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id])


def gguf_vocab(tokenizer: Any, n_vocab: int) -> Vocab:
    """The GGUF vocabulary of ``tokenizer`` padded to the model's ``n_vocab`` embedding rows (module docstring).

    Rows past the tokenizer's vocabulary become ``[PAD<i>]`` tokens of type UNUSED (as llama.cpp's
    converter writes them); a tokenizer larger than the embeddings is a ValueError.
    """
    spec = tokenizer_spec(tokenizer)
    problems = {"llama": sentencepiece_problem(spec), "gpt2": byte_level_problem(spec)}
    kind = next((name for name, problem in problems.items() if problem is None), None)
    if kind is None:
        raise ValueError("GGUF export handles sentencepiece-style tokenizers (byte-fallback BPE with a Metaspace "
                         "pre-tokenizer, as Llama 1/2) and byte-level BPE with GPT-2's or Qwen2's split (GPT-2, "
                         f"SmolLM, Qwen2.5); this tokenizer has {problems['llama']}, and {problems['gpt2']}")
    pieces = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    if max(pieces.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(pieces.values())} but the model only {n_vocab} "
                         "embedding rows")
    by_id = {i: piece for piece, i in pieces.items()}
    merges = spec["model"].get("merges", [])
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    types = [_token_type(i, by_id.get(i), added.get(i), tokenizer.unk_token_id, kind) for i in range(n_vocab)]
    add_bos, add_eos = _special_flags(tokenizer)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    if kind == "gpt2":
        return Vocab("gpt2", tokens, None, types, *ids, add_bos, add_eos, add_space_prefix=False,
                     merges=[merge if isinstance(merge, str) else " ".join(merge) for merge in merges],
                     pre=byte_level_pre(spec["pre_tokenizer"]))
    scores = merge_scores(merges)
    prepend = spec["pre_tokenizer"].get("prepend_scheme", "always" if spec["pre_tokenizer"].get("add_prefix_space",
                                                                                              True) else "never")
    return Vocab("llama", tokens, [scores.get(token, 0.0) for token in tokens], types, *ids, add_bos, add_eos,
                 add_space_prefix=prepend != "never")


def _token_type(i: int, piece: str | None, added: dict | None, unk_id: int | None, kind: str) -> int:
    """The GGUF type of token ``i``: padding UNUSED, the unknown token UNKNOWN, special added tokens CONTROL, other
    added tokens USER_DEFINED (``gpt2``), ``<0xXX>`` byte tokens BYTE (``llama``), the rest NORMAL."""
    if piece is None:
        return UNUSED
    if i == unk_id:
        return UNKNOWN
    if added is not None:
        return CONTROL if added.get("special") else USER_DEFINED if kind == "gpt2" else NORMAL
    return BYTE if kind == "llama" and _BYTE_TOKEN.fullmatch(piece) else NORMAL
