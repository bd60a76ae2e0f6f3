"""Perplexity profiles against hand-written one-sequence-at-a-time loops, batch invariance, the dense baseline."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_families import FAMILIES, family_model
from tiny_models import SHARED, STORIES, TINYSTORIES, WIKI_TEST
from transformers import AutoTokenizer, LlamaForCausalLM

from rcpu_bench import corpora, data, paths
from rcpu_bench.evaluation import perplexity as perplexity_module
from rcpu_bench.evaluation.perplexity import PROFILES, get_profile, perplexity, profile_sequences, token_nlls
from rcpu_bench.model.adapter import head_view

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason=f"shared fixtures not found (set {paths.SHARED_ENV})")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wiki_excerpt(tmp_path_factory) -> Path:
    """A data dir whose WikiText-2 test file is the first 60 lines of the real one (a few thousand tokens)."""
    data_dir = tmp_path_factory.mktemp("data")
    lines = WIKI_TEST.read_text(encoding="utf-8").splitlines(keepends=True)[:60]
    (data_dir / "wikitext-2-raw-v1").mkdir()
    (data_dir / "wikitext-2-raw-v1" / "wiki.test.raw").write_text("".join(lines), encoding="utf-8")
    return data_dir


def window_nlls(model, windows: torch.Tensor) -> list[float]:
    """Mean cross-entropy of each window over its shifted targets, one window at a time (RCPU's eval loop)."""
    with torch.no_grad():
        return [F.cross_entropy(model(w[None]).logits[0, :-1], w[1:]).item() for w in windows]


def story_nll(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()


@pytest.mark.slow  # 20-30 s on 2 loaded cores: a whole evaluation set against a per-sequence loop
def test_rcpu128_matches_a_window_by_window_loop(model, tok, wiki_excerpt):
    path = wiki_excerpt / "wikitext-2-raw-v1" / "wiki.test.raw"
    rows = [line if line.strip() else "" for line in path.read_text(encoding="utf-8").splitlines(keepends=True)]
    ids = tok("\n\n".join(rows), return_tensors="pt").input_ids[0]
    n_windows = ids.numel() // 128
    windows = ids[: n_windows * 128].view(n_windows, 128)
    losses = window_nlls(model, windows)

    result = perplexity(model, tok, "rcpu128", batch_size=5, data_dir=wiki_excerpt)
    assert ids[0] == tok.bos_token_id and (ids == tok.bos_token_id).sum() == 1
    assert result["ppl"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)
    assert result["nll_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert result["window_nll"] == pytest.approx([127 * loss for loss in losses], rel=1e-5)
    assert result["window_targets"] == [127] * n_windows
    assert {k: v for k, v in result.items() if k not in ("ppl", "nll_mean", "window_nll", "window_targets")} == {
        "profile": "rcpu128", "dataset": "wikitext2/test", "seqlen": 128, "n_windows": n_windows,
        "n_tokens": n_windows * 127, "dataset_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "batch_size": 5}


def test_rcpu128_bos_puts_the_bos_before_every_window_and_scores_all_its_tokens(model, tok, wiki_excerpt):
    stream = data.token_stream(corpora.wikitext2_text(wiki_excerpt, "test"), tok)
    assert stream[0] == tok.bos_token_id  # the stories tokenizer adds a BOS, which the profile moves to each window
    body = stream[1:]
    windows = body[: (body.numel() // 128) * 128].view(-1, 128)
    with torch.no_grad():
        expected = [F.cross_entropy(model(torch.cat([stream[:1], w])[None]).logits[0, :-1].double(), w,
                                    reduction="sum").item() for w in windows[:3]]
    result = perplexity(model, tok, "rcpu128-bos[0:3]", batch_size=2, data_dir=wiki_excerpt)
    assert (result["n_windows"], result["n_tokens"], result["window_targets"]) == (3, 3 * 128, [128] * 3)
    assert result["window_nll"] == pytest.approx(expected, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(sum(expected) / (3 * 128)), rel=1e-5)


@pytest.mark.slow  # 20-30 s on 2 loaded cores: a whole evaluation set against a per-sequence loop
def test_a_window_range_scores_exactly_those_windows(model, tok, wiki_excerpt):
    stream = data.token_stream(corpora.wikitext2_text(wiki_excerpt, "test"), tok)
    losses = window_nlls(model, stream[: (stream.numel() // 128) * 128].view(-1, 128))
    result = perplexity(model, tok, "rcpu128[2:5]", batch_size=2, data_dir=wiki_excerpt)
    assert (result["profile"], result["n_windows"], result["n_tokens"]) == ("rcpu128[2:5]", 3, 3 * 127)
    assert result["nll_mean"] == pytest.approx(sum(losses[2:5]) / 3, rel=1e-5)
    strided = perplexity(model, tok, "rcpu128[1:12:5]", batch_size=2, data_dir=wiki_excerpt)
    assert (strided["profile"], strided["n_windows"]) == ("rcpu128[1:12:5]", 3)  # windows 1, 6, 11
    assert strided["nll_mean"] == pytest.approx((losses[1] + losses[6] + losses[11]) / 3, rel=1e-5)


def test_std2048_is_capped_at_max_position_embeddings(model, tok, wiki_excerpt):
    result = perplexity(model, tok, "std2048", batch_size=3, data_dir=wiki_excerpt, max_windows=4)
    assert model.config.max_position_embeddings == 512
    assert (result["seqlen"], result["n_windows"], result["n_tokens"]) == (512, 4, 4 * 511)
    stream = data.token_stream(corpora.wikitext2_text(wiki_excerpt, "test"), tok)
    losses = window_nlls(model, stream[: 4 * 512].view(4, 512))
    assert result["ppl"] == pytest.approx(math.exp(sum(losses) / 4), rel=1e-5)


@pytest.mark.slow  # 20-30 s on 2 loaded cores: a whole evaluation set against a per-sequence loop
def test_tinystories_matches_a_story_by_story_loop_and_ignores_batch_size(model, tok):
    stories = [json.loads(line)["text"] for line in TINYSTORIES.read_text(encoding="utf-8").splitlines()][500:530]
    ids = [tok(story).input_ids[:512] for story in stories]
    assert all(s[0] == tok.bos_token_id for s in ids) and len({len(s) for s in ids}) > 10
    expected = sum(story_nll(model, s) for s in ids) / sum(len(s) - 1 for s in ids)

    one, seven = (perplexity(model, tok, "tinystories[500:530]", batch_size=b) for b in (1, 7))
    assert one["ppl"] == pytest.approx(seven["ppl"], rel=1e-5)
    assert one["nll_mean"] == pytest.approx(expected, rel=1e-5)
    assert (one["profile"], one["dataset"], one["n_windows"]) == ("tinystories[500:530]",
                                                                  "tinystories/validation[500:530]", 30)
    assert one["n_tokens"] == seven["n_tokens"] == sum(len(s) - 1 for s in ids)


def test_stories_longer_than_the_context_are_truncated(model, tok):
    lengths = [len(tok(json.loads(line)["text"]).input_ids) for line in TINYSTORIES.read_text().splitlines()]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    assert lengths[longest] > 512
    result = perplexity(model, tok, f"tinystories[{longest}:{longest + 1}]")
    assert result["n_tokens"] == 511


@pytest.mark.slow
def test_dense_stories260k_tinystories_baseline(model, tok):
    result = perplexity(model, tok, "tinystories", batch_size=16)
    assert (result["n_windows"], result["seqlen"]) == (1000, 512)
    assert result["ppl"] == pytest.approx(4.54, abs=0.02)


def test_the_training_mode_is_restored(tok, wiki_excerpt):
    model = LlamaForCausalLM.from_pretrained(STORIES, dtype=torch.float32).train()
    perplexity(model, tok, "rcpu128", data_dir=wiki_excerpt, max_windows=1)
    assert model.training


def test_profile_registry_and_errors(model, tok, wiki_excerpt):
    assert set(PROFILES) == {"rcpu128", "rcpu128-bos", "std2048", "cpython128", "tinystories"}
    assert get_profile("tinystories[500:1000]").stories == (500, 1000)
    assert get_profile("rcpu128[0:10]").windows == (0, 10) and get_profile("rcpu128[0:10]").stories is None
    assert get_profile("cpython128[3:20:4]").windows == (3, 20) and get_profile("cpython128[3:20:4]").step == 4
    with pytest.raises(ValueError, match="'wiki128'.*rcpu128, rcpu128-bos, std2048, cpython128, tinystories"):
        get_profile("wiki128")
    with pytest.raises(ValueError, match=r"'rcpu128\[5:5\]'.*STOP > START"):
        get_profile("rcpu128[5:5]")
    with pytest.raises(ValueError, match=r"'rcpu128\[0:9:0\]'.*step .* at least 1"):
        get_profile("rcpu128[0:9:0]")
    with pytest.raises(ValueError, match=r"'tinystories\[0:9:2\]'.*story profile takes \[START:STOP\] without"):
        get_profile("tinystories[0:9:2]")
    with pytest.raises(ValueError, match=r"gives only \d+ windows of 128 tokens; STOP must be at most"):
        perplexity(model, tok, "rcpu128[0:100000]", data_dir=wiki_excerpt)
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        perplexity(model, tok, "rcpu128", batch_size=0, data_dir=wiki_excerpt)
    with pytest.raises(ValueError, match="max_windows must be at least 1 or None, got 0"):
        perplexity(model, tok, "rcpu128", max_windows=0, data_dir=wiki_excerpt)


def test_missing_wikitext_test_file_offline_is_a_clear_error(model, tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="test split is not available offline.*tinystories profile"):
        perplexity(model, tok, "rcpu128", data_dir=tmp_path)


def test_cpython128_windows_are_the_test_files_stream_cut_into_128_tokens(tok):
    path = SHARED / "data" / "code" / "cpython-3.11-stdlib" / "test.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    ids = tok(path.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    windows = profile_sequences("cpython128[0:40:13]", tok, 128)
    assert [w.tolist() for w in windows] == [ids[i * 128:(i + 1) * 128].tolist() for i in (0, 13, 26, 39)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_chunked_lm_head_gives_the_models_own_token_nlls(family, monkeypatch):
    """Decoder once, LM head a few positions at a time (with the family's soft-capping or logit scaling) equals the
    cross-entropy of the model's own full logits, computed in float64."""
    model = family_model(family)
    torch.manual_seed(1)
    input_ids, mask = torch.randint(3, 512, (3, 9)), torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits.double()
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
        monkeypatch.setattr(perplexity_module, "LOGITS_BYTES", 4 * 512 * 5)  # five positions per chunk
        got = token_nlls(model, input_ids, mask, labels)
    assert head_view(model) is not None
    assert torch.allclose(got.double(), expected.view(3, 9), atol=1e-5, rtol=1e-5)
    assert (got[labels == -100] == 0).all()
