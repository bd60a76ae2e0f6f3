"""Every test runs offline (any accidental Hugging Face hub access fails fast instead of retrying), sees the
built-in methods only (``registries.with_plugins`` opts a test in to chosen plugins), and shares one load of the
stories260K fixture models (``stories_260k``: tests that change a model change a copy). Property tests have no
deadline: speed is measured by the benchmarks, and a busy machine must not fail a correct example."""

import os

import pytest
from hypothesis import settings
from tiny_models import STORIES, STORIES_MHA

from rcpu_bench.plugins import DISABLE_AUTOLOAD

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")


@pytest.fixture(autouse=True)
def builtin_methods_only(monkeypatch):
    """``default_registry()`` (in this process and in the commands a test starts) holds the built-ins only."""
    monkeypatch.setenv(DISABLE_AUTOLOAD, "1")


@pytest.fixture(scope="session")
def stories_260k():
    """{"gqa": stories260K, "mha": stories260K-mha} as ``load_model`` returns them (float32, CPU, eval), loaded
    once per session; skipped without the shared fixtures. Deep-copy a model before changing it."""
    if not STORIES.is_dir() or not STORIES_MHA.is_dir():
        pytest.skip(f"fixture models not found ({STORIES})")
    from rcpu_bench.model.loading import load_model

    return {"gqa": load_model(str(STORIES)), "mha": load_model(str(STORIES_MHA))}
