"""Greedy continuations: equal to a plain argmax loop without cache, the same for the GQA model and its
MHA copy, and the ``generate`` command side by side on a pruned directory and the dense model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import STORIES, STORIES_MHA, needs_stories

from rcpu_bench.cli import main
from rcpu_bench.evaluation.generation import SAMPLE_PROMPT, SAMPLE_TOKENS, greedy_continuation, text_sample
from rcpu_bench.model.loading import load_model
from rcpu_bench.model.persistence import load_pruned, save_pruned
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model


def argmax_loop(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """The greedy continuation by hand: the whole sequence re-run at each step, argmax of the last logits,
    stopping after the end-of-sequence token; the text beyond the prompt's."""
    ids = tokenizer(prompt).input_ids
    start = len(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == model.config.eos_token_id:
                break
    prompt_text = tokenizer.decode(ids[:start], skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True)[len(prompt_text):]


@pytest.fixture
def models(stories_260k):
    return stories_260k


@needs_stories
@pytest.mark.parametrize("prompt, new_tokens", [pytest.param(SAMPLE_PROMPT, 24, marks=pytest.mark.slow),
                                                pytest.param("Tom and his dog", 40, marks=pytest.mark.slow),
                                                ("The", 3)])
def test_greedy_continuation_equals_an_argmax_loop(models, prompt, new_tokens):
    texts = {name: greedy_continuation(m.model, m.tokenizer, prompt, new_tokens) for name, m in models.items()}
    expected = argmax_loop(models["gqa"].model, models["gqa"].tokenizer, prompt, new_tokens)
    assert texts["gqa"] == texts["mha"] == expected and expected
    assert text_sample(models["mha"].model, models["mha"].tokenizer) == {
        "prompt": SAMPLE_PROMPT, "text": argmax_loop(models["mha"].model, models["mha"].tokenizer, SAMPLE_PROMPT,
                                                     SAMPLE_TOKENS)}


def test_bad_token_counts_are_named():
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        greedy_continuation(None, None, "x", 0)


def run_generate(argv: list[str]) -> int:
    return main(["generate", *argv])


@pytest.mark.slow
@needs_stories
def test_generate_command_prints_pruned_and_dense_side_by_side(tmp_path, capsys):
    loaded = load_model(str(STORIES_MHA))
    calib = torch.randint(3, loaded.model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    prune_model(loaded.model, calib, PruneConfig(ratio=0.5), progress=False, registry=default_registry())
    save_pruned(loaded.model, tmp_path / "pruned", tokenizer=loaded.tokenizer)
    pruned, dense = load_pruned(tmp_path / "pruned"), load_model(str(STORIES_MHA))
    prompts = ["Once upon a time", "Lily saw a"]
    argv = ["--model", str(tmp_path / "pruned"), "--compare", str(STORIES_MHA), "--max-new-tokens", "12"]
    assert run_generate([*argv, *(x for p in prompts for x in ("--prompt", p))]) == 0
    lines = capsys.readouterr().out.splitlines()
    width = max(len(str(tmp_path / "pruned")), len(str(STORIES_MHA)))
    expected = []
    for prompt in prompts:
        expected.append(f"prompt: {prompt}")
        for name, loaded in ((str(tmp_path / "pruned"), pruned), (str(STORIES_MHA), dense)):
            expected.append(f"  {name:<{width}} | {prompt}{argmax_loop(loaded.model, loaded.tokenizer, prompt, 12)}")
    assert lines == [line.rstrip() for line in expected]
    assert lines[1].split("|")[1] != lines[2].split("|")[1]  # pruning by half changes the text


@needs_stories
@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--compare", "/no/such/dense"], "/no/such/dense"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--device", "gpu"], "gpu"),
])
def test_generate_command_reports_bad_input_before_work(args, message, capsys):
    assert run_generate(["--model", str(STORIES), *args]) == 2
    err = capsys.readouterr().err
    assert "rcpu-bench generate: error:" in err and message in err
