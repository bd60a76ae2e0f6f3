"""Perplexity under named evaluation profiles (docs/methods.md §6); the profile is recorded with every result.

A profile turns a dataset into independent token sequences. A sequence x_1..x_T is scored on its
T − 1 shifted targets, with no context carried between sequences, and over all sequences

    ppl = exp( Σ_seq Σ_{t=2..T} −log p(x_t | x_<t)  /  Σ_seq (T − 1) ).

In the windowed profiles every sequence has the same length, so this equals the official code's
exp(mean over windows of each window's mean NLL).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rcpu_bench import console, corpora, data
from rcpu_bench.finite import check_logits, finite_logits
from rcpu_bench.model.adapter import head_view

IGNORE_INDEX = -100
WINDOW_DECIMALS = 4  # of a window's NLL sum in the record: far below any difference a bootstrap can resolve
# float32 logits held at once when the LM head is applied chunk by chunk: what scoring a batch costs beyond the
# model and its hidden states, whatever the vocabulary (151,936-way logits of a 16 x 128 batch would be 1.2 GB).
LOGITS_BYTES = 1 << 26


@dataclass(frozen=True)
class Profile:
    """A perplexity protocol. ``seqlen`` is capped by the model's ``max_position_embeddings``."""

    name: str
    dataset: str
    seqlen: int
    description: str
    stories: tuple[int, int] | None = None
    windows: tuple[int, int] | None = None  # windows START..STOP−1 only (NAME[START:STOP]); None: every window
    step: int = 1  # with windows: every STEP-th of them (NAME[START:STOP:STEP]), a sample spread over the text


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("rcpu128", "wikitext2-test", 128,
            'WikiText-2-raw test, "\\n\\n".join, tokenized once, non-overlapping 128-token windows, remainder '
            "dropped (RCPU / FLAP / LLM-Pruner); rcpu128[START:STOP] scores windows START..STOP-1 only"),
    Profile("rcpu128-bos", "wikitext2-test-bos", 128,
            "as rcpu128, each 128-token window preceded by the tokenizer's BOS (not scored) when its tokenizer adds "
            "one to every text, so all 128 window tokens are scored; models trained always to see BOS first (Gemma) "
            "are far off their distribution without it. With a tokenizer that adds no BOS it equals rcpu128"),
    Profile("std2048", "wikitext2-test", 2048,
            "as rcpu128 with 2048-token windows, or max_position_embeddings if smaller (SparseGPT / Wanda / SliceGPT)"),
    Profile("cpython128", "cpython-test", 128,
            "Python code: the CPython 3.11 standard library's modules n-z (disjoint from the cpython calibration "
            "source, a-m), tokenized once, non-overlapping 128-token windows; cpython128[START:STOP:STEP] scores "
            "every STEP-th window from START to STOP-1, a sample spread over the modules"),
    Profile("tinystories", "tinystories", 512,
            "TinyStories validation stories, each its own sequence: BOS + story, truncated to 512 tokens; "
            "tinystories[START:STOP] selects stories by idx (e.g. [500:1000], held out from calibration)",
            stories=(0, 1000)),
)}

_RANGED = re.compile(r"(?P<name>[\w-]+)\[(?P<start>\d+):(?P<stop>\d+)(?::(?P<step>\d+))?\]")


def get_profile(name: str) -> Profile:
    """The registered profile ``name``, or ``name[START:STOP]``: stories START..STOP−1 of a story profile,
    windows START..STOP−1 of a windowed one (a cheaper, recorded subset of the protocol); ``name[START:STOP:STEP]``:
    every STEP-th of those windows."""
    match = _RANGED.fullmatch(name)
    base = PROFILES.get(match["name"] if match else name)
    if base is None:
        raise ValueError(f"unknown perplexity profile {name!r}; allowed: {', '.join(PROFILES)}, "
                         "PROFILE[START:STOP], PROFILE[START:STOP:STEP] (windowed profiles)")
    if match is None:
        return base
    start, stop = int(match["start"]), int(match["stop"])
    if stop <= start:
        raise ValueError(f"perplexity profile {name!r}: the range [START:STOP] needs STOP > START")
    if base.stories is None:
        step = int(match["step"] or 1)
        if step < 1:
            raise ValueError(f"perplexity profile {name!r}: the step of [START:STOP:STEP] must be at least 1")
        return replace(base, name=name, windows=(start, stop), step=step)
    if match["step"] is not None:
        raise ValueError(f"perplexity profile {name!r}: a story profile takes [START:STOP] without a step")
    return replace(base, name=name, stories=(start, stop))


def profile_source(name: str, data_dir: Path | str | None = None) -> corpora.SourceText:
    """The text a profile evaluates on (raises a clear error when its data file is missing)."""
    profile = get_profile(name)
    if profile.dataset == "tinystories":
        return corpora.tinystories_text(data_dir, profile.stories)
    if profile.dataset == "cpython-test":
        return corpora.cpython_text(data_dir, "test")
    return corpora.wikitext2_text(data_dir, "test")


def _stream_windows(source: corpora.SourceText, tokenizer, seqlen: int) -> list[Tensor]:
    """The test stream (one BOS at its start) cut into ⌊N / seqlen⌋ non-overlapping windows."""
    stream = data.token_stream(source, tokenizer)
    n_windows = len(stream) // seqlen
    return list(stream[: n_windows * seqlen].view(n_windows, seqlen))


def _bos_windows(source: corpora.SourceText, tokenizer, seqlen: int) -> list[Tensor]:
    """The rcpu128 windows, each preceded by BOS when the tokenizer adds one (the stream's own leading BOS is not
    part of a window then); else the rcpu128 windows themselves."""
    bos = data.added_bos(tokenizer)
    if bos is None:
        return _stream_windows(source, tokenizer, seqlen)
    stream = data.token_stream(source, tokenizer)[1:]  # the stream starts with the tokenizer's BOS
    n_windows = len(stream) // seqlen
    return list(data.with_bos(stream[: n_windows * seqlen].view(n_windows, seqlen), bos))


def _story_sequences(source: corpora.SourceText, tokenizer, seqlen: int) -> list[Tensor]:
    """One sequence per story: BOS + story tokens, truncated to seqlen."""
    return [ids[:seqlen] for ids in data.tokenize_documents(source, tokenizer)]


_DATASETS: dict[str, Callable[[corpora.SourceText, object, int], list[Tensor]]] = {
    "wikitext2-test": _stream_windows,
    "wikitext2-test-bos": _bos_windows,
    "cpython-test": _stream_windows,
    "tinystories": _story_sequences,
}


def _pad(batch: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad to the longest sequence: (input ids, attention mask). Right padding keeps positions 0..T−1."""
    longest = max(len(ids) for ids in batch)
    input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    return input_ids, mask


def _shifted_labels(input_ids: Tensor, mask: Tensor) -> Tensor:
    """labels[t] = x_{t+1}; the last position and targets that are padding are ignored."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return labels


def profile_sequences(profile: str, tokenizer, seqlen: int, data_dir: Path | str | None = None) -> list[Tensor]:
    """The token sequences ``profile`` scores (its window or story range), cut at ``seqlen`` tokens."""
    chosen = get_profile(profile)
    source = profile_source(profile, data_dir)
    sequences = _DATASETS[chosen.dataset](source, tokenizer, seqlen)
    if chosen.windows is not None:
        start, stop = chosen.windows
        if stop > len(sequences):
            raise ValueError(f"profile {chosen.name!r}: {source.origin} gives only {len(sequences)} windows of "
                             f"{seqlen} tokens; STOP must be at most {len(sequences)}")
        sequences = sequences[start:stop:chosen.step]
    if not sequences:
        raise ValueError(f"profile {chosen.name!r}: {source.origin} gives no sequence of {seqlen} tokens")
    return sequences


def token_nlls(model: nn.Module, input_ids: Tensor, mask: Tensor, labels: Tensor, *,
               what: str = "perplexity") -> Tensor:
    """−log p(labels[b, t] | input_ids[b, ≤t]) per position (batch, tokens), 0 where the label is ignored.

    For a model of a known family the decoder runs once and the LM head (with what the family applies to it) only
    on the positions with a target, ``LOGITS_BYTES`` of logits at a time; any other model is scored on its full
    logits. Both give the same numbers. Non-finite logits raise ``NonFiniteError`` (``what`` names the
    evaluation)."""
    view = head_view(model)
    if view is None:
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(labels.shape)
    hidden = view.hidden_states(input_ids, mask).flatten(0, 1)  # (B·T, d)
    targets = labels.flatten()
    scored = (targets != IGNORE_INDEX).nonzero().flatten()
    nll = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    chunk = max(1, LOGITS_BYTES // (4 * view.lm_head.out_features))
    for rows in scored.split(chunk):
        logits = view.logits(hidden[rows]).float()  # (chunk, vocab)
        check_logits(model, logits, what)
        nll[rows] = F.cross_entropy(logits, targets[rows], reduction="none")
    return nll.view(labels.shape)


def sequence_nlls(model: nn.Module, sequences: list[Tensor], *, batch_size: int = 8,
                  desc: str = "perplexity") -> list[float]:
    """Per sequence, in the order given: Σ_t −log p(x_t | x_<t) over its shifted targets, summed in float64.

    Sequences are scored longest first (less padding) in batches of ``batch_size``, right-padded, with
    padding masked out of attention and ignored as targets, so the result does not depend on the batch size.
    Non-finite logits raise ``NonFiniteError`` (naming a non-finite weight when there is one).
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    device = model.device
    sums = torch.zeros(len(sequences), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), finite_logits(model, desc):
            for start in console.progress(range(0, len(order), batch_size), desc=desc, unit="batch"):
                rows = order[start : start + batch_size]
                input_ids, mask = _pad([sequences[i] for i in rows])
                labels = _shifted_labels(input_ids, mask).to(device)
                nll = token_nlls(model, input_ids.to(device), mask.to(device), labels, what=desc)  # (B, T)
                sums[rows] = nll.sum(1, dtype=torch.float64).cpu()
    finally:
        model.train(was_training)
    return sums.tolist()


def sequence_nll(model: nn.Module, sequences: list[Tensor], *, batch_size: int = 8,
                 desc: str = "perplexity") -> tuple[float, int]:
    """(Σ −log p(x_t | x_<t) over every sequence's shifted targets, number of targets): :func:`sequence_nlls`
    summed."""
    nlls = sequence_nlls(model, sequences, batch_size=batch_size, desc=desc)
    return math.fsum(nlls), sum(max(len(ids) - 1, 0) for ids in sequences)


def perplexity(model: nn.Module, tokenizer, profile: str = "rcpu128", *, batch_size: int = 8,
               data_dir: Path | str | None = None, max_windows: int | None = None) -> dict[str, Any]:
    """Perplexity of ``model`` under ``profile`` (see PROFILES), with the protocol recorded in the result.

    ``max_windows`` scores only the first that many windows (or stories). The result holds the profile,
    dataset, seqlen used, number of windows, predicted tokens, ppl = exp(nll_mean), the dataset file's
    sha256, the batch size, and per window its NLL sum and target count (``window_nll``, ``window_targets``).
    """
    chosen = get_profile(profile)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1 or None, got {max_windows}")
    seqlen = min(chosen.seqlen, model.config.max_position_embeddings)
    source = profile_source(profile, data_dir)
    sequences = profile_sequences(profile, tokenizer, seqlen, data_dir)[:max_windows]
    nlls = sequence_nlls(model, sequences, batch_size=batch_size, desc=f"ppl {chosen.name}")
    targets = [len(ids) - 1 for ids in sequences]
    nll_mean = math.fsum(nlls) / sum(targets)
    return {"profile": chosen.name, "dataset": f"{source.source}/{source.split}", "seqlen": seqlen,
            "n_windows": len(sequences), "n_tokens": sum(targets), "ppl": math.exp(nll_mean), "nll_mean": nll_mean,
            "dataset_sha256": source.sha256, "batch_size": batch_size,
            # per window (story), in the profile's order: what a paired bootstrap of two runs resamples
            "window_nll": [round(nll, WINDOW_DECIMALS) for nll in nlls], "window_targets": targets}
