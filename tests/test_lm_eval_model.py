"""lm-eval with bounded logits memory: the batch sizes it picks, and the same scores as lm-eval's own HFLM."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rcpu_bench.evaluation import lm_eval_model
from rcpu_bench.evaluation.lm_eval_model import BoundedHFLM, rows_within
from rcpu_bench.evaluation.zeroshot import evaluate_zeroshot


@given(st.integers(1, 4096), st.integers(2, 300_000), st.integers(1, 64), st.integers(1, 1 << 32))
def test_a_batch_fits_the_budget_unless_one_row_alone_does_not(length, vocab, batch_size, budget):
    rows = rows_within(length, vocab, batch_size, budget)
    assert 1 <= rows <= batch_size
    assert rows == 1 or rows * length * vocab * 4 <= budget
    assert rows == batch_size or (rows + 1) * length * vocab * 4 > budget  # the largest that fits


@pytest.mark.slow  # lm-eval twice on three tasks (about 30 s)
def test_bounded_batches_score_every_item_as_lm_evals_own_batches(stories_260k, monkeypatch):
    """A budget of about 40 tokens of logits splits lm-eval's batches of 8 into batches of 1 to 4 rows; every
    document's score is lm-eval's own."""
    from lm_eval.models.huggingface import HFLM

    stories = stories_260k["gqa"]
    run = {"tasks": ("piqa", "arc_easy", "winogrande"), "limit": 12, "batch_size": 8, "source": "local"}
    monkeypatch.setattr(lm_eval_model, "LOGITS_BYTES", 4 * 512 * 40)
    batches = []
    original = HFLM._loglikelihood_tokens

    def recording(self, requests, disable_tqdm=False, override_bs=None):
        batches.append(self.batch_size_per_gpu)
        return original(self, requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    monkeypatch.setattr(HFLM, "_loglikelihood_tokens", recording)
    bounded = evaluate_zeroshot(stories.model, stories.tokenizer, **run)
    assert batches and max(batches) < 8 and 1 in batches
    monkeypatch.setattr(BoundedHFLM, "_loglikelihood_tokens", original)
    plain = evaluate_zeroshot(stories.model, stories.tokenizer, **run)
    for task in run["tasks"]:
        assert bounded["tasks"][task]["items"] == plain["tasks"][task]["items"], task
