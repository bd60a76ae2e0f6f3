"""Inference speed: the record's fields, the token counts each timed step really processes, the median
and rate arithmetic, and the record of every experiment (no timing assertions)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import STORIES_MHA, needs_stories, tiny_config, tiny_model

from rcpu_bench.evaluation import speed
from rcpu_bench.evaluation.generation import text_sample
from rcpu_bench.evaluation.speed import inference_speed
from rcpu_bench.experiment import Experiment, run_experiment
from rcpu_bench.model.persistence import load_pruned
from rcpu_bench.pruning.pipeline import PruneConfig

FIELDS = {"batch_size", "prompt_tokens", "new_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "device",
          "repeats"}


def record_forwards(model) -> list[tuple[tuple[int, ...], int]]:
    """(input_ids shape, cached positions before the call) of every forward pass of ``model`` from now on."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # "cache" from transformers 5.24
        calls.append((tuple(ids.shape), 0 if cache is None else cache.get_seq_length()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_fields_values_and_the_tokens_each_step_processes():
    model = tiny_model(tiny_config())
    calls = record_forwards(model)
    rng = torch.get_rng_state()
    result = inference_speed(model, batch_size=2, prompt_tokens=16, new_tokens=5, repeats=2)
    assert set(result) == FIELDS
    assert (result["batch_size"], result["prompt_tokens"], result["new_tokens"], result["repeats"]) == (2, 16, 5, 2)
    assert result["device"] == "cpu"
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in ("prefill_tokens_per_s", "decode_tokens_per_s"))
    # Warm-up: a prefill and one decode step; then per repeat a prefill of 2 x 16 and 5 steps of 2 x 1 on the cache.
    run = [((2, 16), 0)] + [((2, 1), 16 + step) for step in range(5)]
    assert calls == run[:2] + run * 2
    assert torch.equal(torch.get_rng_state(), rng)


def test_rates_are_tokens_over_the_median_seconds(monkeypatch):
    seconds = iter([(9.0, 9.0), (0.5, 2.0), (0.1, 1.0), (0.3, 4.0)])  # the warm-up first, then three repeats
    monkeypatch.setattr(speed, "prefill_and_decode", lambda model, ids, new_tokens: next(seconds))
    result = inference_speed(tiny_model(tiny_config()), batch_size=3, prompt_tokens=10, new_tokens=4, repeats=3)
    assert result["prefill_tokens_per_s"] == pytest.approx(3 * 10 / 0.3)
    assert result["decode_tokens_per_s"] == pytest.approx(3 * 4 / 2.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_tokens": 60, "new_tokens": 5}, "prompt_tokens + new_tokens = 65 exceeds the model's "
                                             "max_position_embeddings 64"),
    ({"repeats": 0}, "repeats must be a positive integer, got 0"),
    ({"batch_size": True}, "batch_size must be a positive integer, got True"),
    ({"new_tokens": 1.5}, "new_tokens must be a positive integer, got 1.5"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError) as raised:
        inference_speed(tiny_model(tiny_config()), **kwargs)
    assert message in str(raised.value)


@pytest.mark.slow
@needs_stories
def test_every_experiment_records_its_speed_and_a_text_sample(tmp_path):
    """The pruned model's sample, read back from the saved directory, is the record's."""
    record = run_experiment(Experiment(model=str(STORIES_MHA), prune=PruneConfig(ratio=0.25), calib="tinystories:8x64",
                                       ppl_profiles=("tinystories[0:4]",), save_dir=str(tmp_path / "pruned")),
                            progress=False)
    assert set(record.inference) == FIELDS and record.inference["prompt_tokens"] == speed.PROMPT_TOKENS
    saved = load_pruned(tmp_path / "pruned")
    assert record.sample == text_sample(saved.model, saved.tokenizer)
    assert record.sample["text"]
