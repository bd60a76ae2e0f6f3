"""The real models of the ``[models]`` extra for the tests marked ``real_model``: each converted once (in the user's
cache, as a user would have it) and loaded once per session; a missing package fails the test with the pip command
that fixes it (a plain ``pytest`` deselects these tests; ``make test`` must run them)."""

from __future__ import annotations

import copy
import functools

import pytest

from rcpu_bench.model import real_models
from rcpu_bench.model.loading import LoadedModel, load_model

NAMES = tuple(name for name, model in real_models.MODELS.items() if model.extra == "models")  # the [models] extra's


def require(name: str) -> real_models.RealModel:
    """The real model ``name``; the test fails (not skips) when its package is missing or another version."""
    model = real_models.get(name)
    try:
        real_models.check_installed(model)
    except (ModuleNotFoundError, ValueError) as error:
        pytest.fail(f"{error} (the real-model tests need the [models] extra)")
    return model


@functools.cache
def _loaded(name: str) -> LoadedModel:
    return load_model(name)


def loaded(name: str) -> LoadedModel:
    """``load_model(name)`` (float32, CPU), loaded once per session; deep-copy before changing the model."""
    require(name)
    return _loaded(name)


def fresh(name: str) -> LoadedModel:
    """A copy of the session's model that a test may prune."""
    original = loaded(name)
    return LoadedModel(copy.deepcopy(original.model), original.tokenizer, dict(original.provenance))
