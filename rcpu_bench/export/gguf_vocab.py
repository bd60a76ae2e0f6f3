"""The tokenizer of a model as llama.cpp's GGUF vocabulary: token texts, scores, types and special ids.

llama.cpp's ``llama`` tokenizer (its sentencepiece-BPE port) starts from the UTF-8 characters of the text
(with ``▁`` for spaces and a leading ``▁`` when ``add_space_prefix``) and repeatedly merges the adjacent
pair whose concatenation is a token of highest *score*; unknown characters fall back to ``<0xXX>`` byte
tokens. A Hugging Face tokenizer converted from sentencepiece (a byte-fallback BPE with a ``Metaspace``
pre-tokenizer, what Llama 1/2 and the stories fixtures use) instead merges the pair of lowest *rank* in its
merge list, a list the converter ordered by the sentencepiece scores. So the score written for a token is
minus the rank of the first merge producing it (0 for the tokens no merge produces), which makes both
tokenizers merge in the same order. Other tokenizers (byte-level GPT-2 BPE as in Llama 3, WordPiece, ...) are
refused: llama.cpp reads them through pre-tokenizer names this exporter does not write.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# gguf.TokenType's values (the GGUF format's token types), named here so this module needs no gguf import.
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class Vocab:
    """A GGUF ``llama`` tokenizer: token i is ``tokens[i]`` with ``scores[i]`` and ``types[i]``."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


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
    """The GGUF vocabulary of ``tokenizer`` padded to the model's ``n_vocab`` embedding rows.

    Rows past the tokenizer's vocabulary become ``[PAD<i>]`` tokens of type UNUSED (as llama.cpp's
    converter writes them); a tokenizer larger than the embeddings is a ValueError.
    """
    spec = tokenizer_spec(tokenizer)
    problem = sentencepiece_problem(spec)
    if problem:
        raise ValueError(f"GGUF export handles sentencepiece-style tokenizers (byte-fallback BPE with a Metaspace "
                         f"pre-tokenizer, as Llama 1/2); this tokenizer has {problem}")
    pieces = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    if max(pieces.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(pieces.values())} but the model only {n_vocab} "
                         "embedding rows")
    by_id = {i: piece for piece, i in pieces.items()}
    scores = merge_scores(spec["model"].get("merges", []))
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    unk_id = tokenizer.unk_token_id
    tokens, token_scores, types = [], [], []
    for i in range(n_vocab):
        piece = by_id.get(i)
        if piece is None:
            tokens.append(f"[PAD{i}]")
            token_scores.append(0.0)
            types.append(UNUSED)
            continue
        tokens.append(piece)
        token_scores.append(scores.get(piece, 0.0))
        types.append(UNKNOWN if i == unk_id else CONTROL if i in special
                     else BYTE if _BYTE_TOKEN.fullmatch(piece) else NORMAL)
    add_bos, add_eos = _special_flags(tokenizer)
    prepend = spec["pre_tokenizer"].get("prepend_scheme", "always" if spec["pre_tokenizer"].get("add_prefix_space",
                                                                                              True) else "never")
    return Vocab(tokens, token_scores, types, tokenizer.bos_token_id, tokenizer.eos_token_id, unk_id, add_bos, add_eos,
                 add_space_prefix=prepend != "never")
