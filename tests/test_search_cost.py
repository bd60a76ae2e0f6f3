"""What a searched allocation costs, checked before any work: the tokens it scores (counted against a simulation of
its selection), the bytes its cache holds (against what it writes), the refusals above the bound or the free space,
a full disk met anyway, and the cache of a killed search removed by the next one."""

from __future__ import annotations

import copy
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import cli_run
from hypothesis import given, settings
from hypothesis import strategies as st
from registries import builtin_registry
from tiny_models import STORIES_MHA, needs_stories, tiny_config, tiny_model, tokens

from rcpu_bench.cli import main
from rcpu_bench.methods.search import fitness, genome, supernet
from rcpu_bench.model import loading
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model

REGISTRY = builtin_registry()
CONFIG = tiny_config(layers=3, n_heads=6, n_kv_heads=6, intermediate=20)
QUICK = {"population": 4, "generations": 2, "tokens": 12, "stages": 2, "growth": 2}
HELD_OUT = tokens(CONFIG.vocab_size, batch=8, length=12, seed=99)
PRUNE = ["prune", "--model", str(STORIES_MHA), "--calib", "tinystories:8x32", "--ppl", "tinystories[900:902]",
         "--quiet", "--allocation", "search"]


def run(model, cache, **params):
    config = PruneConfig(ratio=0.3, compensator="ridge", statistics="one-shot", allocation="search",
                         allocation_params={**QUICK, "cache": str(cache), **params})
    return prune_model(model, tokens(CONFIG.vocab_size, batch=4, length=12), config, registry=REGISTRY,
                       progress=False, holdout_source=lambda n: HELD_OUT[:n])


@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model was loaded before the refusal"))


# --- the estimates --------------------------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(population=st.integers(1, 12), stages=st.integers(1, 4), growth=st.integers(1, 4), tokens=st.integers(1, 300),
       seqlen=st.integers(1, 64), generations=st.integers(0, 3), seed=st.integers(0, 1000))
def test_the_token_estimate_is_what_the_selection_scores(population, stages, growth, tokens, seqlen, generations,
                                                         seed):
    """Simulated generations of ``population`` offspring: every window scored counted, plus the dense targets and
    the start's fitness on all held-out windows."""
    plan = genome.stage_plan(population, stages, growth, tokens, seqlen)
    scored = 2 * plan[-1][0]

    def score(choice, chosen):
        nonlocal scored
        scored += len(chosen)
        return random.Random(hash((choice, tuple(chosen)))).random()

    rng, parent, best = random.Random(seed), (-1,), 1.0
    for _ in range(generations):
        children = [(i,) for i in range(population)]
        parent, best = genome.select_parent(parent, best, children, score, plan, rng)
    assert fitness.scored_tokens(plan, population, generations, seqlen) == scored * seqlen


def test_the_cache_size_estimate_bounds_what_the_search_writes(tmp_path, monkeypatch):
    estimates = []
    check = supernet.check_free_space
    monkeypatch.setattr(supernet, "check_free_space",
                        lambda path, needed, *a, **k: (estimates.append(needed), check(path, needed, *a, **k)))
    kept = run(tiny_model(CONFIG), tmp_path, keep=True).method_report["allocation"]
    files = [p for p in Path(kept["cache"]).rglob("*") if p.is_file()]
    written = sum(p.stat().st_size for p in files)
    assert set(estimates) == {estimates[0]} and written == kept["cache_bytes"]
    assert written <= estimates[0] <= written + len(files) * supernet.FILE_OVERHEAD


# --- refused before the model loads ---------------------------------------------------------------------------------

@needs_stories
def test_a_runaway_search_is_refused_before_loading_with_its_estimate_and_bound(capsys, no_loading, tmp_path):
    code, err = cli_run([*PRUNE, "--allocation-param", "generations=1000000000", "--allocation-param",
                     f"cache='{tmp_path}'"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("allocation 'search' with generations=1000000000, population=16, tokens=256, stages=3, growth=4 scores "
            "about 12,288,000,008,192 tokens (128 held-out windows of 32); allowed: at most max_scored_tokens="
            "16,777,216 (raise it, or max_scored_tokens=None for no bound)") in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bound", [0, -5, "many", True, 1.5])
def test_a_bound_that_is_no_bound_is_refused_and_none_opts_out(bound):
    with pytest.raises(ValueError, match=r"max_scored_tokens=.*; allowed: (an integer >= 1, or None|a number)"):
        PruneConfig(allocation="search", allocation_params={"max_scored_tokens": bound}).validate(REGISTRY)
    PruneConfig(allocation="search", allocation_params={"max_scored_tokens": None}).validate(REGISTRY)


@needs_stories
def test_a_cache_without_the_room_is_refused_before_loading(capsys, no_loading, monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    code, err = cli_run([*PRUNE, "--allocation-param", f"cache='{tmp_path}'"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"allocation 'search' parameter cache {tmp_path}: the candidates need about " in err
    assert f"and {tmp_path} has 4 KiB free; allowed: a cache directory with that much free space" in err


@needs_stories
def test_a_cache_that_cannot_be_written_is_named_as_the_cache_parameter(capsys, no_loading, tmp_path):
    (tmp_path / "file").write_text("x")
    code, err = cli_run([*PRUNE, "--allocation-param", f"cache='{tmp_path / 'file' / 'cache'}'"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"allocation 'search' parameter cache {tmp_path / 'file' / 'cache'}: {tmp_path / 'file'} is not a " \
           "directory" in err


@needs_stories
def test_more_held_out_windows_than_the_source_gives_are_blamed_on_the_search(capsys, no_loading, tmp_path):
    code, err = cli_run([*PRUNE, "--allocation-param", "tokens=300000", "--allocation-param", "stages=1",
                     "--allocation-param", "generations=0", "--allocation-param", f"cache='{tmp_path}'"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "allocation 'search' with {'tokens': 300000, 'stages': 1, 'generations': 0" in err
    assert "(9,375 windows) asks for more held-out windows than tinystories:8x32:seed=0 can give" in err
    assert "holdout=" not in err and "allowed: at most 6,150 held-out windows in all" in err


# --- a full disk met anyway; a killed search's cache ----------------------------------------------------------------

def test_a_full_disk_while_writing_candidates_is_one_oserror_and_the_model_stays_dense(tmp_path, monkeypatch):
    dense = tiny_model(CONFIG)
    model = copy.deepcopy(dense)
    write = Path.write_bytes

    def full_after_two(path, data, written=[]):  # noqa: B006 (counts the writes)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path)
        return write(path, data)

    monkeypatch.setattr(Path, "write_bytes", full_after_two)
    with pytest.raises(OSError, match=r"allocation 'search': cannot write .*\.pt in its cache \(No space left on "
                                      r"device\); the cache is removed"):
        run(model, tmp_path)
    assert list(tmp_path.iterdir()) == []
    for (name, a), (_, b) in zip(dense.state_dict().items(), model.state_dict().items(), strict=True):
        assert a.equal(b), name


@pytest.mark.slow
@needs_stories
def test_the_cache_of_a_killed_search_is_removed_by_the_next_one_and_a_live_ones_is_not(tmp_path):
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "rcpu_bench.cli", *PRUNE, "--allocation-param", f"cache='{cache}'",
            "--allocation-param", "generations=100000", "--allocation-param", "max_scored_tokens=None"]
    killed = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    deadline = time.monotonic() + 300
    while not list(cache.glob(".search-candidates.*.partial/targets")) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (orphan,) = cache.glob(".search-candidates.*.partial")
    assert f".{killed.pid}." in orphan.name
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = cache / f".search-candidates.{alive.pid}.busy0000.partial"
        live.mkdir()
        assert main([*PRUNE, "--allocation-param", f"cache='{cache}'", "--allocation-param", "generations=1"]) == 0
        assert list(cache.iterdir()) == [live]
    finally:
        alive.kill()
        alive.wait()
