"""lm-eval's ``HFLM`` around an in-memory model, with the memory of its log-likelihood batches bounded.

lm-eval scores a batch of B requests padded to L tokens on the full vocabulary: the logits and their log-softmax are
two float32 tensors of B·L·V values (SmolLM2's 49,152 tokens: 1.2 GB each for 16 BoolQ passages of 400 tokens;
Qwen2.5's 151,936: 3.9 GB). ``BoundedHFLM`` hands lm-eval its requests in parts, each with the largest batch size,
at most the one asked, whose logits fit ``LOGITS_BYTES`` at the part's longest request, so that memory no longer
grows with B·V. Each request is scored as lm-eval scores it (right-padded, its own rows of the logits); only which
requests share a batch differs from a plain ``HFLM``.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

from lm_eval.models.huggingface import HFLM

LOGITS_BYTES = 1 << 28  # float32 logits of one batch: with their log-softmax, 512 MiB


def rows_within(length: int, vocab: int, batch_size: int, budget: int | None = None) -> int:
    """Rows of ``length`` padded tokens whose float32 logits over ``vocab`` fit ``budget`` (default
    ``LOGITS_BYTES``): at least 1, at most ``batch_size``."""
    return max(1, min(batch_size, (LOGITS_BYTES if budget is None else budget) // (4 * length * vocab)))


class BoundedHFLM(HFLM):
    """``HFLM`` whose log-likelihood batches hold at most ``LOGITS_BYTES`` of logits (module docstring)."""

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """lm-eval's own scoring, the requests (longest first, as lm-eval orders them) cut where ``rows_within``
        changes and each part scored with that batch size; the results in the order of ``requests``."""
        asked = self.batch_size_per_gpu
        if not isinstance(asked, int):  # lm-eval's own "auto" batch size: its own scheduler
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        vocab = self.model.config.get_text_config().vocab_size

        def rows(index: int) -> int:  # lm-eval feeds context and continuation but the last token, at most max_length
            _, context, continuation = requests[index]
            return rows_within(min(len(context) + len(continuation) - 1, self.max_length), vocab, asked)

        order = sorted(range(len(requests)), key=rows)  # fewest rows first: the longest requests
        results: dict[int, tuple[float, bool]] = {}
        try:
            for batch_size, part in groupby(order, key=rows):
                indices = list(part)
                self.batch_size_per_gpu = batch_size
                scores = super()._loglikelihood_tokens([requests[i] for i in indices], disable_tqdm=disable_tqdm)
                results.update(zip(indices, scores, strict=True))
        finally:
            self.batch_size_per_gpu = asked
        return [results[i] for i in range(len(requests))]
