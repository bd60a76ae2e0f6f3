"""Greedy text continuations of a model, to read its text before and after pruning side by side.

``rcpu-bench generate`` (:mod:`rcpu_bench.commands.generate`) prints them for a saved pruned directory (or any
checkpoint) and, with ``--compare``, for a second model (the dense one) under each prompt; every experiment
record keeps one short continuation of a fixed prompt (``Record.sample``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

SAMPLE_PROMPT = "Once upon a time"
SAMPLE_TOKENS = 24


def greedy_continuation(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 32) -> str:
    """The greedy continuation of ``prompt``: at each step the argmax token, up to ``max_new_tokens``
    new tokens or the end-of-sequence token; the decoded new tokens only (special tokens skipped)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    encoded = tokenizer(prompt, return_tensors="pt").to(model.device)
    eos = model.config.eos_token_id
    # max_length rather than max_new_tokens: the checkpoint's own max_length would clash with the latter.
    config = GenerationConfig(max_length=encoded.input_ids.shape[1] + max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    with torch.no_grad():
        output = model.generate(**encoded, generation_config=config)
    # Decoded whole, then the prompt's text cut off: decoding the new tokens alone drops a leading space.
    whole, start = (tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    for ids in (output[0], encoded.input_ids[0]))
    return whole[len(start):]


def text_sample(model: Any, tokenizer: Any) -> dict[str, str]:
    """A record's text sample: the greedy continuation of ``SAMPLE_PROMPT`` by ``SAMPLE_TOKENS`` tokens."""
    return {"prompt": SAMPLE_PROMPT, "text": greedy_continuation(model, tokenizer, SAMPLE_PROMPT, SAMPLE_TOKENS)}
