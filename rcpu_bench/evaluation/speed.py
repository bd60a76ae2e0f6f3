"""Inference speed of a model: tokens per second of the prefill and of decoding with the KV cache.

Measured on random token ids (speed does not depend on them), so no data or tokenizer is needed and
the caller's random state is untouched. Reported beside the model's size in every experiment record
(``Record.inference``, at batch size :data:`BATCH_SIZE`): the dense cell of a matrix gives the dense figure, so
a pruned model's speed-up is the ratio of two records measured the same way. ``rcpu-bench speed``
(:mod:`rcpu_bench.commands.speed`) measures saved or hub models.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

import torch

BATCH_SIZE = 1
PROMPT_TOKENS = 128
NEW_TOKENS = 32
REPEATS = 3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_argument(model: Any) -> str:
    """The forward argument (and output field) carrying the key/value cache: ``cache`` from transformers 5.24,
    ``past_key_values`` before (deprecated since)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _timed(device: torch.device, step: Any) -> tuple[Any, float]:
    """``step()``'s result and its wall-clock seconds, the device synchronized before and after."""
    _synchronize(device)
    started = time.perf_counter()
    result = step()
    _synchronize(device)
    return result, time.perf_counter() - started


def prefill_and_decode(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Seconds of one prefill (a forward pass over ``ids`` filling the KV cache) and of ``new_tokens``
    decode steps (each a forward pass of the previous step's greedy token per sequence, on the cache)."""
    device = ids.device

    name = cache_argument(model)

    def decode(output: Any) -> None:
        cache = output[name]
        for _ in range(new_tokens):
            token = output.logits[:, -1:].argmax(dim=-1)
            output = model(token, **{name: cache}, use_cache=True)
            cache = output[name]

    with torch.no_grad():
        output, prefill = _timed(device, lambda: model(ids, use_cache=True))
        _, decoding = _timed(device, lambda: decode(output))
    return prefill, decoding


MAX_BATCH_TOKENS = 1 << 21  # tokens of one timed batch, at most: a bound far above any speed test, below a runaway


def check_counts(**counts: int) -> None:
    """ValueError naming the first of ``counts`` (batch_size, prompt_tokens, ...) that is not a positive integer, or
    a batch of more than ``MAX_BATCH_TOKENS`` tokens (batch_size · (prompt_tokens + new_tokens))."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    batch, tokens = counts.get("batch_size", 1), counts.get("prompt_tokens", 0) + counts.get("new_tokens", 0)
    if batch * tokens > MAX_BATCH_TOKENS:
        raise ValueError(f"batch_size={batch} × (prompt_tokens + new_tokens = {tokens}) is {batch * tokens:,} tokens "
                         f"in one batch; allowed: at most {MAX_BATCH_TOKENS:,}")


def rates(runs: list[tuple[float, float]], *, batch_size: int, prompt_tokens: int,
          new_tokens: int) -> tuple[float, float]:
    """(prefill, decode) tokens/s from (prefill seconds, decode seconds) runs: batch_size · prompt_tokens /
    median t_prefill and batch_size · new_tokens / median t_decode."""
    prefill = statistics.median(run[0] for run in runs)
    decode = statistics.median(run[1] for run in runs)
    return batch_size * prompt_tokens / prefill, batch_size * new_tokens / decode


def inference_speed(model: Any, *, batch_size: int = BATCH_SIZE, prompt_tokens: int = PROMPT_TOKENS,
                    new_tokens: int = NEW_TOKENS, repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Prefill and decode throughput of ``model`` on its device, after an untimed warm-up (a prefill and one step).

    prefill_tokens_per_s = batch_size · prompt_tokens / t_prefill, decode_tokens_per_s = batch_size ·
    new_tokens / t_decode, each t the median over ``repeats`` runs of a (batch_size × prompt_tokens)
    prompt of random ids followed by ``new_tokens`` greedy decode steps with the KV cache
    (``prefill_and_decode``). Returns exactly batch_size, prompt_tokens, new_tokens,
    prefill_tokens_per_s, decode_tokens_per_s, device and repeats.
    """
    check_counts(batch_size=batch_size, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    limit = model.config.max_position_embeddings
    if prompt_tokens + new_tokens > limit:
        raise ValueError(f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the model's "
                         f"max_position_embeddings {limit}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (batch_size, prompt_tokens), generator=generator).to(device)
    prefill_and_decode(model, ids, 1)  # warm-up of both kinds of step (kernels, allocator, lazy initialisation)
    runs = [prefill_and_decode(model, ids, new_tokens) for _ in range(repeats)]
    prefill, decode = rates(runs, batch_size=batch_size, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    return {"batch_size": batch_size, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "device": str(device), "repeats": repeats}
